"""The benchmark harness: every workload, every system, ratios from one run.

Run from the repository root (needs the `benchmarks` extra: `pip install -e '.[benchmarks]'`):

    python -m benchmarks              # the full run, about 15 minutes on 2 CPU cores
    python -m benchmarks --quick      # a smoke run in well under 2 minutes (what CI runs)
    python -m benchmarks --only W3    # some workloads only

Each (workload, system) pair runs in a fresh Python process (`--worker`), so systems share no
compilation cache, allocator state or thread pool. Inside it: one call to compile and warm up,
then `repeats` timed calls; the table gives the median with the min and max. Results go to
`--out` (default `benchmarks/results/`): `results.json`, `results.md` and `results.png`.

Systems: `dejax_eqx`; `flashbax` (item buffers, prioritised flat buffer); `raw`, the floor: the
same work written directly in `jax.numpy` (preallocated arrays, a ring index, `.at[].set`
scatters and `jnp.take` gathers, no checks); `dejax` 0.1.3 where it is installed and runs on
this JAX (its failure is recorded otherwise). Item: `{"obs": f32[128], "action": i32[],
"reward": f32[], "done": bool[]}` unless a workload says otherwise.

| id | workload | unit |
|---|---|---|
| W1 | add_batch of 256 items per step, 2,000 steps in a jitted scan, capacity 100k, 1M | items/s |
| W2 | sample 256 per step from a full 100k buffer, 2,000 steps in a scan | items/s |
| W3 | Python loop of 2,000 donated jitted steps: add 64, sample 256; capacity 100k | µs/step |
| W4 | capacity 1M (~0.5 GB), 200 donated W3 steps | peak RSS growth / buffer bytes |
| W5 | TrajectoryBuffer.sample, 64 envs, T=32, B=64, max_length 1k/4k/16k | µs/sample |
| W6 | PrioritisedReplay 1M: sample 256 + set_priorities 256 per step, in a scan | steps/s |
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


OBS_DIM = 128
HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# Shared pieces (imported lazily: the parent process never starts JAX)


def _generate(key, n: int, obs_dim: int = OBS_DIM):
    """`n` random items, stacked (traceable)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    return {
        "obs": jax.random.normal(k1, (n, obs_dim), jnp.float32),
        "action": jnp.arange(n, dtype=jnp.int32) % 7,
        "reward": jax.random.uniform(k2, (n,), jnp.float32),
        "done": jnp.arange(n) % 100 == 0,
    }


def _items(n: int, seed: int = 0, obs_dim: int = OBS_DIM):
    import jax

    return jax.jit(_generate, static_argnums=(1, 2))(jax.random.key(seed), n, obs_dim)


def _prototype(obs_dim: int = OBS_DIM):
    import jax.numpy as jnp

    return {
        "obs": jnp.zeros(obs_dim, jnp.float32),
        "action": jnp.zeros((), jnp.int32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.bool_),
    }


def _consume(tree):
    """A scalar that depends on every sampled value, so no sample is optimised away."""
    import jax
    import jax.numpy as jnp

    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))


