"""`python -m benchmarks`: every workload, every system, ratios from one run.

Run from the repository root (needs the `benchmarks` extra: `pip install -e '.[benchmarks]'`):

    python -m benchmarks              # the full run
    python -m benchmarks --quick      # a smoke run: every code path at tiny sizes (what CI runs)
    python -m benchmarks --only W5    # some workloads only
    python -m benchmarks --out DIR    # results elsewhere than benchmarks/results/

Each (workload, system, size) runs in a fresh Python process (`--worker`), so systems share no
compilation cache, allocator state or thread pool. Inside it: one call to compile and warm up,
then `repeats` timed calls; the table gives the median with the min and max. Results go to
`--out`: `results.json` (with the machine and its load average), `results.md`, `results.png`.

To measure another version of `dejax_eqx` with these benchmarks (a before/after), put its
checkout first on the path: `PYTHONPATH=/tmp/before python -m benchmarks --only W7 --out
/tmp/before-run`. The workloads call the trajectory family through `_harness` in either API
(0.1's sequence length and keywords, or 0.2's `dx.Window`/`dx.NStep`).

Systems: `dejax_eqx`; `flashbax` 0.1.3; `raw`, the floor: the same work written directly in
`jax.numpy` (preallocated arrays, a ring index, `.at[].set` scatters and gathers, no checks);
`dejax` 0.1.3 where it is installed (its failure is recorded otherwise). Item: `{"obs":
f32[128], "action": i32[], "reward": f32[], "done": bool[]}` unless a workload says otherwise.

| id | workload (module) | unit |
|---|---|---|
| W1 | add_batch 256 per step, 2,000 steps in a jitted scan; capacity 100k, 1M (uniform) | items/s |
| W2 | sample 256 per step from a full 100k buffer, 2,000 steps in a scan (uniform) | items/s |
| W3 | Python loop of 2,000 donated jitted steps: add 64, sample 256; 100k (uniform) | µs/step |
| W4 | capacity 1M (~0.5 GB), 200 donated W3 steps (uniform) | peak RSS / buffer bytes |
| W5 | sample 64 windows of 32 steps from 64 streams of 1k/4k/16k steps (trajectory) | µs/sample |
| W6 | PrioritisedReplay 1M: sample 256 + set_priorities 256 per step (prioritised) | steps/s |
| W7 | sample 64 windows of 125 steps per option, 16 streams of 1k/4k/16k (sequences) | µs/sample |
| W8 | 16 streams: add 1 or 2 steps, 2M; sample 64 x 80 + set priorities, 1M (sequences) | steps/s |
| W9 | a flashbax program, two imports: DQN (flat), R2D2 (prioritised) (flashbax_dropin) | steps/s |
| W10 | Python loop of 2,000 adds from NumPy: 8 of 16 envs, 64 of 64 (actor_add) | µs/add |
| W11 | 16 envs' steps to disk, 1,024 at a time, read back: Dataset, NumPy, Vault | MB/s |
| W12 | 2,000 donated jax.jit steps from Python, 4 buffers, module vs leaves (dispatch) | µs/step |
| W13 | Stoix-shaped learner steps from Python: item, rainbow, r2d2 (+ scanned epochs) | ms/step |
| W14 | a tiny jitted step with 0, 1, 16 checks; a heavy one's return (check_cost) | µs/call |
"""

import argparse
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path


# `PYTHONPATH=<another checkout> python -m benchmarks` measures that checkout's dejax_eqx (the
# "before" of a before/after; `results.json` records which `dejax_eqx` ran). `-m` puts the
# working directory, this repository with its own dejax_eqx, ahead of PYTHONPATH; it goes
# behind it here, before anything imports dejax_eqx. This package is already found, and its
# modules are found through its own path, not `sys.path`.
if os.environ.get("PYTHONPATH"):
    sys.path.append(sys.path.pop(0))

