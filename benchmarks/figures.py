"""The figures that `README.md` and `docs/benchmarks.md` quote, computed from a results file.

    python -m benchmarks.figures                  # from benchmarks/results/results.json
    python -m benchmarks.figures DIR/results.json

prints the README's performance paragraph and the page's tables, to paste after a new run;
`tests/test_benchmark_figures.py` checks that both files state exactly these.

A ratio is the harness's (`_harness.ratio`: above 1, better than the reference, whatever the
unit), between medians of the same run, and it is cut, never rounded up: 1.247 is quoted as
1.24, 0.00118 as 0.0011 (below 0.1, two significant digits). Absolute values, quoted only as
context, are cut to three significant digits (millions as `M`).
"""

import json
import sys
import textwrap
from decimal import Decimal, ROUND_DOWN
from pathlib import Path

from . import _harness as h


RESULTS = h.ROOT / "benchmarks" / "results" / "results.json"


def load(path: Path = RESULTS) -> dict:
    """A results file: `{"machine": ..., "quick": ..., "results": [...]}`."""
    return json.loads(Path(path).read_text())


def cut(x: float) -> str:
    """`x` cut (not rounded) to two decimals, or to two significant digits below 0.1."""
    d = Decimal(repr(x))
    step = Decimal("0.01") if d >= Decimal("0.1") else Decimal(1).scaleb(d.adjusted() - 1)
    return str(d.quantize(step, rounding=ROUND_DOWN))


def value(x: float) -> str:
    """An absolute value cut to three significant digits: `20,931,662` -> `20.9M`,
    `16,405.3` -> `16,400`, `0.8301` -> `0.83`."""
    if x >= 1e6:
        return value(x / 1e6) + "M"
    d = Decimal(repr(x))
    kept = d.quantize(Decimal(1).scaleb(d.adjusted() - 2), rounding=ROUND_DOWN)
    return f"{kept:,.0f}" if kept >= 100 else f"{kept.normalize():f}"


def _row(data: dict, workload: str, system: str, size: int) -> dict:
    for r in data["results"]:
        if (r["workload"], r["system"], r["size"]) == (workload, system, size):
            if "error" in r:
                raise ValueError(f"{workload} {system} {size:,} did not run: {r['error']}")
            return r
    raise KeyError(f"no row {workload} {system!r} {size:,} in the results")


def ratio(data: dict, workload: str, system: str, size: int, reference: str) -> float:
    """`system`'s median against `reference`'s, both of `workload` at `size`."""
    return h.ratio(_row(data, workload, system, size), _row(data, workload, reference, size))


def _span(ratios: list[float]) -> str:
    low, high = cut(min(ratios)), cut(max(ratios))
    return low if low == high else f"{low}–{high}"


def readme_figures(data: dict) -> dict[str, str]:
    """Every figure of the README's performance paragraph, by name."""

    def r(workload, system, size, reference):
        return ratio(data, workload, system, size, reference)

    w1 = (100_000, 1_000_000)  # capacities
    w5 = (1024, 4096, 16384)  # steps per stream
    buffers = ("uniform", "prioritised", "trajectory", "prioritised trajectory")
    w12 = [f", {b}, EQX_ON_ERROR=nan" for b in buffers]
    machine = data["machine"]
    return {
        "cpu": f"{machine['cores_usable']}-core {machine['cpu']}",
        "load_before": machine["load_before"].split()[0],
        "load_after": machine["load_after"].split()[0],
        "add_raw": _span([r("W1", "dejax_eqx", n, "raw") for n in w1]),
        "add_flashbax": _span([r("W1", "dejax_eqx", n, "flashbax") for n in w1]),
        "sample_raw": cut(r("W2", "dejax_eqx", 100_000, "raw")),
        "sample_flashbax": cut(r("W2", "dejax_eqx", 100_000, "flashbax")),
        "windows_raw": _span([r("W5", "dejax_eqx", m, "raw") for m in w5]),
        "windows_flashbax": _span([r("W5", "dejax_eqx", m, "flashbax") for m in w5]),
        "prioritised_flashbax": cut(r("W6", "dejax_eqx", 1_000_000, "flashbax")),
        "stratified_flashbax": cut(r("W6", "dejax_eqx stratified", 1_000_000, "flashbax")),
        "learn_flashbax": cut(r("W8", "dejax_eqx, learn", 1_000_000, "flashbax, learn")),
        "adds_flashbax": _span(
            [r("W8", f"dejax_eqx, add {k}", 2_000_000, f"flashbax, add {k}") for k in (1, 2)]
        ),
        "step_raw": cut(r("W3", "dejax_eqx jax.jit", 100_000, "raw")),
        "step_flashbax": cut(r("W3", "dejax_eqx jax.jit", 100_000, "flashbax")),
        "step_nan_raw": cut(r("W3", "dejax_eqx jax.jit, EQX_ON_ERROR=nan", 100_000, "raw")),
        "step_nan_flashbax": cut(
            r("W3", "dejax_eqx jax.jit, EQX_ON_ERROR=nan", 100_000, "flashbax")
        ),
        "leaves_nan": _span([r("W12", "dejax_eqx" + b, 100_000, "raw" + b) for b in w12]),
    }


