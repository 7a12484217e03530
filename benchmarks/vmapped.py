"""Every buffer's add-and-sample step inside a `lax.scan`, vmapped over 3 buffers and not.

Issue 38: a `jax.vmap` over seeds (PureJaxRL's `jax.jit(jax.vmap(make_train(config)))`) made
the buffers' writes slow on jax 0.5.3, where XLA:CPU rewrites every scatter, batched or not,
into a `while` loop of one `dynamic-update-slice` per written row. This module times, for
every buffer, the same step on one buffer and on a batch of 3 under `jax.vmap`, in the same
process, the repeats interleaved (`_harness.time_interleaved`), and prints a table of
microseconds per step (one step of the scan: one step of every buffer of the batch) and the
ratio vmapped / one buffer. The drop-in's flat buffer runs beside flashbax's own
`make_flat_buffer` (when flashbax is installed), and its vmapped step is compared with
flashbax's.

Run from the repository root (not a workload of `python -m benchmarks`: its rows are timed in
one process, as ratios of each other):

    python -m benchmarks.vmapped            # 200 steps a call, 15 repeats
    python -m benchmarks.vmapped --quick    # a smoke run (CI)
    python -m benchmarks.vmapped --only uniform "flat (drop-in)"

The item is PureJaxRL's DQN transition, `{"obs": f32[4], "action": i32[], "reward": f32[],
"done": bool[]}`; every buffer holds 10,000 of them and is full before timing. Per step:

- `UniformReplay`, `PrioritisedReplay`: `add_batch` of 10 items, `sample` of 128.
- `ClusteredReplay`: two `UniformReplay` clusters of 5,000 (by the sign of the reward),
    `add_batch` of 10 (each cluster a masked add), `sample` of 128.
- `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`: 10 envs of 1,000 steps; `add` of one
    step per env, `sample` of 128 windows of 2 steps.
- `TrajectoryQueue`: 10 envs of 1,000 steps holding 500 unread; `add` of one step per env,
    `pop(1)`.
- `flat (drop-in)`, `flat (flashbax)`: `make_flat_buffer(max_length=10_000, min_length=128,
    sample_batch_size=128, add_batch_size=10)` (PureJaxRL's DQN), `add` of 10, `sample`.

Each buffer's items come from the scan's inputs (made before timing), so a step times the
buffer's work and the draw of its keys, not the making of items.
"""

import argparse
import importlib
import statistics
from collections.abc import Callable
from typing import Any

import dejax_eqx as dx
import jax
import jax.numpy as jnp

from . import _harness as h


LANES = 3  # buffers in the vmapped batch (PureJaxRL's seeds, in the issue)
CAPACITY = 10_000
ADD = 10  # items per add_batch; envs of the trajectory buffers
ROWS = 128  # sampled per step
LENGTH = CAPACITY // ADD  # steps per env of the trajectory buffers


def _items(key, n: int) -> dict[str, jax.Array]:
    """`n` random transitions of PureJaxRL's DQN on CartPole (obs of 4 floats)."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "obs": jax.random.normal(k1, (n, 4), jnp.float32),
        "action": jax.random.randint(k2, (n,), 0, 2, jnp.int32),
        "reward": jax.random.normal(k3, (n,), jnp.float32),
        "done": jnp.arange(n) % 50 == 0,
    }


def _prototype() -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x[0], _items(jax.random.key(0), 1))


def _by_reward(item) -> jax.Array:
    return (item["reward"] > 0).astype(jnp.int32)


def _steps(items: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`[ADD * T, ...]` items as `[ADD, T, ...]` steps: one stream per env."""
    return jax.tree.map(lambda x: x.reshape(ADD, -1, *x.shape[1:]).swapaxes(0, 1), items)


# Each buffer: `make(key) -> state` (full, or holding the queue's unread steps), and
# `step(state, key, items) -> (state, scalar)` with `items` of `ADD` transitions.
Make = Callable[[Any], Any]
Step = Callable[[Any, Any, Any], tuple[Any, jax.Array]]