from . import (
    _harness as h,
    actor_add,
    check_cost,
    datasets,
    dispatch,
    flashbax_dropin,
    prioritised,
    prioritised_sequences,
    sequences,
    stoix_steps,
    trajectory,
    uniform,
)


WORKLOADS = {
    "W1": uniform.w1,
    "W2": uniform.w2,
    "W3": uniform.w3,
    "W4": uniform.w4,
    "W5": trajectory.w5,
    "W6": prioritised.w6,
    "W7": sequences.w7,
    "W8": prioritised_sequences.w8,
    "W9": flashbax_dropin.w9,
    "W10": actor_add.w10,
    "W11": datasets.w11,
    "W12": dispatch.w12,
    "W13": stoix_steps.w13,
    "W14": check_cost.w14,
}


# W3's systems, the same in the quick and the full plan: our step under `eqx.filter_jit`, under
# plain `jax.jit` (with and without the error callback), the raw floor both ways, flashbax.
_W3_SYSTEMS = (
    "dejax_eqx",
    "dejax_eqx jax.jit",
    "dejax_eqx jax.jit, EQX_ON_ERROR=nan",
    "dejax_eqx jax.jit, throw=False",
    "raw",
    "raw filter_jit",
    "flashbax",
)


# W7: `sample` with each of `sequences.OPTIONS` against one floor, then `sample_transitions`
# against its own. The options differ only in `sample`'s keyword arguments, so the quick plan
# keeps the one that uses most of them (each row is a process: several seconds even there).
_W7_SYSTEMS = (
    *(f"dejax_eqx {option}" for option in sequences.OPTIONS),
    "raw",
    "dejax_eqx, transitions n=5",
    "raw, transitions n=5",
)
_W7_QUICK = ("dejax_eqx R2D2 within", "raw", "dejax_eqx, transitions n=5", "raw, transitions n=5")


# W8: adds of 1 and of 2 steps per call (flashbax issue #62), then the learner's step. The quick
# plan keeps 2 steps per call (it runs the code of 1 as well) and the i.i.d. learner.
_W8_ADDS = tuple(f"{s}, add {k}" for k in (1, 2) for s in ("dejax_eqx", "flashbax", "raw"))
_W8_LEARN = tuple(f"{s}, learn" for s in ("dejax_eqx", "dejax_eqx stratified", "flashbax", "raw"))
_W8_QUICK = (
    *(f"{s}, add 2" for s in ("dejax_eqx", "flashbax", "raw")),
    *(f"{s}, learn" for s in ("dejax_eqx", "flashbax", "raw")),
)


# W9: the same flashbax program with `import flashbax` and with the drop-in, and the raw floor.
_W9_SYSTEMS = tuple(
    f"{s}, {part}"
    for part in ("dqn", "r2d2")
    for s in ("dejax_eqx.compat.flashbax", "flashbax", "raw")
)


# W10: the actor loop's add from Python, by dispatch path; flashbax adds every env at once, so it
# runs only where every env is added, and so does our add without `env_ids`; with 64 envs, also
# our add with the checks as NaNs.
_W10_SYSTEMS = (
    "dejax_eqx eqx.filter_jit",
    "dejax_eqx jax.jit",
    "dejax_eqx prioritised, jax.jit",
    "raw",
)
_W10_LOCK_STEP = (
    "dejax_eqx lock-step jax.jit",
    "dejax_eqx jax.jit, EQX_ON_ERROR=nan",
    "dejax_eqx jax.jit, throw=False",
    "flashbax",
)
_W10 = tuple(
    (s, n) for n in (16, 64) for s in (*_W10_SYSTEMS, *(_W10_LOCK_STEP if n == 64 else ()))
)


# W11: writes and reads of the same steps by each system.
_W11 = tuple(
    f"{s} {part}"
    for part in ("write", "read")
    for s in ("dejax_eqx", "dejax_eqx sync=False", "numpy", "flashbax")
)


