"""What `dx.GlobalReplay` costs over one plain replay, on 1, 2 and 4 processes.

Run from the repository root (not a workload of `python -m benchmarks`: each row is a set of
processes of one `jax.distributed` program, and it compares topologies, not systems):

    python -m benchmarks.multi_process             # the full run, a few minutes on 2 cores
    python -m benchmarks.multi_process --quick     # a smoke run: every path, tiny sizes (CI)
    python -m benchmarks.multi_process --out DIR   # results elsewhere than benchmarks/results/

Configurations, the same total data in each (item `{"obs": f32[128], "action": i32[]}`,
`CAPACITY` items in all, `ADD` rows added and `BATCH` rows sampled per step, all global):

- `raw`: one process, one device: a preallocated array, a ring index and `.at[].set` for adds,
    `randint` and a gather for samples (no checks, no priorities tree): the floor.
- `single`: one process, one device, one plain `UniformReplay`/`PrioritisedReplay`: the
    baseline every ratio is taken against.
- `global PxD`: a `GlobalReplay` of `P · D` shards, `P`
    processes of `D` CPU devices each (`1x1`: the wrapper alone, one shard; `1x4`, `2x2`,
    `4x1`: four shards), CPU collectives over gloo on 127.0.0.1. Each process adds the rows
    of its own shards (`rows`).

Steps, each `jax.jit(step, donate_argnums=1)` called from Python, `step(input, buffer) ->
(buffer, out)`: the buffer is donated (updated in place), the input (items or a key) is not.
`add`: `add_batch` of a pre-placed global array of `ADD` rows; `add from NumPy`: the same from
host arrays, placed by `rows` (`jax.device_put` without a mesh) in every call, as an actor has
them; `sample`: returns the batch (uniform); for a prioritised replay `add` and `sample+set`
(sample, priorities from every sampled field, `set_priorities` with the sample's generations);
`all-reduces alone` (global rows only): the least a sample's collectives cost, with no buffer:
an all-reduce of one number per shard (drawn from the key), then one of a batch of rows of the
item's bytes.
`jax.jit`, not `eqx.filter_jit`: the program timed is the one whose HLO is read (compiled once),
and equinox's per-call filtering (about 100 µs on this machine, W3) stays out of the ratios.
Each value is the median over `repeats` blocks of `steps` calls, per call; each process times
its own, and the tables give process 0's and the slowest process's. Every call waits for its
result (`jax.block_until_ready`), as a learner that reads its loss does: letting calls run ahead
deadlocked XLA's in-process CPU collectives where a process has more devices than cores (1x4 on
2 cores: "Expected 4 threads to join the rendezvous, but only 3 of them arrived", then XLA
aborts the process after 40 s), within a few calls of a step that begins with its all-reduce.

Bytes: every collective of each step's compiled program (`jax.jit(step).lower(...).compile()
.as_text()`), with its operand bytes per device, and whether it runs on every step or only
inside a conditional branch (an error path). A compile-only process with 8 CPU devices gives
how the bytes of a sample grow with the number of shards and the batch size.

Every configuration runs in fresh processes, on a free port, under a timeout; a configuration
that fails or hangs is killed and recorded with its error, and the others still run. Results
go to `--out`: `multi_process.json` and `multi_process.md`.
"""

import argparse
import concurrent.futures
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# Nothing of JAX is imported at module level: a worker sets the device count (`XLA_FLAGS`) and
# the collectives before JAX starts (the parent sets `XLA_FLAGS` in the worker's environment;
# the collectives are a config, set first thing in `_worker`).

_ROOT = Path(__file__).resolve().parent.parent
OBS_DIM = 128
FULL = {"capacity": 65_536, "add": 256, "batch": 256, "steps": 64, "repeats": 15}
QUICK = {"capacity": 1024, "add": 64, "batch": 64, "steps": 4, "repeats": 1}
# The compile-only growth of the bytes: shards x batch sizes.
GROWTH = {"devices": (1, 2, 4, 8), "batches": (64, 256, 1024)}
GROWTH_QUICK = {"devices": (1, 2), "batches": (16,)}
POOL = 4  # distinct add inputs, cycled