README = (
    "Performance, from one run of `python -m benchmarks` on a {cpu} CPU (load average "
    "{load_before} at the start, {load_after} at the end; [docs/benchmarks.md]"
    "(docs/benchmarks.md)), as ratios against a raw `jax.numpy` floor (plain arrays, no "
    "checks) and flashbax 0.1.3, above 1 meaning faster, cut to two decimals. Inside a jitted "
    "`lax.scan`: `add_batch` at {add_raw}× raw and {add_flashbax}× flashbax, `sample` at "
    "{sample_raw}× raw and {sample_flashbax}× flashbax; the `TrajectoryBuffer` sampler at "
    "{windows_raw}× raw and {windows_flashbax}× flashbax; prioritised sample and update at "
    "{prioritised_flashbax}× flashbax ({stratified_flashbax}× stratified, as flashbax "
    "samples); a prioritised sequence learner's step at {learn_flashbax}× flashbax, its adds "
    "at {adds_flashbax}×. A Python loop of add-and-sample steps under plain `jax.jit`: "
    "{step_raw}× raw and {step_flashbax}× flashbax with the default `EQX_ON_ERROR=raise`, "
    "whose host callback makes each call wait for its program, and {step_nan_raw}× and "
    "{step_nan_flashbax}× with `EQX_ON_ERROR=nan`, where each buffer's step runs at "
    "{leaves_nan}× the same step on a tuple of its leaves."
)


def readme_paragraph(data: dict) -> str:
    """The README's performance paragraph, unwrapped."""
    return README.format(**readme_figures(data))


def _partner(rows: list[dict], r: dict, ref: str) -> dict | None:
    """The row of `ref` that `r` is compared with: the harness's pairing, and for W11, whose
    systems end in the part they time (`"dejax_eqx write"`), the reference's same part."""
    if r["workload"] != "W11":  # the pairing of the harness's own tables
        return h.reference(rows, r, ref)
    name = f"{ref} {r['system'].rsplit(' ', 1)[1]}"
    return next((b for b in rows if b["system"] == name and b["size"] == r["size"]), None)


# The references of each workload's table: the raw floor and flashbax, but NumPy files for W11.
_REFERENCES = {"W11": ("numpy", "flashbax")}


def table(data: dict, workload: str, only: str = "", without: str = "") -> str:
    """The page's table of `workload`: one line per system other than the references (those
    whose name contains `only` and not `without`, where given), with its median, the
    references' medians and the ratios against them. A reference that no line has is left
    out."""
    refs = _REFERENCES.get(workload, ("raw", "flashbax"))
    rows = [r for r in data["results"] if r["workload"] == workload and "error" not in r]
    subjects = [
        r
        for r in rows
        if not r["system"].startswith(refs)
        and only in r["system"]
        and not (without and without in r["system"])
    ]
    partners = [[_partner(rows, r, ref) for ref in refs] for r in subjects]
    kept = [i for i in range(len(refs)) if any(p[i] for p in partners)]
    unit = subjects[0]["unit"].replace("us/", "µs/")
    header = ["system", "size", unit, *(refs[i] for i in kept), *(f"vs {refs[i]}" for i in kept)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for r, p in zip(subjects, partners):
        cells = [r["system"], f"{r['size']:,}", value(r["median"])]
        cells += [value(p[i]["median"]) if p[i] else "" for i in kept]
        cells += [f"{cut(h.ratio(r, p[i]))}x" if p[i] else "" for i in kept]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The page's tables, in its order: `(workload, only, without)` as `table` takes them.
PAGE_TABLES = (
    *((f"W{i}", "", "") for i in range(1, 12)),
    ("W12", "", "flatten"),
    ("W12", "flatten", ""),
)


def page_tables(data: dict) -> list[str]:
    """Every table of `docs/benchmarks.md`, in `PAGE_TABLES`' order."""
    return [table(data, *spec) for spec in PAGE_TABLES]


def main(argv: list[str]) -> None:
    data = load(Path(argv[0]) if argv else RESULTS)
    paragraph = readme_paragraph(data)
    print(textwrap.fill(paragraph, 100, break_on_hyphens=False, break_long_words=False))
    for (workload, only, _), text in zip(PAGE_TABLES, page_tables(data)):
        print(f"\n{workload} {only}\n\n{text}")


if __name__ == "__main__":
    main(sys.argv[1:])
