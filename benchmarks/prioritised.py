"""Prioritised replay: one training step = sample 256 items + set_priorities of those 256.

Run from the repository root with `python -m benchmarks.prioritised` (needs the `benchmarks`
extra: `pip install -e '.[benchmarks]'`). Each measurement runs in its own subprocess, so the
systems share no memory, compilation cache or thread pool.

`time_dejax_eqx`, `time_flashbax` and `time_floor` return steps per second and can be imported
by another harness; `main` prints a markdown table.

What is timed: `steps` training steps inside one jitted `lax.scan`, on a buffer filled with
`capacity` items `{"obs": f32[128], "action": i32[], "reward": f32[], "done": bool[]}`. Each
step samples a batch, computes new priorities from every field of the sampled items (so the
whole batch is read, as a learner would) and writes them back. The buffer is donated, so it is
updated in place. The "floor" row does the same with uniformly random indices and no priorities
at all: the cost of moving the batch, which no prioritised buffer can avoid.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


BATCH_SIZE = 256
OBS_DIM = 128
PRIORITY_EXPONENT = 0.6


def _items(capacity: int):
    """`capacity` items with random observations, as stacked arrays."""
    from .run import _items

    return _items(capacity)


def _new_priorities(items):
    """Stands in for |TD error|: reads every field of the sampled items."""
    import jax.numpy as jnp

    value = jnp.mean(items["obs"], axis=-1) + items["reward"] + items["action"].astype(jnp.float32)
    return jnp.abs(jnp.where(items["done"], 0.0, value)) + 1e-3


def _time(run, state, steps: int, repeats: int) -> dict[str, float]:
    """Steps per second of `run(state, key) -> state` (`steps` steps per call), after one call
    to compile and warm up: the best and the median over `repeats` timed calls, by wall clock,
    and the best by this process's CPU time (all threads), which a busy machine disturbs less.
    """
    import jax

    state = jax.block_until_ready(run(state, jax.random.key(1)))
    wall, cpu = [], []
    for r in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        state = jax.block_until_ready(run(state, jax.random.key(2 + r)))
        wall.append(steps / (time.perf_counter() - start))
        cpu.append(steps / (time.process_time() - start_cpu))
    return {"best": max(wall), "median": statistics.median(wall), "cpu": max(cpu), "all": wall}


def time_dejax_eqx(
    capacity: int, steps: int = 1000, repeats: int = 5, stratified: bool = False
) -> dict[str, float]:
    """`dx.PrioritisedReplay`, with i.i.d. (default) or stratified sampling."""
    import dejax_eqx as dx
    import equinox as eqx
    import jax

    items = _items(capacity)
    prototype = jax.tree.map(lambda x: x[0], items)
    buf = dx.PrioritisedReplay(prototype, capacity, PRIORITY_EXPONENT, stratified=stratified)
    buf = eqx.filter_jit(lambda b, x: b.add_batch(x), donate="all")(buf, items)
    del items

    @eqx.filter_jit(donate="all")
    def run(buf, key):
        def step(buf, key):
            s = buf.sample(key, BATCH_SIZE)
            return buf.set_priorities(s.indices, _new_priorities(s.items)), None

        return jax.lax.scan(step, buf, jax.random.split(key, steps))[0]

    return _time(run, buf, steps, repeats)


def time_flashbax(
    capacity: int, steps: int = 1000, repeats: int = 5, kind: str = "flat"
) -> dict[str, float]:
    """flashbax's prioritised buffer on CPU (`device="cpu"`; it always samples stratified).

    `kind="flat"`: `make_prioritised_flat_buffer`, which samples transition pairs (each draw
    reads an item and its successor). `kind="item"`: `make_prioritised_item_buffer`, which
    samples single items, like ours.
    """
    import flashbax as fbx
    import jax

    items = _items(capacity)
    prototype = jax.tree.map(lambda x: x[0], items)
    common = dict(
        max_length=capacity,
        min_length=BATCH_SIZE,
        sample_batch_size=BATCH_SIZE,
        add_sequences=True,
        priority_exponent=PRIORITY_EXPONENT,
        device="cpu",
    )
    if kind == "flat":
        buffer = fbx.make_prioritised_flat_buffer(add_batch_size=1, **common)

        def add(state, items):  # one row of `capacity` steps
            return buffer.add(state, jax.tree.map(lambda x: x[None], items))

        def sampled(sample):
            return sample.experience.first
    elif kind == "item":
        buffer = fbx.make_prioritised_item_buffer(**common)
        add = buffer.add

        def sampled(sample):
            return sample.experience
    else:
        raise ValueError(f"unknown flashbax kind {kind!r}")
    state = jax.jit(add, donate_argnums=0)(buffer.init(prototype), items)
    del items

    def run(state, key):
        def step(state, key):
            s = buffer.sample(state, key)
            return buffer.set_priorities(state, s.indices, _new_priorities(sampled(s))), None

        return jax.lax.scan(step, state, jax.random.split(key, steps))[0]

    return _time(jax.jit(run, donate_argnums=0), state, steps, repeats)


def time_floor(capacity: int, steps: int = 1000, repeats: int = 5) -> dict[str, float]:
    """The floor: gather a uniformly random batch and compute its priorities; no tree."""
    import jax
    import jax.numpy as jnp

    items = _items(capacity)

    def run(state, key):
        items, acc = state

        def step(acc, key):
            index = jax.random.randint(key, (BATCH_SIZE,), 0, capacity)
            batch = jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), items)
            return acc + jnp.sum(_new_priorities(batch)), None

        return items, jax.lax.scan(step, acc, jax.random.split(key, steps))[0]

    return _time(jax.jit(run, donate_argnums=0), (items, jnp.float32(0)), steps, repeats)


SYSTEMS = {
    "dejax_eqx": time_dejax_eqx,
    "dejax_eqx stratified": lambda capacity, steps: time_dejax_eqx(
        capacity, steps, stratified=True
    ),
    "flashbax flat": lambda capacity, steps: time_flashbax(capacity, steps, kind="flat"),
    "flashbax item": lambda capacity, steps: time_flashbax(capacity, steps, kind="item"),
    "floor (no priorities)": time_floor,
}


def measure(system: str, capacity: int, steps: int) -> dict[str, float]:
    """Run one measurement in a fresh Python process; steps per second, best and median."""
    command = [sys.executable, "-m", "benchmarks.prioritised", "--worker", system]
    out = subprocess.run(
        [*command, str(capacity), str(steps)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system} at capacity {capacity} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("SYSTEM", "CAPACITY", "STEPS"))
    parser.add_argument("--steps", type=int, default=1000, help="steps per timed scan")
    parser.add_argument("--quick", action="store_true", help="capacity 100k, 20 steps")
    args = parser.parse_args(argv)
    if args.worker:
        system, capacity, steps = args.worker
        print(json.dumps(SYSTEMS[system](int(capacity), int(steps))))
        return

    import jax

    big = 100_000 if args.quick else 1_000_000
    steps = 20 if args.quick else args.steps
    runs = [(name, big) for name in SYSTEMS]
    for small in (c for c in (10_000, 100_000) if c < big):
        runs += [("dejax_eqx", small), ("floor (no priorities)", small)]
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs; "
        f"batch {BATCH_SIZE}, {steps} steps per timed scan, 5 timed scans; "
        f"load average before: {_load()}\n"
    )
    results = {run: measure(*run, steps) for run in runs}
    base = results[("flashbax flat", big)]
    print(
        "| system | capacity | steps/s wall, best | wall, median | CPU time, best "
        "| vs flashbax flat (wall / CPU) | us/step above the floor (CPU) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (name, capacity), r in results.items():
        ratio = ""
        if capacity == big:
            ratio = f"{r['best'] / base['best']:.2f}x / {r['cpu'] / base['cpu']:.2f}x"
        floor = results[("floor (no priorities)", capacity)]["cpu"]
        above = f"{1e6 / r['cpu'] - 1e6 / floor:.0f}" if "floor" not in name else ""
        print(
            f"| {name} | {capacity:,} | {r['best']:,.0f} | {r['median']:,.0f} "
            f"| {r['cpu']:,.0f} | {ratio} | {above} |"
        )
    print(f"\nload average after: {_load()}")


if __name__ == "__main__":
    main()