# name: (processes, devices per process); `raw` and `single` are not global.
CONFIGS = {
    "raw": (1, 1),
    "single": (1, 1),
    "global 1x1": (1, 1),
    "global 1x4": (1, 4),
    "global 2x2": (2, 2),
    "global 4x1": (4, 1),
}
OPS = ("uniform add", "uniform add from NumPy", "uniform sample", "prioritised add",
       "prioritised sample+set", "all-reduces alone")  # fmt: skip
# A configuration's processes start JAX, compile every step and time it: generous, but finite.
TIMEOUT_S = {False: 300, True: 120}

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "reduce-scatter",
)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Bytes from the compiled HLO


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (`f32[256,128]{1,0}`, or a tuple of them)."""
    return sum(
        _BYTES[dtype] * math.prod(int(d) for d in filter(None, dims.split(",")))
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape)
        if dtype in _BYTES
    )


def _split_instruction(line: str) -> tuple[str, str, str, str] | None:
    """`(name, shape, opcode, rest)` of an HLO instruction line, else None. A tuple shape has
    spaces, so the shape ends at its matching parenthesis."""
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
    if not m:
        return None
    name, rest = m.groups()
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                break
        shape, rest = rest[: i + 1], rest[i + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    return (name, shape, opcode, rest) if paren else None


def collectives(hlo: str) -> list[dict]:
    """Every collective of a compiled module's text: its opcode, operand shapes, operand bytes
    (per device), and `every_step`: False when it sits only in computations reached through a
    conditional's branches (an `eqx.error_if` raising, say), so it runs only when that branch
    is taken."""
    shapes: dict[str, str] = {}
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header[2]
            computations[current] = []
            entry = current if header[1] else entry
            continue
        parts = _split_instruction(line) if current else None
        if parts:
            shapes[parts[0]] = parts[1]
            computations[current].append(parts)  # type: ignore[index]
    # Computations run whenever their caller runs (fusions, reductions, loops), or only when a
    # conditional takes their branch.
    always: set[str] = set()
    stack = [entry] if entry else []
    while stack:
        name = stack.pop()
        if name in always or name not in computations:
            continue
        always.add(name)
        for *_, rest in computations[name]:
            stack += re.findall(r"\b(?:calls|to_apply|body|condition)=%([\w.\-]+)", rest)
    found = []
    for name, instructions in computations.items():
        for _, _, opcode, rest in instructions:
            base = opcode.removesuffix("-start")
            if base not in _COLLECTIVES:
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            operand_shapes = [shapes.get(o, "?") for o in operands]
            found.append(
                {
                    "op": base,
                    "operands": ", ".join(_plain(s) for s in operand_shapes),
                    "bytes": sum(shape_bytes(s) for s in operand_shapes),
                    "every_step": name in always,
                }
            )
    return found


def _plain(shape: str) -> str:
    """A shape without its layout: `f32[256,128]`."""
    return re.sub(r"\{[\d,]*\}", "", shape)


def step_bytes(found: list[dict]) -> int:
    """Operand bytes of the collectives that run on every step."""
    return sum(c["bytes"] for c in found if c["every_step"])


# ---------------------------------------------------------------------------------------------
# Worker: one process of a configuration


def _new_priorities(items):
    """Stands in for |TD error|: reads every field of the sampled items (as W6)."""
    import jax.numpy as jnp

    value = jnp.mean(items["obs"], axis=-1) + items["action"].astype(jnp.float32)
    return jnp.abs(value) + 1e-3


def _local_items(np, rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((rows, OBS_DIM), dtype=np.float32),
        "action": rng.integers(0, 7, rows, dtype=np.int32),
    }


def _raw_steps(jax, jnp, capacity: int, batch: int, prioritised: bool):
    """The floor: `(state, add, sample)`, each step `(input, state) -> (state, out)`."""

    def add(items, state):
        data, head, *priorities = state
        slots = (head + jnp.arange(len(items["action"]), dtype=jnp.int32)) % capacity
        data = jax.tree.map(lambda d, x: d.at[slots].set(x), data, items)
        priorities = [p.at[slots].set(1.0) for p in priorities]
        return (data, (head + len(slots)) % capacity, *priorities), None

    def sample(key, state):
        data, head, *priorities = state
        index = jax.random.randint(key, (batch,), 0, capacity)
        items = jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), data)
        if not prioritised:
            return state, items
        new = _new_priorities(items)
        return (data, head, priorities[0].at[index].set(new)), new

    data = {
        "obs": jnp.zeros((capacity, OBS_DIM), jnp.float32),
        "action": jnp.zeros(capacity, jnp.int32),
    }
    state = (data, jnp.asarray(0, jnp.int32), *([jnp.zeros(capacity)] if prioritised else []))
    return state, add, sample


def _cut(ratio: float) -> str:
    """A ratio to two decimals, cut (never rounded up), as the other benchmark pages give
    them."""
    return f"{math.floor(ratio * 100) / 100:.2f}x"


def global_replay(dx) -> type:
    """The global replay class of the `dejax_eqx` imported."""
    return dx.GlobalReplay


def _buffer_steps(batch: int, prioritised: bool):
    """`(add, sample)` of a buffer (plain or global), each `(input, buffer) -> (buffer, out)`."""

    def add(items, buf):
        return buf.add_batch(items), None

    def sample(key, buf):
        if not prioritised:
            return buf, buf.sample(key, batch)
        s = buf.sample(key, batch)
        new = _new_priorities(s.items)
        return buf.set_priorities(s.indices, new, generations=s.generations), new

    return add, sample


_STARTED = time.perf_counter()


def _phase(what: str) -> None:
    """A line in the worker's log: where a hung or failed configuration stopped, and when."""
    print(f"{time.perf_counter() - _STARTED:.2f} s: {what}", flush=True)


