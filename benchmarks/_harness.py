"""What every workload shares: items, timing, the per-measurement subprocess, machine info and
the written results. Workload modules import this module; nothing here imports them.

Timing comes in two shapes, and a workload must pick the one that matches what it times:

- `time_steps(step, state, repeats)`: `state = step(state, key)`, for work that changes the
  state (adds, priority updates). `step` must donate its state, or every call also copies it.
- `time_reads(read, state, repeats)`: `read(state, key)` on the same state every call, for work
  that only reads it (sampling). `sampling_scan` builds such a `read`: `steps` samples in one
  jitted `lax.scan`, returning one scalar. The state is an argument that is neither returned nor
  donated, so XLA reads it in place. Returning it instead (to thread it through `time_steps`)
  makes XLA copy every leaf into a fresh output buffer on each call, which is what inflated W5's
  floor with max_length before this module existed.

The trajectory family's windows and n-step transitions are described in the API of whichever
`dejax_eqx` is imported (`sample_windows`, `sample_transitions`,
`prioritised_trajectory_buffer`), so the same workloads measure the code before and after a
change of that API.
"""

import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dejax_eqx as dx
import jax
import jax.numpy as jnp


OBS_DIM = 128
ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# Items


def generate(key, n: int, obs_dim: int = OBS_DIM) -> dict[str, jax.Array]:
    """`n` random items `{"obs": f32[obs_dim], "action": i32[], "reward": f32[], "done":
    bool[]}`, stacked on a leading axis (traceable: fills generate their chunks in the loop)."""
    k1, k2 = jax.random.split(key)
    return {
        "obs": jax.random.normal(k1, (n, obs_dim), jnp.float32),
        "action": jnp.arange(n, dtype=jnp.int32) % 7,
        "reward": jax.random.uniform(k2, (n,), jnp.float32),
        "done": jnp.arange(n) % 100 == 0,
    }


def items(n: int, seed: int = 0, obs_dim: int = OBS_DIM) -> dict[str, jax.Array]:
    """`generate`, jitted, from a fixed seed."""
    return jax.jit(generate, static_argnums=(1, 2))(jax.random.key(seed), n, obs_dim)


def prototype(obs_dim: int = OBS_DIM) -> dict[str, jax.Array]:
    """One item of the shape `generate` makes."""
    return {
        "obs": jnp.zeros(obs_dim, jnp.float32),
        "action": jnp.zeros((), jnp.int32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.bool_),
    }


def consume(tree) -> jax.Array:
    """A scalar that depends on every sampled value, so no sample is optimised away."""
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))


def ring_slots(head, n: int, capacity: int) -> jax.Array:
    """The `n` slots a ring of `capacity` writes next from `head` (the raw floor's adds)."""
    return (head + jnp.arange(n, dtype=jnp.int32)) % capacity


# ---------------------------------------------------------------------------------------------
# The trajectory family's calls, in the API of the imported dejax_eqx
#
# dejax_eqx 0.2 describes a window by a `dx.Window` and an n-step transition by a `dx.NStep`;
# 0.1 took a sequence length and keywords, which 0.2 still takes with a DeprecationWarning.
# The workloads make these calls here only, so that the one harness runs clean on 0.2 and
# still measures 0.1 for a before/after (`PYTHONPATH=<a checkout of 0.1> python -m
# benchmarks ...`: the workers import that `dejax_eqx`).

WINDOW_API = hasattr(dx, "Window")  # 0.2 and later


def sample_windows(buf, key, batch_size: int, sequence_length: int, **options):
    """`buf.sample` of `batch_size` windows with a learning part of `sequence_length` steps;
    `options` are the window's (`burn_in`, `bootstrap`, `period`, `strict`, `episode_ends`,
    `done`)."""
    if WINDOW_API:
        return buf.sample(key, batch_size, dx.Window(sequence_length, **options))
    return buf.sample(key, batch_size, sequence_length, **options)