def _time_calls(call: Callable[[Any, Any], Any], state, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls `state = call(state, key)`, after a warm-up call."""
    import jax

    state = jax.block_until_ready(call(state, jax.random.key(1)))
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(call(state, jax.random.key(2 + r)))
        seconds.append(time.perf_counter() - start)
    return seconds


def _ring_slots(head, n: int, capacity: int):
    import jax.numpy as jnp

    return (head + jnp.arange(n, dtype=jnp.int32)) % capacity


# ---------------------------------------------------------------------------------------------
# W1: add_batch in a scan


def w1(system: str, capacity: int, steps: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    batch = 256
    items = _items(batch, seed=1)

    if system == "dejax_eqx":
        import dejax_eqx as dx

        state = dx.UniformReplay(_prototype(), capacity)

        def add(buf, items):
            return buf.add_batch(items)
    elif system == "raw":
        data = jax.tree.map(lambda x: jnp.zeros((capacity, *x.shape[1:]), x.dtype), items)
        state = (data, jnp.int32(0), jnp.int32(0))

        def add(state, items):
            data, head, count = state
            slots = _ring_slots(head, batch, capacity)
            data = jax.tree.map(
                lambda x, y: x.at[slots].set(y, unique_indices=True, mode="promise_in_bounds"),
                data,
                items,
            )
            return data, (head + batch) % capacity, jnp.minimum(count + batch, capacity)
    elif system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=256, add_batches=True
        )
        state = buffer.init(_prototype())
        add = buffer.add
    elif system == "dejax":
        import dejax

        buffer = dejax.uniform_replay(capacity)
        state = buffer.init_fn(_prototype())
        add = buffer.add_batch_fn
    else:
        raise ValueError(system)

    def run(state, key):
        del key
        return jax.lax.scan(lambda s, _: (add(s, items), None), state, None, length=steps)[0]

    run = jax.jit(run, donate_argnums=0)
    seconds = _time_calls(run, state, repeats)
    return {"values": [steps * batch / s for s in seconds], "unit": "items/s"}


# ---------------------------------------------------------------------------------------------
# W2: sample from a full buffer in a scan


def w2(system: str, capacity: int, steps: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    batch = 256
    items = _items(capacity)

    if system == "dejax_eqx":
        import dejax_eqx as dx

        state = dx.UniformReplay(_prototype(), capacity).add_batch(items)

        def sample(buf, key):
            return buf.sample(key, batch)
    elif system == "raw":
        state = items

        def sample(data, key):
            index = jax.random.randint(key, (batch,), 0, capacity)
            return jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), data)
    elif system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=batch, add_batches=True
        )
        state = jax.jit(buffer.add, donate_argnums=0)(buffer.init(_prototype()), items)

        def sample(state, key):
            return buffer.sample(state, key).experience
    elif system == "dejax":
        import dejax
        from jax.experimental import checkify

        buffer = dejax.uniform_replay(capacity)
        state = jax.jit(buffer.add_batch_fn)(buffer.init_fn(_prototype()), items)

        def sample(state, key):
            # dejax's sample holds a checkify check: it must run under `checkify`.
            err, out = checkify.checkify(buffer.sample_fn, errors=checkify.user_checks)(
                state, key, batch
            )
            return out
    else:
        raise ValueError(system)
    del items

    @jax.jit
    def run(carry, key):
        state, total = carry

        def body(total, key):
            return total + _consume(sample(state, key)), None

        return state, jax.lax.scan(body, total, jax.random.split(key, steps))[0]

    seconds = _time_calls(run, (state, jnp.zeros(())), repeats)
    return {"values": [steps * batch / s for s in seconds], "unit": "items/s"}


# ---------------------------------------------------------------------------------------------
# W3 / W4: a Python loop of donated steps (add 64, sample 256)


def _fill(add, state):
    """`state` filled to capacity by a donated loop of adds of 1,024 generated items: no array
    of all the items ever exists next to the buffer (W4 measures the memory)."""
    import jax

    capacity = max(x.shape[0] for x in jax.tree.leaves(state) if x.ndim)
    chunk = 1024

    def body(i, state):
        return add(state, _generate(jax.random.fold_in(jax.random.key(0), i), chunk))

    loops = -(-capacity // chunk)
    fill = jax.jit(lambda s: jax.lax.fori_loop(0, loops, body, s), donate_argnums=0)
    return fill(state)


def _w3_step(system: str, capacity: int):
    """`(state, step)`: a full buffer of `capacity` items and the jitted, donating step
    `step(key, state, items) -> (state, sample)`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    if system.startswith("dejax_eqx"):
        import dejax_eqx as dx

        state = _fill(lambda b, x: b.add_batch(x), dx.UniformReplay(_prototype(), capacity))

        def step(key, buf, items):
            buf = buf.add_batch(items)
            return buf, buf.sample(key, 256)

        if system == "dejax_eqx":  # the documented default: eqx.filter_jit
            return state, eqx.filter_jit(step, donate="all-except-first")
        if system == "dejax_eqx jax.jit":  # the fast path: buffers are pytrees of arrays
            return state, jax.jit(step, donate_argnums=1)
        raise ValueError(system)
    if system.startswith("raw"):
        state = (_items(capacity), jnp.int32(0))

        def step(key, state, items):
            data, head = state
            slots = _ring_slots(head, 64, capacity)
            data = jax.tree.map(
                lambda x, y: x.at[slots].set(y, unique_indices=True, mode="promise_in_bounds"),
                data,
                items,
            )
            index = jax.random.randint(key, (256,), 0, capacity)
            out = jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), data)
            return (data, (head + 64) % capacity), out

        if system == "raw":
            return state, jax.jit(step, donate_argnums=1)
        if system == "raw filter_jit":  # equinox's dispatch on a plain tuple of arrays
            return state, eqx.filter_jit(step, donate="all-except-first")
        raise ValueError(system)
    if system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=256, add_batches=True
        )
        state = _fill(buffer.add, buffer.init(_prototype()))

        def step(key, state, items):
            state = buffer.add(state, items)
            return state, buffer.sample(state, key).experience

        return state, jax.jit(step, donate_argnums=1)
    raise ValueError(system)


