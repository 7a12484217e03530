"""The docs cannot drift from the code.

- Every ```python block in `docs/*.md`, `README.md` and the public docstrings (the `!!! Example`
  blocks) runs as written, on its own, in a fresh namespace. A block that imports flashbax is
  skipped where flashbax is not installed (it is in the `benchmarks` extra).
- Every public name has an entry in the API reference, and the errors page quotes every message
  the library raises.
"""

import ast
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import warnings

import dejax_eqx as dx
import jax
import pytest

from .helpers import python_blocks_with_lines


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _public_names() -> list[str]:
    """The names `dejax_eqx` exports: its own classes and functions (not modules, not dunders)."""
    return sorted(
        name
        for name, obj in vars(dx).items()
        if not name.startswith("_")
        and getattr(obj, "__module__", "").startswith("dejax_eqx")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
    )


def _public_docstrings() -> dict[str, str]:
    """Docstrings of the public names and of their public members, keyed by qualified name."""
    docs = {}
    for name in _public_names():
        obj = getattr(dx, name)
        docs[f"dejax_eqx.{name}"] = inspect.getdoc(obj) or ""
        if not inspect.isclass(obj):
            continue
        for klass in obj.__mro__:
            if not klass.__module__.startswith("dejax_eqx"):
                continue
            for attr, member in vars(klass).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                doc = getattr(member, "__doc__", None)
                if doc and (inspect.isfunction(member) or isinstance(member, property)):
                    docs[f"dejax_eqx.{klass.__name__}.{attr}"] = inspect.cleandoc(doc)
    return docs


def _snippets():
    params = []
    for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        for line, code in python_blocks_with_lines(path.read_text()):
            params.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}"))
    for qualname, doc in sorted(_public_docstrings().items()):
        for line, code in python_blocks_with_lines(doc):
            params.append(pytest.param(code, id=f"{qualname}:{line}"))
    return params


SNIPPETS = _snippets()


def test_snippets_were_found():
    # A broken fence pattern would otherwise pass by collecting nothing.
    ids = [p.id for p in SNIPPETS]
    assert any(i.startswith("README.md") for i in ids)
    assert any(i.startswith("docs/uniform.md") for i in ids)
    assert any(i.startswith("dejax_eqx.UniformReplay:") for i in ids)
    assert any(i.startswith("dejax_eqx.CircularBuffer:") for i in ids)


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code):
    if re.search(r"^\s*(import|from) flashbax\b", code, re.M):
        if importlib.util.find_spec("flashbax") is None:
            pytest.skip("needs flashbax (the benchmarks extra)")
        # flashbax and chex warn about deprecations of their own on recent JAX, and flashbax
        # relies on rank promotion, which conftest turns into an error for our code.
        with warnings.catch_warnings(), jax.numpy_rank_promotion("allow"):
            warnings.simplefilter("ignore", DeprecationWarning)
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
        return
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


def test_fence_pattern_finds_indented_blocks():
    text = "x\n\n    ```python\n    a = 1\n    ```\n\n```python\nb = 2\n```\n\n```bash\nno\n```\n"
    assert python_blocks_with_lines(text) == [(3, "a = 1\n"), (7, "b = 2\n")]


def test_api_reference_lists_every_public_name():
    api = (DOCS / "api.md").read_text()
    missing = [name for name in _public_names() if f"::: dejax_eqx.{name}\n" not in api]
    assert not missing, (
        "docs/api.md has no entry for "
        + ", ".join(missing)
        + ": add a line `::: dejax_eqx.NAME` for each."
    )


def _message_fragments() -> list[tuple[str, str]]:
    """Literal parts of every message raised in `dejax_eqx`: `(where, fragment)`.

    Taken from `raise SomeError("...")` / `raise SomeError(f"...")` and from the message argument
    of `eqx.error_if(x, pred, "...")`. The parts of an f-string between its fields are checked
    one by one; parts shorter than 10 characters say too little to look for.
    """
    fragments = []
    for path in sorted((ROOT / "dejax_eqx").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            message = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                message = node.exc.args[0]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "error_if":
                message = node.args[2] if len(node.args) > 2 else None
            if isinstance(message, ast.Constant) and isinstance(message.value, str):
                parts = [message.value]
            elif isinstance(message, ast.JoinedStr):
                parts = [
                    v.value
                    for v in message.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                ]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            fragments += [(where, p.strip()) for p in parts if len(p.strip()) >= 10]
    return fragments


def test_errors_page_quotes_every_message():
    fragments = _message_fragments()
    assert len(fragments) > 20  # the walk above found the messages
    page = (DOCS / "errors.md").read_text()
    missing = [f"{where}: {frag!r}" for where, frag in fragments if frag not in page]
    assert not missing, "docs/errors.md does not quote these messages:\n" + "\n".join(missing)


_NAN_SCRIPT = """
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, dejax_eqx as dx
item = {"obs": jnp.zeros(2), "action": jnp.asarray(0, jnp.int32)}
bufs = eqx.filter_vmap(lambda p: dx.UniformReplay(p, 4), in_axes=None, axis_size=2)(item)
one = {"obs": jnp.ones((1, 2)), "action": jnp.ones(1, jnp.int32)}
bufs = eqx.filter_vmap(lambda b, m: b.add_batch(one, mask=m))(bufs, jnp.array([[True], [False]]))
assert bufs.size.tolist() == [1, 0]
out = eqx.filter_vmap(lambda b, k: b.sample(k, 3))(bufs, jax.random.split(jax.random.key(0), 2))
assert np.isnan(np.asarray(out["obs"])).all(), out  # lane 0 is not empty, and is poisoned too
assert (np.asarray(out["action"]) == np.iinfo(np.int32).max).all(), out
print("ok")
"""


def test_eqx_on_error_nan_poisons_every_lane():
    # What docs/jit-patterns.md says about EQX_ON_ERROR=nan. Equinox reads the variable when it
    # is imported, hence a fresh interpreter.
    env = {**os.environ, "EQX_ON_ERROR": "nan"}
    result = subprocess.run(
        [sys.executable, "-c", _NAN_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