# 0.2 and later: an `NStep` is what `sample` draws (`sample_transitions` is deprecated).
NSTEP_SAMPLE = hasattr(dx.TrajectoryBuffer, "law")


def sample_transitions(buf, key, batch_size: int, n: int, *, discount: float, **leaves):
    """`batch_size` `n`-step transitions of `buf`; `leaves` names the `reward`, `terminated`
    and (optionally) `truncated` leaves."""
    if NSTEP_SAMPLE:
        return buf.sample(key, batch_size, dx.NStep(n, **leaves), discount=discount)
    if WINDOW_API:
        return buf.sample_transitions(key, batch_size, dx.NStep(n, **leaves), discount=discount)
    return buf.sample_transitions(key, batch_size, n, discount=discount, **leaves)


def prioritised_trajectory_buffer(
    prototype,
    num_envs: int,
    max_length: int,
    sequence_length: int,
    *,
    burn_in: int = 0,
    bootstrap: int = 0,
    period: int = 1,
    **kwargs,
) -> dx.PrioritisedTrajectoryBuffer:
    """A `dx.PrioritisedTrajectoryBuffer` of whole windows of `burn_in + sequence_length +
    bootstrap` steps at starts every `period`; `kwargs` are its other arguments
    (`priority_exponent`, `stratified`)."""
    window = {"burn_in": burn_in, "bootstrap": bootstrap, "period": period}
    if WINDOW_API:
        window = dx.Window(sequence_length, **window, strict=True)
        return dx.PrioritisedTrajectoryBuffer(prototype, num_envs, max_length, window, **kwargs)
    return dx.PrioritisedTrajectoryBuffer(
        prototype, num_envs, max_length, sequence_length, **window, **kwargs
    )


# ---------------------------------------------------------------------------------------------
# Timing