def w3(system: str, capacity: int, steps: int, repeats: int) -> dict:
    if system.endswith(", EQX_ON_ERROR=nan"):
        # Equinox reads the variable when it is imported: runtime checks without a host
        # callback (an error poisons the outputs instead of raising).
        os.environ["EQX_ON_ERROR"] = "nan"
        system = system.removesuffix(", EQX_ON_ERROR=nan")
    import jax

    state, step = _w3_step(system, capacity)
    items = _items(64, seed=2)
    keys = list(jax.random.split(jax.random.key(0), steps))

    def loop(state, key):
        del key
        for k in keys:
            state, out = step(k, state, items)
        return jax.block_until_ready((state, out))[0]

    seconds = _time_calls(loop, state, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/step"}


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: now; VmHWM: the peak since reset), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def w4(system: str, capacity: int, steps: int, repeats: int) -> dict:
    """Peak RSS growth over a baseline taken after JAX started and a small step ran.

    `values` holds the whole growth (the buffer, the compiled programs, the runtime's
    allocations) over the buffer's bytes; `in_steps` the growth of the peak during the steps
    after the first (compiled) one, which is where a second copy of the buffer would show.
    """
    import jax

    del repeats
    small, small_step = _w3_step(system, 1024)
    jax.block_until_ready(small_step(jax.random.key(0), small, _items(64)))
    del small
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    state, step = _w3_step(system, capacity)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    items = _items(64, seed=2)
    keys = jax.random.split(jax.random.key(0), steps)
    state, out = step(keys[0], state, items)
    jax.block_until_ready((state, out))
    total_before_steps = _status_bytes("VmHWM")
    _reset_peak()
    first = _status_bytes("VmRSS")
    for k in keys[1:]:
        state, out = step(k, state, items)
    jax.block_until_ready((state, out))
    peak = max(_status_bytes("VmHWM"), total_before_steps)
    return {
        "values": [(peak - baseline) / nbytes],
        "unit": "x buffer bytes",
        "buffer_bytes": nbytes,
        "in_steps_bytes": _status_bytes("VmHWM") - first,
    }


# ---------------------------------------------------------------------------------------------
# W5: TrajectoryBuffer sampling


