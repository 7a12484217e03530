"""The harness that runs flashbax 0.1.3's own tests against `dejax_eqx.compat.flashbax`
(`tests/flashbax_upstream.py`): its pinned files and its selections. The `ci` selection itself
takes minutes, so `.ci/run` runs it as a step of its own (`python -m tests.flashbax_upstream`)."""

import ast
import importlib.util

import pytest

from . import flashbax_upstream as upstream


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashbax") is None,
    reason="needs flashbax 0.1.3's wheel, which ships its tests: pip install flashbax==0.1.3",
)

# 58 tests outside the two sweeps, and the sweeps' 240 + 480 cases.
IN_SCOPE = 58 + 240 + 480
CI = 58 + 2 * upstream.CI_CASES_PER_SWEEP


def _function(node: str) -> str:
    return node.split("[")[0]


def test_the_upstream_files_are_unchanged_and_the_selection_covers_them():
    upstream.check_files()
    root = upstream.site_packages()
    # Every test file of the wheel is either copied or out of scope as a whole.
    wheel = {p.relative_to(root).as_posix() for p in (root / "flashbax").rglob("*_test.py")}
    assert wheel == set(upstream.TEST_FILES) | {n for n in upstream.OUT_OF_SCOPE if "::" not in n}

    # Every test function of the copied files, read with `ast`, is selected in both modes,
    # unless it is out of scope by name.
    in_scope = set()
    for path in upstream.TEST_FILES:
        tree = ast.parse((root / path).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                in_scope.add(f"{path}::{node.name}")
    assert {n for n in upstream.OUT_OF_SCOPE if "::" in n} < in_scope
    in_scope -= set(upstream.OUT_OF_SCOPE)
    for mode in ["all", "ci"]:
        selected = upstream.select(mode)
        assert len(selected) == len(set(selected))
        assert {_function(node) for node in selected} == in_scope, mode
    assert upstream.count(upstream.select("all")) == IN_SCOPE
    assert upstream.count(upstream.select("ci")) == CI

    # The subset of each sweep is a subset of its cases, and has every value of every argument.
    for sweep in upstream.SWEEPS:
        cases = upstream.cases(sweep)
        subset = upstream.ci_subset(sweep)
        assert len(subset) == upstream.CI_CASES_PER_SWEEP and set(subset) <= set(cases)
        for name in cases[subset[0]]:
            assert {cases[case][name] for case in subset} == {a[name] for a in cases.values()}