def time_steps(step: Callable[[Any, Any], Any], state, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls `state = step(state, key)`, after one call to compile
    and warm up. `step` should donate `state` (see the module docstring)."""
    # Two warm-up calls: a step may return a state whose types differ from the one it was
    # given (flashbax's prioritised state holds a weakly typed scalar that its first step
    # makes strong), and the second call then compiles again.
    for k in (0, 1):
        state = jax.block_until_ready(step(state, jax.random.key(k)))
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state, jax.random.key(2 + r)))
        seconds.append(time.perf_counter() - start)
    return seconds


def time_interleaved(
    runs: dict[str, tuple[Callable[[Any, Any], Any], Any]], repeats: int
) -> dict[str, list[float]]:
    """`time_steps` of each `name: (step, state)` of `runs` in one process, their repeats
    interleaved (a, b, b, a, a, b, ...: each goes first as often): for systems whose
    difference is smaller than the spread between processes (on the 2-core machine, one
    process ran W12's prioritised trajectory step in 354 µs, another in 792 µs), compared by
    the ratio of their repeats."""
    states = {name: state for name, (_, state) in runs.items()}
    for k in (0, 1):  # as `time_steps`: a step may change its state's types once
        for name, (step, _) in runs.items():
            states[name] = jax.block_until_ready(step(states[name], jax.random.key(k)))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            step = runs[name][0]
            start = time.perf_counter()
            states[name] = jax.block_until_ready(step(states[name], jax.random.key(2 + r)))
            seconds[name].append(time.perf_counter() - start)
    return seconds


def flatten_times(tree, repeats: int, number: int | None = None) -> dict[str, list[float]]:
    """Microseconds per `jax.tree.flatten(tree)` and per `jax.tree.unflatten` of its leaves,
    one value per repeat of `number` calls each (`timeit`; `None`: as many calls as fill
    0.2 s, `timeit.Timer.autorange`): `{"flatten": [...], "unflatten": [...]}`. Python-level
    pytree costs, which every jitted call pays for its arguments and its outputs."""
    leaves, treedef = jax.tree.flatten(tree)
    times = {}
    for name, call in [
        ("flatten", lambda: jax.tree.flatten(tree)),
        ("unflatten", lambda: jax.tree.unflatten(treedef, leaves)),
    ]:
        timer = timeit.Timer(call)
        calls = timer.autorange()[0] if number is None else number
        times[name] = [1e6 * t / calls for t in timer.repeat(repeats, calls)]
    return times


def time_reads(read: Callable[[Any, Any], Any], state, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls `read(state, key)` on the same `state`, after one call
    to compile and warm up."""
    jax.block_until_ready(read(state, jax.random.key(1)))
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(read(state, jax.random.key(2 + r)))
        seconds.append(time.perf_counter() - start)
    return seconds


def sampling_scan(sample: Callable[[Any, Any], Any], steps: int) -> Callable[[Any, Any], Any]:
    """`read(state, key) -> f32[]`: `steps` calls `sample(state, key_i)` in one jitted scan,
    every sampled leaf summed into the result. Time it with `time_reads`."""

    @jax.jit
    def read(state, key):
        def body(total, key):
            return total + consume(sample(state, key)), None

        return jax.lax.scan(body, jnp.zeros(()), jax.random.split(key, steps))[0]

    return read


# ---------------------------------------------------------------------------------------------
def results_mode(system: str) -> tuple[str, bool]:
    """`system` without a trailing `, throw=False`, and whether it had one: the buffer is then
    built with `throw=False` (its faults kept as results, nothing raised)."""
    suffix = ", throw=False"
    if system.endswith(suffix):
        return system[: -len(suffix)], True
    return system, False


# One measurement per process


_SETTING = r"[A-Z][A-Z0-9_]*=\S+"  # an environment variable in a system's name


def run_one(workload: str, system: str, size: int, steps: int, repeats: int) -> dict:
    """Run `python -m benchmarks --worker ...` in a fresh process and return what the workload
    returned, or `{"error": ...}` if it failed (dejax on a new JAX). A workload that times a
    second system in the same process (W12, with `time_interleaved`) returns its row under
    `"also"`: `{"system": ..., "values": ..., "unit": ...}`.

    A trailing `, NAME=value` in `system` (`"dejax_eqx jax.jit, EQX_ON_ERROR=nan"`) is set in
    the worker's environment, since libraries read such variables when they are imported.
    """
    env = dict(os.environ)
    setting = re.search(rf", ({_SETTING})$", system)
    if setting:
        name, value = setting[1].split("=", 1)
        env[name] = value
    command = [sys.executable, "-m", "benchmarks", "--worker"]
    command += [workload, system, str(size), str(steps), str(repeats)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        # The exception line: the last one that names an error, else the last line.
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        return {"error": (named or lines or [f"exit status {out.returncode}"])[-1]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if setting and "also" in result:  # it ran under the same setting
        result["also"]["system"] += f", {setting[1]}"
    return result


def worker_system(system: str) -> str:
    """`system` without the environment setting that `run_one` applied."""
    return re.sub(rf", {_SETTING}$", "", system)


# ---------------------------------------------------------------------------------------------
# Machine


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict:
    """What the numbers depend on, and how busy the machine was when the run started."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{p: _version(p) for p in ("jax", "jaxlib", "equinox", "flashbax", "dejax_eqx", "dejax")},
        # The installed version's number is reported above even when PYTHONPATH puts another
        # checkout first (a before/after run); this says which code ran.
        "dejax_eqx_file": dx.__file__,
        "load_before": load_average(),
    }


# ---------------------------------------------------------------------------------------------
# Results


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def higher_is_better(unit: str) -> bool:
    """Rates (`items/s`, `steps/s`) are better high; times and memory are better low."""
    return unit.endswith("/s")


def _fmt(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def reference(rows: list[dict], r: dict, ref: str) -> dict | None:
    """The row of system `ref` at the size of `r`, in the same variant: a variant of the
    workload (`"dejax_eqx, obs f32[16]"`) is compared with the reference's same variant only
    (`"raw, obs f32[16]"`), one of the environment (`"..., EQX_ON_ERROR=nan"`) with the plain
    reference."""
    variant = r["system"].partition(", ")[2]
    if not variant:
        names = [ref]
    elif re.fullmatch(_SETTING, variant):
        names = [f"{ref}, {variant}", ref]
    else:
        names = [f"{ref}, {variant}"]
    for name in names:
        for b in rows:
            if b["system"] == name and b["size"] == r["size"] and "error" not in b:
                return b
    return None


def ratio(r: dict, base: dict) -> float:
    """How much better `r` is than `base` (above 1: better), whatever the unit."""
    a, b = r["median"], base["median"]
    return a / b if higher_is_better(r["unit"]) else b / a


def _workloads(results: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in results))


def report(results: list[dict]) -> str:
    """Markdown tables: median [min, max], and ratios against raw and flashbax of the same size
    (above 1 means better than the reference, whatever the unit)."""
    lines = []
    for workload in _workloads(results):
        rows = [r for r in results if r["workload"] == workload]
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
                base = reference(rows, r, ref)
                if base is None or base is r or r["system"].startswith(("raw", "flashbax")):
                    ratios.append("")
                else:
                    ratios.append(f"{ratio(r, base):.2f}x")
            lines.append(
                f"| {r['system']} | {r['size']:,} | {_fmt(r['median'])} "
                f"| [{_fmt(r['min'])}, {_fmt(r['max'])}] | {r['unit']} | {ratios[0]} "
                f"| {ratios[1]} |"
            )
        lines.append("")
        lines += _scaling(rows)
    return "\n".join(lines)


def _scaling(rows: list[dict]) -> list[str]:
    """A table of how each system's cost grows with the size, for the systems measured at more
    than one size: the time per unit at each size over the time at its smallest size (so 1.00x
    is flat, whatever the unit). Nothing for a workload measured at one size."""
    ok = [r for r in rows if "error" not in r]
    by_system: dict[str, dict[int, dict]] = {}
    for r in ok:
        by_system.setdefault(r["system"], {})[r["size"]] = r
    by_system = {name: sizes for name, sizes in by_system.items() if len(sizes) > 1}
    if not by_system:
        return []
    columns = sorted({size for sizes in by_system.values() for size in sizes})[1:]
    lines = [
        "Cost at each size relative to the system's smallest size (1.00x: flat):",
        "",
        "| system | smallest | " + " | ".join(f"{c:,}" for c in columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for name, sizes in by_system.items():
        smallest = min(sizes)
        cells = [
            f"{ratio(sizes[smallest], sizes[c]):.2f}x" if c in sizes and c != smallest else ""
            for c in columns
        ]
        lines.append(f"| {name} | {smallest:,} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def plot(results: list[dict], path: Path) -> None:
    """One panel per workload: each system's median relative to raw (1 = the floor); W4, which
    has no raw row, shows peak memory over buffer bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = _workloads(results)
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.2))
    axes = [axes] if len(workloads) == 1 else list(axes)
    for ax, workload in zip(axes, workloads):
        rows = [r for r in results if r["workload"] == workload and "error" not in r]
        labels, values = [], []
        has_raw = any(r["system"].startswith("raw") for r in rows)
        for r in rows:
            if not has_raw:
                labels.append(r["system"])
                values.append(r["median"])
                continue
            ref = reference(rows, r, "raw")
            if ref is None or r["system"].startswith("raw"):
                continue
            labels.append(f"{r['system']}\n{r['size']:,}")
            values.append(ratio(r, ref))
        ax.barh(range(len(values)), values, color="tab:blue")
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(workload)
        ax.set_xlabel(rows[0]["unit"] if rows and not has_raw else "speed vs raw")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def write_results(out: Path, machine: dict, quick: bool, results: list[dict]) -> str:
    """`results.json`, `results.md` and `results.png` in `out`; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    table = report(results)
    (out / "results.json").write_text(
        json.dumps({"machine": machine, "quick": quick, "results": results}, indent=1)
    )
    (out / "results.md").write_text(table)
    plot(results, out / "results.png")
    return table