def w5(system: str, max_length: int, steps: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from . import trajectory

    num_envs, seq, batch = 64, 32, 64
    obs_dim = OBS_DIM
    if system.endswith(", obs f32[16]"):  # a small item: the sampler's own cost shows
        obs_dim = 16
        system = system.removesuffix(", obs f32[16]")
    buf = trajectory.full_buffer(num_envs, max_length, obs_dim=obs_dim)
    if system == "dejax_eqx":

        def sample(buf, key):
            return buf.sample(key, batch, seq)
    elif system == "raw":

        def sample(buf, key):  # uniform (env, start) pairs, ring-wrapped windows, no mask
            k1, k2 = jax.random.split(key)
            env = jax.random.randint(k1, (batch,), 0, num_envs)
            start = jax.random.randint(k2, (batch,), 0, max_length)
            slots = (start[:, None] + jnp.arange(seq)[None, :]) % max_length
            return jax.tree.map(lambda x: x[env[:, None], slots], buf.data)
    elif system == "gist":

        def sample(buf, key):
            return trajectory.gist_sample(buf, key, batch, seq)
    else:
        raise ValueError(system)

    @jax.jit
    def run(carry, key):
        buf, total = carry

        def body(total, key):
            return total + _consume(sample(buf, key)), None

        return buf, jax.lax.scan(body, total, jax.random.split(key, steps))[0]

    seconds = _time_calls(run, (buf, jnp.zeros(())), repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/sample"}


# ---------------------------------------------------------------------------------------------
# W6: prioritised replay (the timed functions live in benchmarks/prioritised.py)


def w6(system: str, capacity: int, steps: int, repeats: int) -> dict:
    from . import prioritised

    if system == "dejax_eqx":
        r = prioritised.time_dejax_eqx(capacity, steps, repeats)
    elif system == "dejax_eqx stratified":
        r = prioritised.time_dejax_eqx(capacity, steps, repeats, stratified=True)
    elif system == "flashbax":
        r = prioritised.time_flashbax(capacity, steps, repeats, kind="flat")
    elif system == "raw":  # uniform indices, no tree: the cost of moving the batch
        r = prioritised.time_floor(capacity, steps, repeats)
    else:
        raise ValueError(system)
    return {"values": r["all"], "unit": "steps/s"}


WORKLOADS = {"W1": w1, "W2": w2, "W3": w3, "W4": w4, "W5": w5, "W6": w6}

# ---------------------------------------------------------------------------------------------
# The plan: (workload, system, size, steps, repeats)


def plan(quick: bool) -> list[tuple[str, str, int, int, int]]:
    if quick:  # every code path, tiny sizes, one timed repeat: a smoke test, not a measurement
        return [
            *[("W1", s, 10_000, 20, 1) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
            *[("W2", s, 10_000, 20, 1) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
            *[
                ("W3", s, 10_000, 20, 1)
                for s in ("dejax_eqx", "dejax_eqx jax.jit", "raw", "raw filter_jit", "flashbax")
            ],
            ("W4", "dejax_eqx", 10_000, 5, 1),
            *[("W5", s, 1024, 5, 1) for s in ("dejax_eqx", "raw", "gist")],
            *[("W6", s, 10_000, 20, 1) for s in ("dejax_eqx", "flashbax", "raw")],
        ]
    r = 5
    return [
        *[("W1", s, 100_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
        *[("W1", s, 1_000_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax")],
        *[("W2", s, 100_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
        *[
            ("W3", s, 100_000, 2000, r)
            for s in (
                "dejax_eqx",
                "dejax_eqx jax.jit",
                "dejax_eqx jax.jit, EQX_ON_ERROR=nan",
                "raw",
                "raw filter_jit",
                "flashbax",
            )
        ],
        *[("W4", s, 1_000_000, 200, 1) for s in ("dejax_eqx", "dejax_eqx jax.jit", "flashbax")],
        *[
            ("W5", s, m, 200, r)
            for m in (1024, 4096, 16384)
            for s in ("dejax_eqx", "raw", "dejax_eqx, obs f32[16]", "raw, obs f32[16]")
        ],
        ("W5", "gist", 1024, 3, 3),
        *[
            ("W6", s, c, 1000, r)
            for c in (1_000_000, 100_000, 10_000)
            for s in (
                "dejax_eqx",
                "raw",
                *(("dejax_eqx stratified", "flashbax") if c == 1_000_000 else ()),
            )
        ],
    ]


def run_one(workload: str, system: str, size: int, steps: int, repeats: int) -> dict:
    """One measurement in a fresh process; `{"error": ...}` if it fails (dejax on new JAX)."""
    command = [sys.executable, "-m", "benchmarks.run", "--worker"]
    command += [workload, system, str(size), str(steps), str(repeats)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if out.returncode != 0:
        # The exception line: the last one that names an error, else the last line.
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        return {"error": (named or lines or [f"exit status {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Reporting


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


# For each workload: which way is better, and what each row is compared with.
HIGHER_IS_BETTER = {"W1": True, "W2": True, "W3": False, "W4": False, "W5": False, "W6": True}


def _reference(rows: list[dict], r: dict, ref: str) -> dict | None:
    """The row of system `ref` at the size of `r`, in the same variant when there is one
    (`"dejax_eqx, obs f32[16]"` is compared with `"raw, obs f32[16]"`)."""
    variant = r["system"].partition(", ")[2]
    names = ([f"{ref}, {variant}"] if variant else []) + [ref]
    for name in names:
        for b in rows:
            if b["system"] == name and b["size"] == r["size"] and "error" not in b:
                return b
    return None


def report(results: list[dict]) -> str:
    """Markdown tables: median [min, max], and ratios against raw and flashbax of the same size
    (>1 means better than the reference, whatever the unit)."""
    lines = []
    for workload in WORKLOADS:
        rows = [r for r in results if r["workload"] == workload]
        if not rows:
            continue
        lines += [
            f"### {workload}",
            "",
            "| system | size | median | [min, max] | unit | vs raw | vs flashbax |",
            "|---|---:|---:|---:|---|---:|---:|",
        ]
        for r in rows:
            if "error" in r:
                lines.append(
                    f"| {r['system']} | {r['size']:,} | does not run: {r['error'][:120]} | | | | |"
                )
                continue
            ratios = []
            for ref in ("raw", "flashbax"):
                base = _reference(rows, r, ref)
                if base is None or base is r or r["system"].startswith(("raw", "flashbax")):
                    ratios.append("")
                    continue
                a, b = r["median"], base["median"]
                ratios.append(f"{a / b if HIGHER_IS_BETTER[workload] else b / a:.2f}x")
            lines.append(
                f"| {r['system']} | {r['size']:,} | {_fmt(r['median'])} "
                f"| [{_fmt(r['min'])}, {_fmt(r['max'])}] | {r['unit']} | {ratios[0]} "
                f"| {ratios[1]} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """One panel per workload: each system's median relative to raw (1 = the floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2))
    axes = [axes] if len(workloads) == 1 else list(axes)
    for ax, workload in zip(axes, workloads):
        rows = [r for r in results if r["workload"] == workload and "error" not in r]
        labels, values = [], []
        for r in rows:
            ref = _reference(rows, r, "raw")
            if workload == "W4":
                labels.append(r["system"])
                values.append(r["median"])
                continue
            if ref is None or r["system"].startswith("raw"):
                continue
            better = HIGHER_IS_BETTER[workload]
            labels.append(f"{r['system']}\n{r['size']:,}")
            values.append(r["median"] / ref["median"] if better else ref["median"] / r["median"])
        ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(workload)
        ax.set_xlabel("peak RSS growth / buffer bytes" if workload == "W4" else "speed vs raw")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def _machine() -> dict:
    import jax

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_before": load,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Replay-buffer benchmarks (see module doc).")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat")
    parser.add_argument("--only", nargs="*", help="workload ids to run, e.g. W1 W3")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workload, system, size, steps, repeats = args.worker
        out = WORKLOADS[workload](system, int(size), int(steps), int(repeats))
        print(json.dumps(out))
        return

    runs = [p for p in plan(args.quick) if not args.only or p[0] in args.only]
    machine = _machine()
    print(f"{len(runs)} measurements; {machine}", flush=True)
    results = []
    start = time.perf_counter()
    for workload, system, size, steps, repeats in runs:
        t = time.perf_counter()
        r = run_one(workload, system, size, steps, repeats)
        row = {"workload": workload, "system": system, "size": size, "steps": steps}
        row |= {"error": r["error"]} if "error" in r else {**_summary(r["values"]), **r}
        results.append(row)
        shown = row.get("error") or f"{_fmt(row['median'])} {row['unit']}"
        print(f"  {workload} {system} {size:,}: {shown} ({time.perf_counter() - t:.0f} s)")
    with open("/proc/loadavg") as f:
        machine["load_after"] = " ".join(f.read().split()[:3])
    machine["seconds"] = round(time.perf_counter() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    table = report(results)
    (args.out / "results.json").write_text(
        json.dumps({"machine": machine, "quick": args.quick, "results": results}, indent=1)
    )
    (args.out / "results.md").write_text(table)
    plot(results, args.out / "results.png")
    print()
    print(table)
    print(f"written to {args.out}/results.{{json,md,png}} in {machine['seconds']} s")


if __name__ == "__main__":
    main()
