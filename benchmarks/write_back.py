"""The cost of `write_back`: per-step values written into the stored steps a sample read,
against the same scatter on raw arrays.

The issue's bar: write-back of 64 windows x 80 steps of a 256-float state within 1.5x of the same
scatter on raw arrays. A full `TrajectoryBuffer` of 64 envs x 1,000 steps `{"obs": f32[16],
"state": f32[256], "done": bool[]}`, `written_back=("state",)`. The stamps come from real
samples, `buf.sample(key, 64, dx.Window(80))` (drawn before the timing: `SCANS` of them); a
window that runs past its env's newest step writes nothing there (`mask=sample.mask`). Each
timed call runs, in one jitted function with the state donated, a `lax.scan` over the `SCANS`
samples (so a call is not dispatch), each step writing `f32[64, 80, 256]` of `state`:

- `dejax_eqx`: `buf.write_back(sample.env, sample.start, {"state": values},
    mask=sample.mask)`, the number of dropped entries summed (so the report is computed, as a
    learner that logs it computes it);
- `dejax_eqx, throw=False`: the same on a buffer built with `throw=False` (its faults kept
    as a `Result`, no error callback);
- `raw`: the floor, `state` as a plain `f32[64, 1000, 256]` and the same scatter of the same
    slots, `storage.at[rows, slots].set(values, mode="drop")`, with `rows` and `slots`
    computed before the timing (a masked entry's row out of range: dropped); no stale check,
    and where windows overlap XLA's scatter picks any of the rows (no "later rows win");
- `raw, checked`: `raw` with `write_back`'s own work written in `jax.numpy` (the slots from
    the stamps, the stored test, later rows winning by a scatter-max into a table of the
    cells, as `_streams._last_wins` does at this size): what
    the semantics cost on raw arrays, apart from the library's checks and structure;

All are timed in one process, their repeats interleaved (`_harness.time_interleaved`), and
printed as microseconds per write-back and the ratios against `raw` (and of `dejax_eqx`
against `raw, checked`). Also printed: how many of the 64 x 80 entries of each sample share
their step with another entry (overlapping windows), the entries that "later rows win" decides.

    python -m benchmarks.write_back            # 15 repeats
    python -m benchmarks.write_back --quick    # a smoke run
"""

import argparse
import statistics

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


ENVS, LENGTH, BATCH, SEQ, SCANS, WIDTH = 64, 1_000, 64, 80, 10, 256


def _buffer(envs: int, length: int, *, throw: bool = True) -> dx.TrajectoryBuffer:
    step = {"obs": jnp.zeros(16), "state": jnp.zeros(WIDTH), "done": jnp.zeros((), bool)}
    buf = dx.TrajectoryBuffer(step, envs, length, written_back=("state",), throw=throw)
    rng = np.random.default_rng(0)
    steps = {
        "obs": rng.normal(size=(envs, length, 16)).astype(np.float32),
        "state": rng.normal(size=(envs, length, WIDTH)).astype(np.float32),
        "done": rng.random((envs, length)) < 0.01,
    }
    return buf.extend(jax.tree.map(jnp.asarray, steps))


