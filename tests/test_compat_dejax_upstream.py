"""dejax 0.1.3's own test suite, unchanged, against `dejax_eqx.compat.dejax`.

The files in `tests/dejax_upstream/` are dejax's tests as upstream wrote them (see the README
there). Each of their test functions runs here as one test, with `dejax` bound to the
compatibility layer and chex's removed `assert_tree_all_close` bound to its successor, for
the duration of that test only.
"""

import ast
import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import chex
import dejax_eqx.compat.dejax as compat
import pytest

from .helpers import SLOW


UPSTREAM = Path(__file__).parent / "dejax_upstream"

# The files as upstream has them (SHA-256); the README there says where each comes from.
FILES = {
    "test_circular_buffer.py": "752c1291de8047f4bbb4b5d921357ef2c002d264a94bd7c1b67602ad238f6979",
    "test_clustered_replay.py": "82ae39152af643d73f6225ff6f1018ef0baca89563c89527e00f3f6ebe1ac240",
    "test_uniform_replay.py": "bbba78e74253959316a618c70ed9426f9a57e620feabbdc74ee508623eb387af",
    "test_utils.py": "23a5a96dec7c6126fdb8e1e2a3d4aeb57323d4c0104af68eb732c26d194ff61d",
}
HELPERS = "test_utils.py"  # imported by the others as `test_utils`; it holds no tests


def _test_names(filename: str) -> list[str]:
    tree = ast.parse((UPSTREAM / filename).read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
    ]


CASES = [(f, name) for f in FILES if f != HELPERS for name in _test_names(f)]


def _load(filename: str) -> ModuleType:
    # A fresh module object for every test, under a name of its own: nothing of one test's
    # import (or of dejax's module-level state) is shared with another's.
    name = f"dejax_upstream_{Path(filename).stem}"
    spec = importlib.util.spec_from_file_location(name, UPSTREAM / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def as_dejax(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import dejax` gives the compatibility layer, until the test ends."""
    monkeypatch.setitem(sys.modules, "dejax", compat)
    for sub in ["base", "circular_buffer", "clustered", "uniform", "utils"]:
        monkeypatch.setitem(sys.modules, f"dejax.{sub}", getattr(compat, sub))
    # chex removed `assert_tree_all_close` (deprecated for `assert_trees_all_close`).
    monkeypatch.setattr(chex, "assert_tree_all_close", chex.assert_trees_all_close, raising=False)
    monkeypatch.setitem(sys.modules, "test_utils", _load(HELPERS))


def test_the_upstream_files_are_unchanged_and_all_found():
    for filename, digest in FILES.items():
        assert hashlib.sha256((UPSTREAM / filename).read_bytes()).hexdigest() == digest, filename
    # 5 circular-buffer tests, 4 clustered, 4 uniform: none is skipped by the parametrisation.
    assert len(CASES) == 13 and len(set(CASES)) == 13
    assert sorted(p.name for p in UPSTREAM.glob("test_*.py")) == sorted(FILES)


# The first test of each upstream file in the default tier, every one in the slow tier.
@pytest.mark.parametrize(
    "filename, name",
    [
        case if i == 0 or case[0] != CASES[i - 1][0] else pytest.param(*case, marks=SLOW)
        for i, case in enumerate(CASES)
    ],
    ids=[f"{Path(f).stem}::{name}" for f, name in CASES],
)
def test_upstream(as_dejax: None, filename: str, name: str):
    getattr(_load(filename), name)()