def _worker(args) -> None:
    _phase("started")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.id,
            initialization_timeout=60,
        )
    _phase("jax started")
    try:
        if args.worker == "growth":
            out = _growth(GROWTH_QUICK if args.quick else GROWTH, QUICK if args.quick else FULL)
        else:
            out = _measure(args.worker, QUICK if args.quick else FULL)
    finally:
        if args.processes > 1:
            jax.distributed.shutdown()
    args.result.write_text(json.dumps(out))


def _measure(config: str, sizes: dict) -> dict:
    import dejax_eqx as dx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    processes = jax.process_count()
    capacity, n_add, batch = sizes["capacity"], sizes["add"], sizes["batch"]
    steps, repeats = sizes["steps"], sizes["repeats"]
    local_rows = n_add // processes
    item = {"obs": jnp.zeros(OBS_DIM), "action": jnp.zeros((), jnp.int32)}
    mesh = jax.make_mesh((jax.device_count(),), ("replay",)) if "global" in config else None
    Global = global_replay(dx)

    def sync(tag: str) -> None:
        # Without it, a process that has finished timing adds (no collective) would start the
        # next step while another still times its adds, and the two would share the cores.
        if processes > 1:
            multihost_utils.sync_global_devices(tag)

    def placed(local, buffer):
        """This process's rows as the step's input: a global array split over the shards."""
        return buffer.rows(local) if isinstance(buffer, Global) else jax.device_put(local)

    def timed(op: str, step, inputs: list, state):
        """Per-call seconds of each block of `steps` calls; two untimed calls first (a step may
        change its state's types once, and compile again)."""
        for k in range(2):
            state = jax.block_until_ready(step(inputs[k % len(inputs)], state))[0]
        per_call = []
        for r in range(repeats):
            sync(f"{op} {r}")
            start = time.perf_counter()
            for i in range(steps):
                # Each call waits for its result: see the module docstring (a deadlock).
                state, out = jax.block_until_ready(step(inputs[i % len(inputs)], state))
            per_call.append((time.perf_counter() - start) / steps)
        _phase(f"{op}: timed")
        return state, per_call

    seconds: dict[str, list[float]] = {}
    found: dict[str, list[dict]] = {}
    pool = [_local_items(np, local_rows, 1000 * jax.process_index() + s) for s in range(POOL)]
    keys = [jax.random.key(i) for i in range(steps)]
    for prioritised in (False, True):
        family = "prioritised" if prioritised else "uniform"
        kind = dx.PrioritisedReplay if prioritised else dx.UniformReplay
        if config == "raw":
            buffer, add, sample = _raw_steps(jax, jnp, capacity, batch, prioritised)
        else:
            shards = 1 if mesh is None else mesh.shape["replay"]
            make = lambda: kind(item, capacity // shards)  # noqa: E731
            buffer = make() if mesh is None else Global(mesh, make)
            add, sample = _buffer_steps(batch, prioritised)
        _phase(f"{family}: buffer made")
        inputs = [placed(x, buffer) for x in pool]
        # Compiled ahead of time for the HLO; the calls below reuse this compilation.
        steps_of = {}
        for op, fn, first in (("add", add, inputs[0]), ("sample", sample, keys[0])):
            steps_of[op] = jax.jit(fn, donate_argnums=1)
            hlo = steps_of[op].lower(first, buffer).compile().as_text()
            if mesh is not None:
                name = (
                    f"{family} {op}" if op == "add" or not prioritised else f"{family} sample+set"
                )
                found[name] = collectives(hlo)
        add_jit, sample_jit = steps_of["add"], steps_of["sample"]
        _phase(f"{family}: compiled")
        # Full before any timing: the ring wraps on every add, and sampling reads it all.
        for i in range(capacity // n_add):
            buffer = add_jit(inputs[i % POOL], buffer)[0]
        _phase(f"{family}: full")
        buffer, seconds[f"{family} add"] = timed(f"{family} add", add_jit, inputs, buffer)
        if not prioritised:

            def from_numpy(local, buffer):
                return add_jit(placed(local, buffer), buffer)

            op = "uniform add from NumPy"
            buffer, seconds[op] = timed(op, from_numpy, pool, buffer)
            buffer, seconds["uniform sample"] = timed("uniform sample", sample_jit, keys, buffer)
        else:
            op = "prioritised sample+set"
            buffer, seconds[op] = timed(op, sample_jit, keys, buffer)
        del buffer
    if mesh is not None:
        step, rows = _all_reduces(jax, jnp, mesh, batch)
        op = "all-reduces alone"
        found[op] = collectives(step.lower(keys[0], rows).compile().as_text())
        _, seconds[op] = timed(op, step, keys, rows)
    return {"process": jax.process_index(), "seconds": seconds, "collectives": found}


def _all_reduces(jax, jnp, mesh, batch: int):
    """`(step, rows)`: a sample's collectives alone. Each shard holds `batch` rows of the
    item's bytes (as uint32 words); the step all-reduces one number per shard, then, depending
    on it (as a sample's batch depends on the shards' masses), the rows."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    words = OBS_DIM + 1  # f32[128] and an i32, as uint32 words

    def body(key, rows):
        # The key goes in as a sample's does (replicated), and the rows depend on it.
        me = jax.lax.axis_index("replay")
        mine = jax.random.bits(key, (), jnp.uint32)
        masses = jax.lax.psum(jnp.zeros(mesh.size, jnp.uint32).at[me].set(mine), "replay")
        return jax.lax.psum(jnp.where(jnp.sum(masses) > 0, rows[0], 0), "replay")

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("replay")), out_specs=P())
    sharding = NamedSharding(mesh, P("replay"))
    local = np.zeros((len(mesh.local_devices), batch, words), np.uint32)
    rows = jax.make_array_from_process_local_data(sharding, local)
    return jax.jit(lambda key, rows: (rows, mapped(key, rows)), donate_argnums=1), rows


def _growth(grid: dict, sizes: dict) -> dict:
    """Compile-only: the collectives of a sample (uniform) and of a sample+set (prioritised)
    over the first `d` of this process's devices, for each `d` and batch size; the buffers
    are abstract (`abstract`), so nothing is allocated."""
    import dejax_eqx as dx
    import jax
    import jax.numpy as jnp

    item = {"obs": jnp.zeros(OBS_DIM), "action": jnp.zeros((), jnp.int32)}
    rows = []
    for d in grid["devices"]:
        mesh = jax.make_mesh((d,), ("replay",), devices=jax.devices()[:d])
        for batch in grid["batches"]:
            for family, kind in (
                ("uniform", dx.UniformReplay),
                ("prioritised", dx.PrioritisedReplay),
            ):
                make = lambda: kind(item, sizes["capacity"] // d)  # noqa: E731
                buffer = global_replay(dx).abstract(mesh, make)
                _, sample = _buffer_steps(batch, family == "prioritised")
                lowered = jax.jit(sample, donate_argnums=1).lower(jax.random.key(0), buffer)
                found = collectives(lowered.compile().as_text())
                rows.append({"family": family, "shards": d, "batch": batch, "collectives": found})
    return {"growth": rows}


# ---------------------------------------------------------------------------------------------
# Parent: one set of processes per configuration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_line(text: str) -> str:
    """The exception line of a worker's log: the last that names an error, else the last of an
    abort, else the last line."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    fatal = [line for line in lines if re.match(r"^F\d{4} ", line)]  # XLA's (absl's) aborts
    return (named or fatal or lines or ["no output"])[-1]


def _wait(workers: list, timeout: float) -> str | None:
    """Wait for every worker: None if all exit cleanly, else the error (a failure, or the
    phase each process had reached when `timeout` seconds ran out)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _, _ in workers):
        if any(p.poll() not in (None, 0) for p, _, _ in workers):
            time.sleep(1)  # the others often fail too, one of them with the cause
            return _failure(workers)
        if time.monotonic() > deadline:
            where = "; ".join(
                f"process {i} after {_last_phase(log.read_text())!r}"
                for i, (_, _, log) in enumerate(workers)
            )
            return f"timed out after {timeout} s: {where}"
        time.sleep(0.1)
    return _failure(workers) if any(p.returncode for p, _, _ in workers) else None


def _failure(workers: list) -> str:
    """The error of a failed configuration: a Python exception if a process raised one, else the
    last line of the first process that failed."""
    failed = [(i, log.read_text()) for i, (p, _, log) in enumerate(workers) if p.poll()]
    named = [
        (i, text) for i, text in failed if re.search(r"^[\w.]+(Error|Exception)\b", text, re.M)
    ]
    i, text = (named or failed)[0]
    return f"process {i} (exit status {workers[i][0].returncode}): {_error_line(text)}"


def _last_phase(log: str) -> str:
    phases = [line for line in log.splitlines() if re.match(r"^\d+\.\d+ s: ", line)]
    return phases[-1] if phases else "nothing"


def run_config(name: str, processes: int, devices: int, quick: bool, scratch: Path) -> dict:
    """Run configuration `name` in `processes` fresh processes of `devices` CPU devices each;
    their results, or `{"error": ...}` if one failed or they ran past the timeout (then every
    process of the configuration is killed)."""
    port = _free_port()
    env = dict(os.environ)
    flags = [env.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
    if quick:
        # Compiling is most of a smoke run; LLVM's optimisations are a third of that. XLA's own
        # passes (which combine the collectives) still run, so the bytes are those of a full run.
        flags.append("--xla_backend_optimization_level=0")
    env["XLA_FLAGS"] = " ".join(filter(None, flags))
    workers = []
    for i in range(processes):
        result, log = scratch / f"{name} {i}.json", scratch / f"{name} {i}.log"
        command = [sys.executable, "-m", "benchmarks.multi_process", "--worker", name]
        command += ["--processes", str(processes), "--id", str(i), "--port", str(port)]
        command += ["--result", str(result), *(["--quick"] if quick else [])]
        with open(log, "w") as stream:
            process = subprocess.Popen(
                command, cwd=_ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT
            )
        workers.append((process, result, log))
    try:
        error = _wait(workers, TIMEOUT_S[quick])
    finally:
        # On an error, the others may wait forever in a collective for the one that failed;
        # on an interrupt, none should outlive this process.
        for p, _, _ in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
    if error is not None:
        return {"error": error}
    return {"workers": [json.loads(result.read_text()) for _, result, _ in workers]}


# ---------------------------------------------------------------------------------------------
# Report


def summarise(name: str, processes: int, devices: int, ran: dict) -> dict:
    row: dict = {"config": name, "processes": processes, "devices_per_process": devices}
    if "error" in ran:
        return row | {"error": ran["error"]}
    workers = sorted(ran["workers"], key=lambda w: w["process"])
    row["us_per_step"] = {}
    for op in (op for op in OPS if op in workers[0]["seconds"]):
        per_process = [[1e6 * s for s in w["seconds"][op]] for w in workers]
        medians = [statistics.median(v) for v in per_process]
        row["us_per_step"][op] = {
            "median": medians[0],
            "min": min(per_process[0]),
            "max": max(per_process[0]),
            "slowest_process_median": max(medians),
            "process_medians": medians,
        }
    row["collectives"] = workers[0]["collectives"]
    # Every process compiles the same SPMD program; differences would be a finding.
    row["same_program_in_every_process"] = all(
        w["collectives"] == workers[0]["collectives"] for w in workers
    )
    return row


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def report(machine: dict, sizes: dict, rows: list[dict], growth: dict) -> str:
    base = {r["config"]: r for r in rows if "error" not in r}
    lines = [
        f"# {machine['global_class']} across processes",
        "",
        f"dejax_eqx at {machine['git']}.",
        "",
        f"{machine['cpu']}, {machine['cores_usable']} usable cores; jax {machine['jax']}, "
        f"jaxlib {machine['jaxlib']}, equinox {machine['equinox']}; CPU devices, collectives "
        f"over gloo. Load average before {machine['load_before']}, after "
        f"{machine['load_after']}; {machine['seconds']} s in all.",
        "",
        f"Capacity {sizes['capacity']:,} items in all (`{{obs: f32[{OBS_DIM}], action: "
        f"i32[]}}`), add {sizes['add']} and sample {sizes['batch']} rows per step (global); "
        f"median of {sizes['repeats']} blocks of {sizes['steps']} donated `jax.jit` calls "
        "from Python, per call. Four devices in every `global` row but `1x1`; 2 cores "
        "run them all, so the rows with more devices than cores measure overhead and "
        "contention, not parallel speed.",
        "",
        "## Microseconds per step",
        "",
        "Process 0's median [min, max over its blocks]; with several processes, the slowest "
        "process's median after the `/`.",
        "",
        "| configuration | processes x devices | " + " | ".join(OPS) + " |",
        "|---|---|" + "---:|" * len(OPS),
    ]
    for r in rows:
        shape = f"{r['processes']}x{r['devices_per_process']}"
        if "error" in r:
            lines.append(f"| {r['config']} | {shape} | fails: {r['error']} |" + " |" * len(OPS))
            continue
        cells = []
        for op in OPS:
            if op not in r["us_per_step"]:
                cells.append("")
                continue
            t = r["us_per_step"][op]
            cell = f"{_fmt(t['median'])} [{_fmt(t['min'])}, {_fmt(t['max'])}]"
            if r["processes"] > 1:
                cell += f" / {_fmt(t['slowest_process_median'])}"
            cells.append(cell)
        lines.append(f"| {r['config']} | {shape} | " + " | ".join(cells) + " |")
    for ref, words in (
        ("single", "one plain buffer on one device (1.00x: the same cost; 2.00x: twice the time)"),
        ("raw", "the raw `jax.numpy` floor"),
    ):
        if ref not in base:
            continue
        ops = [op for op in OPS if op in base[ref]["us_per_step"]]
        lines += [
            "",
            f"## Time relative to `{ref}`: {words}",
            "",
            "Process 0's median over the reference's; the slowest process's after the `/`.",
            "",
            "| configuration | " + " | ".join(ops) + " |",
            "|---|" + "---:|" * len(ops),
        ]
        for r in rows:
            if "error" in r:
                continue
            cells = []
            for op in ops:
                t, b = r["us_per_step"][op], base[ref]["us_per_step"][op]["median"]
                cell = _cut(t["median"] / b)
                if r["processes"] > 1:
                    cell += f" / {_cut(t['slowest_process_median'] / b)}"
                cells.append(cell)
            lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Collectives per step (compiled HLO, operand bytes per device)",
        "",
        "Every collective of each step's compiled program. `every step`: outside any "
        "conditional; `branch`: only inside a conditional's branch (here the error path of "
        "`eqx.error_if`, which runs when a check fails). The `add` steps have none. "
        "`single` and `raw` have no mesh, so no collective.",
        "",
        "| configuration | step | collective | operands | bytes | runs |",
        "|---|---|---|---|---:|---|",
    ]
    for r in rows:
        if "error" in r or not r["collectives"]:
            continue
        for step, found in r["collectives"].items():
            if not found:
                lines.append(f"| {r['config']} | {step} | none | | 0 | |")
            for c in found:
                runs = "every step" if c["every_step"] else "branch"
                lines.append(
                    f"| {r['config']} | {step} | {c['op']} | {c['operands']} | {c['bytes']:,} "
                    f"| {runs} |"
                )
        if not r["same_program_in_every_process"]:
            lines.append(f"| {r['config']} | processes compiled different collectives! | | | | |")
    lines += [
        "",
        "The same program for 1x4, 2x2 and 4x1: the HLO depends on the number of shards, not on "
        "how the devices are split into processes; what changes is which hops of each "
        "all-reduce leave the process (gloo over TCP). A ring all-reduce of `S` bytes over `D` "
        "devices sends about `2 (D - 1) / D · S` per device.",
    ]
    if "error" in growth:
        lines += ["", f"Growth with shards and batch size: fails: {growth['error']}"]
    else:
        shards = sorted({g["shards"] for g in growth["growth"]})
        lines += [
            "",
            "## Growth: every-step collective bytes per device, by shards and batch size",
            "",
            f"Compile-only, one process with {max(shards)} CPU devices, a mesh over the first "
            f"`shards`; the last column: bytes per sampled row at {max(shards)} shards (an item "
            f"is {4 * OBS_DIM + 4} bytes).",
            "",
            "| step | batch | " + " | ".join(f"{d} shards" for d in shards) + " | per row |",
            "|---|---:|" + "---:|" * (len(shards) + 1),
        ]
        by = {(g["family"], g["batch"], g["shards"]): g["collectives"] for g in growth["growth"]}
        for family in ("uniform", "prioritised"):
            step = "uniform sample" if family == "uniform" else "prioritised sample+set"
            for batch in sorted({g["batch"] for g in growth["growth"]}):
                cells = [f"{step_bytes(by[family, batch, d]):,}" for d in shards]
                cells.append(f"{step_bytes(by[family, batch, max(shards)]) / batch:.1f}")
                lines.append(f"| {step} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _git() -> str:
    """The commit of the code measured, and the package's files that differ from it."""
    try:
        run = lambda *a: (
            subprocess.run(  # noqa: E731
                ["git", *a], cwd=_ROOT, capture_output=True, text=True, check=True
            ).stdout
        )
        # Each line `XY path`: the status column may be a space, so no strip before the path.
        changed = run("status", "--porcelain", "--", "dejax_eqx").splitlines()
        commit = run("rev-parse", "--short", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit (no git)"
    if not changed:
        return f"commit {commit}"
    return f"commit {commit} with changes: " + ", ".join(line[3:] for line in changed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes")
    parser.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    from . import _harness as h

    sizes = QUICK if args.quick else FULL
    machine = h.machine()
    machine["git"] = _git()
    machine["global_class"] = global_replay(h.dx).__name__
    print(f"{machine['cpu']}, {machine['cores_usable']} cores, jax {machine['jax']}, "
          f"load {machine['load_before']}; {sizes}", flush=True)  # fmt: skip
    start = time.perf_counter()
    grid = GROWTH_QUICK if args.quick else GROWTH
    runs = [*CONFIGS.items(), ("growth", (1, max(grid["devices"])))]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:

        def run(config):
            name, (processes, devices) = config
            began = time.perf_counter()
            ran = run_config(name, processes, devices, args.quick, Path(scratch))
            return ran, time.perf_counter() - began

        # The quick run is a smoke test whose timings mean nothing: its configurations run two
        # at a time (CI's two cores). A measurement always runs alone.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2 if args.quick else 1) as pool:
            for (name, (processes, devices)), (ran, seconds) in zip(runs, pool.map(run, runs)):
                if name == "growth":
                    growth = ran if "error" in ran else ran["workers"][0]
                    print(f"  growth: {growth.get('error', 'done')} ({seconds:.0f} s)")
                    continue
                rows.append(summarise(name, processes, devices, ran))
                shown = rows[-1].get("error") or ", ".join(
                    f"{op} {_fmt(t['median'])}" for op, t in rows[-1]["us_per_step"].items()
                )
                print(f"  {name}: {shown} µs ({seconds:.0f} s)", flush=True)
    machine["load_after"] = h.load_average()
    machine["seconds"] = round(time.perf_counter() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine, "quick": args.quick, "sizes": sizes, "configs": rows}
    (args.out / "multi_process.json").write_text(json.dumps(results | growth, indent=1))
    table = report(machine, sizes, rows, growth)
    (args.out / "multi_process.md").write_text(table)
    print()
    print(table)
    print(f"written to {args.out}/multi_process.{{json,md}} in {machine['seconds']} s")


if __name__ == "__main__":
    main()
