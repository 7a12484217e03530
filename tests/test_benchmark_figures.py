"""The README and `docs/benchmarks.md` quote the committed results file, and nothing else.

Every figure is recomputed from `benchmarks/results/results.json` by `benchmarks.figures` (ratios
of medians, cut, never rounded up) and must appear in the text as it is computed. After a new
run, `python -m benchmarks.figures` prints the paragraph and the tables to paste. Nothing here
runs a benchmark.
"""

import pathlib

import pytest
from benchmarks import figures


ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = figures.load()


def _words(text: str) -> str:
    """`text` with every run of whitespace one space: the README wraps its paragraph."""
    return " ".join(text.split())


def test_results_are_a_full_run():
    assert not DATA["quick"], "benchmarks/results/ holds a --quick run: commit a full one"
    failed = {r["system"] for r in DATA["results"] if "error" in r}
    assert failed <= {"dejax"}, f"rows that did not run: {sorted(failed)}"


def test_readme_states_the_figures_of_the_results():
    paragraph = figures.readme_paragraph(DATA)
    readme = (ROOT / "README.md").read_text()
    assert _words(paragraph) in _words(readme), (
        "README.md's performance paragraph is not the one benchmarks/results/results.json "
        f"gives; `python -m benchmarks.figures` prints it:\n{paragraph}"
    )


@pytest.mark.parametrize("spec, table", list(zip(figures.PAGE_TABLES, figures.page_tables(DATA))))
def test_page_states_each_table_of_the_results(spec, table):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert table in page, f"docs/benchmarks.md lacks this table of {spec}:\n{table}"


def test_page_states_the_machine_of_the_results():
    page = _words((ROOT / "docs" / "benchmarks.md").read_text())
    machine = DATA["machine"]
    for fact in (
        f"`{machine['load_before']}`",
        f"`{machine['load_after']}`",
        f"took {machine['seconds']} s",
        f"jax and jaxlib {machine['jax']}",
        f"flashbax {machine['flashbax']}",
    ):
        assert fact in page, f"docs/benchmarks.md does not state {fact!r}"


@pytest.mark.parametrize(
    "x, quoted",
    [
        (1.247, "1.24"),
        (1.15, "1.15"),  # 1.15 * 100 is 114.99999999999999 in floats: no step through them
        (0.999, "0.99"),
        (2.0, "2.00"),
        (0.1, "0.10"),
        (0.0999, "0.099"),
        (0.00118, "0.0011"),
    ],
)
def test_ratios_are_cut_not_rounded(x, quoted):
    assert figures.cut(x) == quoted


@pytest.mark.parametrize(
    "x, quoted",
    [(20_931_662.4, "20.9M"), (16_405.3, "16,400"), (262.6, "262"), (95.0, "95"), (0.8301, "0.83")],
)
def test_values_are_cut_to_three_digits(x, quoted):
    assert figures.value(x) == quoted