# W12: each buffer's step on the module (each row also times the step on the module's leaves,
# `raw`, in the same process), with the error checks as host callbacks (the default) and as
# NaNs (no callback: JAX's C++ dispatch), then each state's flatten and unflatten in Python
# (flashbax's too).
_W12 = (
    *(f"dejax_eqx, {b}{e}" for e in ("", ", EQX_ON_ERROR=nan") for b in dispatch.BUFFERS),
    *(f"{s}, {b} flatten" for b in dispatch.BUFFERS for s in ("dejax_eqx", "raw", "flashbax")),
)


# W13: Stoix-shaped learner steps through flashbax's API, on flashbax and on the drop-in, with
# the error checks as host callbacks (the default) and as NaNs; the epochs unrolled, and in a
# `lax.scan` as Stoix runs them (" scanned").
_W13 = tuple(
    f"{s}, {part}{e}"
    for part in (*stoix_steps.PARTS, *(f"{p} scanned" for p in stoix_steps.PARTS))
    for s, e in (
        ("flashbax", ""),
        ("dejax_eqx.compat.flashbax", ""),
        ("dejax_eqx.compat.flashbax", ", EQX_ON_ERROR=nan"),
        ("dejax_eqx.compat.flashbax", ", throw=False"),
    )
)


# W14: the checks alone: a tiny step with k checks, and the return of a heavy step with k checks,
# with the checks as host callbacks and as NaNs.
_W14 = tuple(
    (f"checks{mode}{e}", k)
    for mode in ("", ", heavy")
    for e in ("", ", EQX_ON_ERROR=nan")
    for k in (0, 1, 16)
    if not (k == 0 and e)  # no check: nothing for EQX_ON_ERROR to change
)


def _quick_w13(system: str) -> bool:
    module, _, rest = system.partition(", ")
    if "scanned" in rest:  # one row for the scanned epochs: the most involved step
        return rest == "r2d2 scanned, throw=False"
    return rest.startswith("item") or (module != "flashbax" and "EQX_ON_ERROR" not in rest)