def _replay(kind: str) -> tuple[Make, Step]:
    def make(key):
        proto = _prototype()
        if kind == "uniform":
            buf = dx.UniformReplay(proto, CAPACITY)
        elif kind == "prioritised":
            buf = dx.PrioritisedReplay(proto, CAPACITY)
        else:
            buf = dx.ClusteredReplay(dx.UniformReplay(proto, CAPACITY // 2), 2, _by_reward)
        return buf.add_batch(_items(key, CAPACITY))

    def step(buf, key, items):
        buf = buf.add_batch(items)
        sample = buf.sample(key, ROWS)
        return buf, h.consume(sample)

    return make, step


def _trajectory(kind: str) -> tuple[Make, Step]:
    def make(key):
        proto = _prototype()
        if kind == "trajectory":
            buf = dx.TrajectoryBuffer(proto, ADD, LENGTH)
        elif kind == "prioritised trajectory":
            buf = dx.PrioritisedTrajectoryBuffer(proto, ADD, LENGTH, dx.Window(2, strict=True))
        else:
            buf = dx.TrajectoryQueue(proto, ADD, LENGTH)
        n = CAPACITY // 2 if kind == "queue" else CAPACITY
        return buf.extend(jax.tree.map(lambda x: x.swapaxes(0, 1), _steps(_items(key, n))))

    def step(buf, key, items):
        buf = buf.add(items)
        if kind == "queue":
            popped, buf = buf.pop(1)
            return buf, h.consume(popped)
        if kind == "prioritised trajectory":
            return buf, h.consume(buf.sample(key, ROWS).sample.items)
        return buf, h.consume(buf.sample(key, ROWS, dx.Window(2)))

    return make, step


def _flat(module: str) -> tuple[Make, Step]:
    fbx = importlib.import_module(module)
    buffer = fbx.make_flat_buffer(
        max_length=CAPACITY, min_length=ROWS, sample_batch_size=ROWS, add_batch_size=ADD
    )

    def make(key):
        def add(state, items):
            return buffer.add(state, items), None

        return jax.lax.scan(add, buffer.init(_prototype()), _steps(_items(key, CAPACITY)))[0]

    def step(state, key, items):
        state = buffer.add(state, items)
        return state, h.consume(buffer.sample(state, key).experience)

    return make, step


BUFFERS: dict[str, Callable[[], tuple[Make, Step]]] = {
    "uniform": lambda: _replay("uniform"),
    "prioritised": lambda: _replay("prioritised"),
    "clustered": lambda: _replay("clustered"),
    "trajectory": lambda: _trajectory("trajectory"),
    "prioritised trajectory": lambda: _trajectory("prioritised trajectory"),
    "queue": lambda: _trajectory("queue"),
    "flat (drop-in)": lambda: _flat("dejax_eqx.compat.flashbax"),
    "flat (flashbax)": lambda: _flat("flashbax"),
}


def _runs(name: str, steps: int, inside: bool = False) -> dict[str, tuple[Callable, Any]]:
    """`{"<name>": (call, state), "<name>, vmapped": (call, state)}` for `h.time_interleaved`:
    `call(state, key)` runs `steps` steps of the scan, donating the state.

    With `inside`, as PureJaxRL's `jit(vmap(train))`: the buffer is made and filled inside the
    jitted function, which returns a scalar (the "state" timed is that scalar), and the rows
    `"<name>, made inside[, vmapped], fill"` make and fill it alone, to be subtracted."""
    make, step = BUFFERS[name]()

    def run(state, items, key):
        def body(carry, x):
            buf, total = carry
            buf, value = step(buf, *x)
            return (buf, total + value), None

        return jax.lax.scan(body, state, (jax.random.split(key, items["done"].shape[0]), items))[0]

    def start(key):
        return make(key), jnp.zeros((), jnp.float32)

    pool = jax.jit(lambda k: _items(k, steps * ADD))(jax.random.key(1))
    pool = jax.tree.map(lambda x: x.reshape(steps, ADD, *x.shape[1:]), pool)
    lanes = jax.tree.map(lambda x: jnp.stack([x] * LANES), pool)
    keys = jax.random.split(jax.random.key(2), LANES)
    if inside:

        def train(items, key):
            buf, total = run(start(key), items, key)
            return total + jnp.sum(jax.tree.leaves(buf)[0].astype(jnp.float32))

        def fill(items, key):
            buf, total = start(key)
            return total + jnp.sum(jax.tree.leaves(buf)[0].astype(jnp.float32))

        calls = {}
        for suffix, f in (("", train), (", fill", fill)):
            one, batched = jax.jit(f), jax.jit(jax.vmap(f))
            calls[f"{name}, made inside{suffix}"] = (
                lambda s, k, one=one: one(pool, k),
                jnp.zeros(()),
            )
            calls[f"{name}, made inside, vmapped{suffix}"] = (
                lambda s, k, batched=batched: batched(lanes, jax.random.split(k, LANES)),
                jnp.zeros(LANES),
            )
        return calls
    one = jax.jit(run, donate_argnums=0)
    batched = jax.jit(jax.vmap(run), donate_argnums=0)
    state = jax.jit(start)(jax.random.key(2))
    states = jax.jit(jax.vmap(start))(keys)
    return {
        name: (lambda s, k: one(s, pool, k), state),
        f"{name}, vmapped": (lambda s, k: batched(s, lanes, jax.random.split(k, LANES)), states),
    }


def measure(names: list[str], steps: int, repeats: int, inside: bool = False) -> dict[str, float]:
    """Median microseconds per scan step of every row; the flat buffers' rows in one
    interleaved group, every other buffer's rows in a group of their own. With `inside`, the
    rows of `_runs(..., inside=True)`, each less its fill's median."""
    groups: list[list[str]] = []
    flat = [n for n in names if n.startswith("flat")]
    groups += [[n] for n in names if n not in flat]
    if flat:
        groups.append(flat)
    medians = {}
    for group in groups:
        runs: dict[str, tuple[Callable, Any]] = {}
        for name in group:
            runs |= _runs(name, steps, inside)
        seconds = h.time_interleaved(runs, repeats)
        for row, values in seconds.items():
            if row.endswith(", fill"):
                continue
            fill = statistics.median(seconds[f"{row}, fill"]) if inside else 0.0
            medians[row] = (statistics.median(values) - fill) / steps * 1e6
            print(f"  {row}: {medians[row]:.1f} µs/step", flush=True)
    return medians


def table(medians: dict[str, float], suffix: str = "") -> str:
    lines = [
        f"| buffer | one buffer µs/step | {LANES} vmapped µs/step | vmapped / one |"
        " vmapped / flashbax's vmapped |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in BUFFERS:
        if name + suffix not in medians:
            continue
        one, vm = medians[name + suffix], medians[f"{name}{suffix}, vmapped"]
        theirs = medians.get(f"flat (flashbax){suffix}, vmapped")
        versus = f"{vm / theirs:.2f}x" if name == "flat (drop-in)" and theirs else ""
        lines.append(f"| {name} | {one:.1f} | {vm:.1f} | {vm / one:.2f}x | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5 steps, 1 repeat")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", nargs="*", choices=list(BUFFERS))
    parser.add_argument(
        "--inside",
        action="store_true",
        help="the buffers made inside the jitted function, as PureJaxRL's (1,000 steps a call)",
    )
    args = parser.parse_args(argv)
    steps, repeats = (5, 1) if args.quick else (args.steps, args.repeats)
    if args.inside and not args.quick:
        steps = max(steps, 1000)  # the fill, subtracted, is then a small part of a call
    names = list(args.only or BUFFERS)
    if "flat (flashbax)" in names and importlib.util.find_spec("flashbax") is None:
        names.remove("flat (flashbax)")  # the drop-in runs alone
    machine = h.machine()
    print(
        f"{machine['cpu']}, {machine['cores_usable']} cores, jax {machine['jax']}, "
        f"flashbax {machine['flashbax']}, load {machine['load_before']}; {steps} steps a "
        f"call, {repeats} repeats",
        flush=True,
    )
    medians = measure(names, steps, repeats)
    if args.inside or args.quick:
        medians |= measure(names, steps, repeats, inside=True)
    print(f"load after: {h.load_average()}")
    print()
    print(table(medians))
    if args.inside or args.quick:
        print()
        print("Made inside the jitted function (each row less its fill):")
        print()
        print(table(medians, ", made inside"))


if __name__ == "__main__":
    main()