def _duplicates(env: np.ndarray, slots: np.ndarray, mask: np.ndarray) -> int:
    """How many of the masked-in entries `(env, slot)` share their cell with another one."""
    cells = (env[:, None] * LENGTH + slots)[mask]
    _, counts = np.unique(cells, return_counts=True)
    return int(counts[counts > 1].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    envs, length, batch, seq, scans = (
        (4, 50, 8, 10, 2)
        if args.quick
        else (
            ENVS,
            LENGTH,
            BATCH,
            SEQ,
            SCANS,
        )
    )
    repeats = 2 if args.quick else args.repeats
    buf = _buffer(envs, length)
    keys = jax.random.split(jax.random.key(0), scans)
    samples = [buf.sample(k, batch, dx.Window(seq)) for k in keys]
    env = jnp.stack([s.env for s in samples])  # (scans, batch)
    start = jnp.stack([s.start for s in samples])
    mask = jnp.stack([s.mask for s in samples])  # (scans, batch, seq)
    values = jax.random.normal(jax.random.key(1), (batch, seq, WIDTH), jnp.float32)
    # The raw floor's indices, with the same ring arithmetic, before the timing.
    slots = (start[:, :, None] + jnp.arange(seq, dtype=jnp.int32)) % length
    rows = jnp.where(mask, env[:, :, None], envs)
    dups = [
        _duplicates(*(np.asarray(x) for x in (env[i], slots[i], mask[i]))) for i in range(scans)
    ]
    entries = batch * seq

    def dejax(state, _):
        def one(carry, xs):
            b, dropped = carry
            e, s, m = xs
            b, report = b.write_back(e, s, {"state": values}, mask=m)
            return (b, dropped + report.num_dropped), None

        return jax.lax.scan(one, state, (env, start, mask))[0]

    def raw(storage, _):
        def one(x, xs):
            r, s = xs
            return x.at[r, s].set(values, mode="drop"), None

        return jax.lax.scan(one, storage, (rows, slots))[0]

    # Copies: `buf` is donated by the first call of `dejax`.
    count, stored_length = jnp.array(buf.streams.step_count), jnp.array(buf.streams.lengths)
    t = jnp.arange(seq, dtype=jnp.int32)[None, :]

    def checked(storage, _):
        """`raw` with `write_back`'s own work, in `jax.numpy`: the slots from the stamps, the
        stored test, and later rows winning by a scatter-max of the entries' numbers into a
        table of the cells, as `write_back` decides them at this size."""

        def one(x, xs):
            e, s, m = xs
            ahead, oldest = (count[e] - s)[:, None], (count[e] - stored_length[e] - s)[:, None]
            live = m & (t < ahead) & (t >= oldest)
            cell = (s % length)[:, None] + t
            cell = jnp.where(cell >= length, cell - length, cell)
            rows = jnp.where(live, e[:, None], envs)
            order = jnp.arange(batch * seq, dtype=jnp.int32).reshape(batch, seq)
            table = jnp.full((envs, length), -1, jnp.int32).at[rows, cell].max(order, mode="drop")
            won = live & (table.at[rows, cell].get(mode="fill", fill_value=-1) == order)
            r = jnp.where(won, e[:, None], envs)
            return x.at[r, cell].set(values, mode="drop"), None

        return jax.lax.scan(one, storage, (env, start, mask))[0]

    def zero():  # each state its own (a donated array is gone)
        return jnp.zeros((), jnp.int32)

    runs = {
        "dejax_eqx": (jax.jit(dejax, donate_argnums=0), (buf, zero())),
        "dejax_eqx, throw=False": (
            jax.jit(dejax, donate_argnums=0),
            (_buffer(envs, length, throw=False), zero()),
        ),
        "raw": (jax.jit(raw, donate_argnums=0), jnp.array(buf.data["state"])),
        "raw, checked": (jax.jit(checked, donate_argnums=0), jnp.array(buf.data["state"])),
    }
    m = h.machine()
    print(f"{m['cpu']}, jax {m['jax']}, load {m['load_before']}")
    print(
        f"{batch} windows x {seq} steps of f32[{WIDTH}] into {envs} envs x {length} steps, "
        f"{scans} write-backs per call; µs per write-back (median of {repeats})"
    )
    print(
        f"masked out (past the newest step): {int((~np.asarray(mask)).sum())} of "
        f"{scans * entries} entries; sharing a step with another entry: "
        f"{', '.join(map(str, dups))} of {entries} per sample (mean "
        f"{100 * statistics.mean(dups) / entries:.1f}%)"
    )
    seconds = h.time_interleaved(runs, repeats)
    median = {name: statistics.median(s) / scans * 1e6 for name, s in seconds.items()}
    print(", ".join(f"{name} {us:.1f}" for name, us in median.items()))
    for name, base in (
        ("dejax_eqx", "raw"),
        ("dejax_eqx, throw=False", "raw"),
        ("raw, checked", "raw"),
        ("dejax_eqx", "raw, checked"),
    ):
        ratio = [a / b for a, b in zip(seconds[name], seconds[base])]
        print(
            f"{name} / {base} {statistics.median(ratio):.2f}x "
            f"(repeats {min(ratio):.2f}-{max(ratio):.2f}x)"
        )
    print(f"load after {h.load_average()}")


if __name__ == "__main__":
    main()