def plan(quick: bool) -> list[tuple[str, str, int, int, int]]:
    """`(workload, system, size, steps, repeats)` of every measurement, in table order."""
    if quick:  # every code path, tiny sizes, one timed repeat: a smoke test, not a measurement
        return [
            *[("W1", s, 10_000, 20, 1) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
            *[("W2", s, 10_000, 20, 1) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
            *[("W3", s, 10_000, 20, 1) for s in _W3_SYSTEMS],
            ("W4", "dejax_eqx", 10_000, 5, 1),
            *[
                ("W5", s, 1024, 5, 1)
                for s in (
                    "dejax_eqx",
                    "raw",
                    "flashbax",
                    "gist",
                    "dejax_eqx, obs f32[16]",
                    "raw, obs f32[16]",
                )
            ],
            *[
                ("W6", s, 10_000, 20, 1)
                for s in ("dejax_eqx", "dejax_eqx stratified", "flashbax", "raw")
            ],
            *[("W7", s, 256, 5, 1) for s in _W7_QUICK],
            *[("W8", s, 16 * 128, 5, 1) for s in _W8_QUICK],
            *[("W9", s, 16 * 40 * 4, 5, 1) for s in _W9_SYSTEMS],
            *[("W10", s, n, 20, 1) for s, n in _W10],
            *[("W11", s, 2048, 1, 1) for s in _W11],
            *[("W12", s, 10_000, 20, 1) for s in _W12],
            # W13 and W14: fewer rows (each row is a process that compiles), so that CI's smoke
            # run stays short: every part on the drop-in, flashbax and nan on the item step;
            # W14's checks with and without nan, light and heavy.
            *[("W13", s, 0, 5, 1) for s in _W13 if _quick_w13(s)],
            *[("W14", s, k, 20, 1) for s, k in _W14 if k == 16 or s == "checks"],
        ]
    r = 5
    return [
        *[("W1", s, 100_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
        *[("W1", s, 1_000_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax")],
        *[("W2", s, 100_000, 2000, r) for s in ("dejax_eqx", "raw", "flashbax", "dejax")],
        *[("W3", s, 100_000, 2000, r) for s in _W3_SYSTEMS],
        *[("W4", s, 1_000_000, 200, 1) for s in ("dejax_eqx", "dejax_eqx jax.jit", "flashbax")],
        *[
            ("W5", s, m, 200, r)
            for m in (1024, 4096, 16384)
            for s in (
                "dejax_eqx",
                "raw",
                "flashbax",
                "dejax_eqx, obs f32[16]",
                "raw, obs f32[16]",
                "flashbax, obs f32[16]",
            )
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
        *[("W7", s, m, 200, r) for m in (1024, 4096, 16384) for s in _W7_SYSTEMS],
        *[("W8", s, 2_000_000, 5000, r) for s in _W8_ADDS],
        *[("W8", s, 1_000_000, 1000, r) for s in _W8_LEARN],
        *[("W9", s, 102_400, 20_000 if "dqn" in s else 5_000, r) for s in _W9_SYSTEMS],
        *[("W10", s, n, 2000, r) for s, n in _W10],
        *[("W11", s, 16_384, 1, r) for s in _W11],
        *[("W12", s, 100_000, 2000, r) for s in _W12],
        *[("W13", s, 0, stoix_steps.STEPS, 7) for s in _W13],
        *[("W14", s, k, 2000 if "heavy" not in s else 1, r) for s, k in _W14],
    ]


def _record(
    results: list[dict], workload: str, system: str, size: int, steps: int, r: dict, seconds: float
) -> None:
    """Append the row(s) of one measurement to `results` and print them (it took `seconds`)."""
    also = r.pop("also", None)
    row = {"workload": workload, "system": system, "size": size, "steps": steps}
    row |= {"error": r["error"]} if "error" in r else {**h.summary(r["values"]), **r}
    results.append(row)
    shown = row.get("error") or f"{row['median']:.4g} {row['unit']}"
    print(f"  {workload} {system} {size:,}: {shown} ({seconds:.0f} s)", flush=True)
    if also:  # a second system timed in the same process
        other = {"workload": workload, "size": size, "steps": steps, **also}
        results.append(other | h.summary(also["values"]))
        shown = f"{results[-1]['median']:.4g} {also['unit']}"
        print(f"  {workload} {also['system']} {size:,}: {shown} (the same process)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Replay-buffer benchmarks (see module doc).")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat")
    parser.add_argument("--only", nargs="*", help="workload ids to run, e.g. W1 W3")
    parser.add_argument("--out", type=Path, default=h.ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workload, system, size, steps, repeats = args.worker
        run = WORKLOADS[workload]
        print(json.dumps(run(h.worker_system(system), int(size), int(steps), int(repeats))))
        return
    unknown = set(args.only or ()) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s) {sorted(unknown)}; choose from {list(WORKLOADS)}")

    runs = [p for p in plan(args.quick) if not args.only or p[0] in args.only]
    machine = h.machine()
    print(f"{len(runs)} measurements; {machine}", flush=True)
    results = []
    start = time.perf_counter()
    # The quick plan is a smoke test: its timings mean nothing, so its worker processes run
    # two at a time (CI's two cores), in order. A measurement always runs alone.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2 if args.quick else 1) as pool:
        ran = pool.map(lambda p: (p, time.perf_counter(), h.run_one(*p), time.perf_counter()), runs)
        for (workload, system, size, steps, _), began, r, ended in ran:
            _record(results, workload, system, size, steps, r, ended - began)
    machine["load_after"] = h.load_average()
    machine["seconds"] = round(time.perf_counter() - start)
    table = h.write_results(args.out, machine, args.quick, results)
    print()
    print(table)
    print(f"written to {args.out}/results.{{json,md,png}} in {machine['seconds']} s")


if __name__ == "__main__":
    main()
