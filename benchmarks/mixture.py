"""The cost of a mixture: one batch from three sources against three separate samples.

Issue 41: a mixed batch of 256 from three sources within 1.2x of three separate samples of
the same rows. Three full buffers of 64 envs x 1,000 steps `{"obs": f32[16], "reward": f32[],
"done": bool[]}`: an offline `TrajectoryBuffer`, an online `TrajectoryBuffer` and a
`PrioritisedTrajectoryBuffer` (priorities drawn at random); windows of 8 steps, 64 + 128 + 64
rows (fractions 0.25, 0.5, 0.25). Each timed call draws 20 batches in a `lax.scan` (so a call
is not dispatch), of:

- separate: the three buffers' `sample`s of 64, 128 and 64 rows;
- mixed, static: `dx.Mixture.sample` with Python fractions (the counts are static);
- mixed, traced: the fractions traced (a schedule), each part drawing the whole batch and
    keeping its rows;
- mixed, traced with `max_fraction` (0.5, 0.75, 0.5): each part draws what its bound allows;

all timed in one process, their repeats interleaved (`_harness.time_interleaved`), and printed
as microseconds per batch and ratios against the separate samples. Also timed beside them, the
raw floor: a gather of 256 random windows of one buffer's storage with `jax.numpy` indexing.

    python -m benchmarks.mixture            # 15 repeats
    python -m benchmarks.mixture --quick    # a smoke run
"""

import argparse
import statistics

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


ENVS, LENGTH, BATCH, DRAWS, SEQ = 64, 1_000, 256, 20, 8
FRACTIONS = (0.25, 0.5, 0.25)
BOUNDS = (0.5, 0.75, 0.5)


def _steps(envs: int, length: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": jnp.asarray(rng.normal(size=(envs, length, 16)).astype(np.float32)),
        "reward": jnp.asarray(rng.normal(size=(envs, length)).astype(np.float32)),
        "done": jnp.asarray(rng.random((envs, length)) < 0.01),
    }


def _buffers(envs: int, length: int) -> dict:
    step = {"obs": jnp.zeros(16), "reward": jnp.zeros(()), "done": jnp.zeros((), bool)}
    window = dx.Window(SEQ, strict=True)
    offline = dx.TrajectoryBuffer(step, envs, length).extend(_steps(envs, length, 0))
    online = dx.TrajectoryBuffer(step, envs, length).extend(_steps(envs, length, 1))
    per = dx.PrioritisedTrajectoryBuffer(step, envs, length, window=window)
    per = per.extend(_steps(envs, length, 2))
    rng = np.random.default_rng(3)
    envs_ids = np.repeat(np.arange(envs, dtype=np.int32), length - SEQ + 1)
    starts = np.tile(np.arange(length - SEQ + 1, dtype=np.int32), envs)
    priorities = rng.uniform(0.1, 2.0, size=len(starts)).astype(np.float32)
    per = per.set_priorities(envs_ids, starts, priorities)
    return {"offline": offline, "online": online, "per": per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    envs, length, draws = (4, 50, 2) if args.quick else (ENVS, LENGTH, DRAWS)
    repeats = 2 if args.quick else args.repeats
    buffers = _buffers(envs, length)
    window = dx.Window(SEQ, strict=True)
    sizes = [round(f * BATCH) for f in FRACTIONS]

    def parts(bounds=(None, None, None)):
        return dx.Mixture(
            {
                "offline": dx.Part("offline", window, max_fraction=bounds[0]),
                "online": dx.Part("online", window, max_fraction=bounds[1]),
                "per": dx.Part("per", beta=0.6, max_fraction=bounds[2]),
            }
        )

    mixture, bounded = parts(), parts(BOUNDS)

    def scan(sample):
        @jax.jit
        def step(state, key):
            def one(total, key):
                leaves = jax.tree.leaves(sample(buffers, key, state))
                return total + sum(jnp.sum(x.astype(jnp.float32)) for x in leaves), None

            total, _ = jax.lax.scan(one, state, jax.random.split(key, draws))
            return total

        return step, jnp.zeros(())

    def separate(b, key, _):
        keys = jax.random.split(key, 3)
        return (
            b["offline"].sample(keys[0], sizes[0], window),
            b["online"].sample(keys[1], sizes[1], window),
            b["per"].sample(keys[2], sizes[2], beta=0.6),
        )

    def traced(mix):
        def sample(b, key, state):
            # A fraction that is data (state is 0 at run time): a schedule's.
            f = jnp.asarray(FRACTIONS, jnp.float32) + state * 0
            return mix.sample(key, BATCH, b, f)[1]

        return sample

    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), buffers["online"].streams.data)

    def raw(_, key, __):
        rows = jax.random.randint(key, (BATCH, 1), 0, envs * length - SEQ)
        return jax.tree.map(lambda x: x[rows + jnp.arange(SEQ)], flat)

    runs = {
        "raw gather": scan(raw),
        "separate": scan(separate),
        "mixed, static": scan(lambda b, k, _: mixture.sample(k, BATCH, b, FRACTIONS)[1]),
        "mixed, traced": scan(traced(mixture)),
        "mixed, traced, max_fraction": scan(traced(bounded)),
    }
    m = h.machine()
    print(f"{m['cpu']}, jax {m['jax']}, load {m['load_before']}")
    print(
        f"batch {BATCH} = {' + '.join(map(str, sizes))} windows of {SEQ} from three buffers of "
        f"{envs} envs x {length} steps; µs per batch (median of {repeats})"
    )
    seconds = h.time_interleaved(runs, repeats)
    median = {name: statistics.median(s) / draws * 1e6 for name, s in seconds.items()}
    print(", ".join(f"{name} {us:.1f}" for name, us in median.items()))
    for name in ("mixed, static", "mixed, traced", "mixed, traced, max_fraction"):
        ratio = [a / b for a, b in zip(seconds[name], seconds["separate"])]
        floor = [a / b for a, b in zip(seconds[name], seconds["raw gather"])]
        print(
            f"{name} / separate {statistics.median(ratio):.2f}x "
            f"(repeats {min(ratio):.2f}-{max(ratio):.2f}x); / raw {statistics.median(floor):.2f}x"
        )


if __name__ == "__main__":
    main()
