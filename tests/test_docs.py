"""The docs cannot drift from the code.

- Every ```python block in `docs/*.md`, `README.md` and the public docstrings (the `!!! Example`
  blocks) runs as written, on its own, in a fresh namespace. A block that imports flashbax is
  skipped where flashbax is not installed (it is in the `benchmarks` extra).
- Every public name has an entry in the API reference.
- The errors page and the code quote each other: the page quotes every message the library
  raises or reports at run time (through `check_faults`), and every message the page quotes is
  one the code prints.
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
import dejax_eqx.compat.flashbax as fbx
import equinox as eqx
import jax
import jax.numpy as jnp
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


# ---------------------------------------------------------------------------------------------
# The errors page and the code quote each other, in both directions.
#
# A message *template* is what the code can print: a tuple of literal parts and `_ANY` where
# the text is decided at run time (an f-string field that cannot be resolved statically).
# Messages come from two places:
#
# - `raise SomeError(message)`: its message argument, or what a helper that builds the
#   exception returns (`raise _corrupt(call, detail)`);
# - the faults given to the runtime helper, `check_faults(x, [(condition, message), ...])`:
#   every 2-tuple `(condition, message)` written in the package whose message is a string, an
#   f-string or a name bound to one, wherever it is written (in the list passed to
#   `check_faults`, returned by a helper such as `_power_fault`, passed on as `index_fault=`).
#   `test_every_fault_message_is_collected` holds this rule against what really reaches
#   `check_faults`.
#
# Small helpers are followed: a call of a top-level function of the same file
# (`_out_of_range(num_envs)`, `plural(...)`, `_structure_message(...)`) stands for what the
# function returns, its parameters bound to the call's arguments; a subscript of a top-level
# dict (`_EMPTY[source]`) for each of its values; a name assigned once in the function
# (`call = "SumTree.set"`) for its value.

_ANY = None
_Template = tuple[str | None, ...]
_ANYTHING: list[_Template] = [(_ANY,)]


def _normalise(parts) -> _Template:
    out: list[str | None] = []
    for part in parts:
        if part == "" or (part is _ANY and out and out[-1] is _ANY):
            continue
        if part is not _ANY and out and out[-1] is not _ANY:
            out[-1] += part
        else:
            out.append(part)
    return tuple(out)


def _concat(*sequence: list[_Template]) -> list[_Template]:
    """Each way of taking one template from every list of `sequence`, concatenated."""
    out: list[_Template] = [()]
    for options in sequence:
        out = list(dict.fromkeys(_normalise(a + b) for a in out for b in options))
    return out


def _union(*options: list[_Template]) -> list[_Template]:
    return list(dict.fromkeys(t for option in options for t in option))


def _name_of(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _scope(node: ast.AST):
    """The nodes of a module or function body, not entering nested functions or classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
        ):
            yield from _scope(child)


def _bindings(node: ast.AST) -> dict:
    """What each name of a scope stands for: the expression of a name assigned exactly once
    (`x = ...`), `_ANYTHING` for parameters and names assigned otherwise."""
    stores: dict[str, list] = {}
    for child in _scope(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            stores.setdefault(child.id, []).append(child)
    single = {}
    for child in _scope(node):
        if isinstance(child, ast.Assign) and len(child.targets) == 1:
            target, value = child.targets[0], child.value
        elif isinstance(child, ast.AnnAssign) and child.value is not None:
            target, value = child.target, child.value
        else:
            continue
        if isinstance(target, ast.Name):
            single[target.id] = value
    out: dict = {
        name: single[name] if len(nodes) == 1 and name in single else _ANYTHING
        for name, nodes in stores.items()
    }
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                out[arg.arg] = _ANYTHING
    return out


class _Source:
    """One file of the package, read for the messages it can raise."""

    def __init__(self, text: str, where: str):
        self.where = where
        self.tree = ast.parse(text)
        self.functions = {
            node.name: node for node in self.tree.body if isinstance(node, ast.FunctionDef)
        }
        self.constants = _bindings(self.tree)
        self.arguments: dict[str, dict] = {}
        self.arguments = self._private_arguments()

    def _private_arguments(self) -> dict[str, dict]:
        """What each parameter of a private top-level function (`_check_int`) stands for: the
        arguments its calls in this file pass, if the file only calls it (never passes it
        around, never with `*args`). Its callers' own parameters count as anything."""
        calls: dict[str, list] = {name: [] for name in self.functions if name.startswith("_")}
        loads = dict.fromkeys(calls, 0)
        for node, env, _ in self.walk():
            if isinstance(node, ast.Name) and node.id in loads:
                loads[node.id] += 1
            if isinstance(node, ast.Call) and _name_of(node.func) in calls:
                calls[_name_of(node.func)].append((node, env))
        out = {}
        for name, found in calls.items():
            starred = any(
                isinstance(a, ast.Starred) or a is None
                for call, _ in found
                for a in [*call.args, *(k.arg for k in call.keywords)]
            )
            if not found or starred or loads[name] != len(found):
                continue
            function = self.functions[name]
            params = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
            passed: dict[str, list[_Template]] = {p: [] for p in params}
            for call, env in found:
                given = dict(zip(params, call.args))
                given.update({k.arg: k.value for k in call.keywords if k.arg in passed})
                for param in params:
                    arg = given.get(param)
                    passed[param] += _ANYTHING if arg is None else self.templates(arg, env)
            out[name] = {p: list(dict.fromkeys(t)) for p, t in passed.items()}
        return out

    def templates(self, node: ast.expr, env: dict, depth: int = 0) -> list[_Template]:
        """What the expression `node` can evaluate to, as templates (`_ANYTHING` if unknown)."""
        if depth > 10:
            return _ANYTHING
        deeper = depth + 1
        if isinstance(node, ast.Constant):
            return [(node.value,)] if isinstance(node.value, str) else _ANYTHING
        if isinstance(node, ast.JoinedStr):
            return _concat(*(self._field(value, env, deeper) for value in node.values))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _concat(
                self.templates(node.left, env, deeper), self.templates(node.right, env, deeper)
            )
        if isinstance(node, ast.IfExp):
            return _union(
                self.templates(node.body, env, deeper), self.templates(node.orelse, env, deeper)
            )
        if isinstance(node, ast.Name):
            if node.id in env:
                value, scope = env[node.id], env
            else:
                value, scope = self.constants.get(node.id, _ANYTHING), self.constants
            return value if isinstance(value, list) else self.templates(value, scope, deeper)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            table = env.get(node.value.id, self.constants.get(node.value.id))
            if isinstance(table, ast.Dict):
                return _union(*(self.templates(v, self.constants, deeper) for v in table.values))
            return _ANYTHING
        if isinstance(node, ast.Call) and _name_of(node.func) in self.functions:
            return self._inline(self.functions[_name_of(node.func)], node, env, deeper)
        if isinstance(node, ast.Call) and _name_of(node.func).endswith("Error") and node.args:
            return self.templates(node.args[0], env, deeper)  # an exception: its message
        return _ANYTHING

    def _field(self, value: ast.expr, env: dict, depth: int) -> list[_Template]:
        if isinstance(value, ast.FormattedValue):
            if value.conversion != -1 or value.format_spec is not None:
                return _ANYTHING  # `{x!r}` quotes a string, `{x:.2f}` formats a number
            return self.templates(value.value, env, depth)
        return self.templates(value, env, depth)

    def _inline(self, function: ast.FunctionDef, call: ast.Call, env: dict, depth: int):
        """What `call` of the helper `function` returns, its parameters bound to the arguments."""
        inner = _bindings(function)
        params = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
        for name, arg in zip(params, call.args):
            inner[name] = self.templates(arg, env, depth)
        for keyword in call.keywords:
            if keyword.arg is not None:
                inner[keyword.arg] = self.templates(keyword.value, env, depth)
        returns = [
            node.value
            for node in _scope(function)
            if isinstance(node, ast.Return) and node.value is not None
        ]
        return _union(*(self.templates(r, inner, depth) for r in returns)) or _ANYTHING

    def walk(self):
        """`(node, env, function name)` for every node outside annotations."""
        yield from self._walk(self.tree, dict(self.constants), "<module>")

    def _walk(self, node: ast.AST, env: dict, function: str):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            env, function = {**env, **_bindings(node)}, node.name
            if self.functions.get(node.name) is node:
                env.update(self.arguments.get(node.name, {}))
        yield node, env, function
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns") or (
                isinstance(node, ast.Subscript) and field == "slice"
            ):
                continue  # jaxtyping's `Float[Array, " n"]` is no fault
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    yield from self._walk(child, env, function)

    def messages(self) -> list[tuple[str, _Template]]:
        """`(file:line, template)` of every message raised here or given to `check_faults`."""
        out = []
        for node, env, _ in self.walk():
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                found = self.templates(node.exc, env)
            elif (
                isinstance(node, ast.Tuple)
                and len(node.elts) == 2
                and not isinstance(node.elts[0], ast.Constant)
                and isinstance(node.elts[1], ast.Constant | ast.JoinedStr | ast.Name)
            ):
                found = self.templates(node.elts[1], env)
            else:
                continue
            out += [
                (f"{self.where}:{node.lineno}", t)
                for t in found
                if any(part is not _ANY for part in t)
            ]
        return out


def _package_sources() -> list[_Source]:
    return [
        _Source(path.read_text(), str(path.relative_to(ROOT)))
        for path in sorted((ROOT / "dejax_eqx").rglob("*.py"))
    ]


def _code_messages() -> list[tuple[str, _Template]]:
    return [message for source in _package_sources() for message in source.messages()]


def _regex(template: _Template) -> str:
    return "".join(".*?" if part is _ANY else re.escape(part) for part in template)


def _quotes(quote: str, template: _Template) -> bool:
    """Whether `quote` is a message of `template`: all of it, or its beginning, cut where the
    message breaks a line or, if the quote ends with `...`, anywhere."""
    if re.fullmatch(_regex(template), quote, re.S):
        return True
    cut_anywhere = quote.endswith("...")
    if cut_anywhere:
        quote = quote[:-3].rstrip()
    for k, part in enumerate(template):
        for j in range(len(part) + 1 if part is not _ANY else 0):
            if not (cut_anywhere or part[j : j + 1] == "\n") or not quote.endswith(part[:j]):
                continue
            head = quote[: len(quote) - j]
            if re.fullmatch(_regex(template[:k]), head, re.S):
                return True
        if part is _ANY and cut_anywhere and re.fullmatch(_regex(template[: k + 1]), quote, re.S):
            return True
    return False


# The page's last section quotes JAX's own messages, not the library's.
_JAX_SECTION = "## Errors from JAX you may meet"
_SPAN = re.compile(r"``\s(.+?)\s``|`([^`\n]+)`")
_EXCEPTION = re.compile(r"[\w.]*(Error|Exception)")


def _page_quotes(page: str) -> list[tuple[int, str]]:
    """`(line, message)` for every message the page quotes as a definition-list term (the line
    before a `:   ` definition): each code span of the term but exception names."""
    lines = page.split(_JAX_SECTION)[0].splitlines()
    quotes = []
    for number, (line, following) in enumerate(zip(lines, lines[1:]), start=1):
        if not following.startswith(":   ") or not line.strip():
            continue
        for match in _SPAN.finditer(line):
            text = match.group(1) or match.group(2)
            if not _EXCEPTION.fullmatch(text):
                quotes.append((number, text))
    return quotes


def test_message_templates_follow_helpers():
    # The rules above on a small file: every way a message is put together in the package.
    source = _Source(
        """
_EMPTY = {"a": "nothing in a", "b": "nothing in b"}


def _range(n):
    return f"id out of range [0, {n})"


def _corrupt(call, detail):
    return ValueError(f"`{call}`: {detail}; nothing was loaded.")


def _fault(x, call):
    return x < 0, f"`{call}`: x must be non-negative"


def _check(value, what):
    if value < 0:
        raise ValueError(f"value must be {what}, got {value}.")


def check_both(x):
    _check(x, "positive")
    _check(x, what="non-negative")


def f(x, source, k):
    call = "Thing.f"
    message = f"`{call}`: {_range(k)}"
    if x:
        raise _corrupt(call, f"{source!r} is truncated")
    check_faults(x, [(x > 0, message), (x < 0, f"`{call}`: {_EMPTY[source]}"), _fault(x, call)])
    y: Float[Array, " n"] = x  # an annotation, no fault
""",
        "example.py",
    )
    assert {t for _, t in source.messages()} == set(
        [
            ("`Thing.f`: x must be non-negative",),  # `_fault` is called with that `call` only
            ("`Thing.f`: ", _ANY, " is truncated; nothing was loaded."),
            ("`Thing.f`: id out of range [0, ", _ANY, ")"),
            ("`Thing.f`: nothing in a",),
            ("`Thing.f`: nothing in b",),
            ("value must be positive, got ", _ANY, "."),
            ("value must be non-negative, got ", _ANY, "."),
        ]
    )


def test_quote_matching():
    template = ("`", _ANY, "`: the item has shape ", _ANY, ".\n  expected: ", _ANY)
    assert _quotes("`A.add`: the item has shape (3,).", template)  # cut at a line break
    assert _quotes("`A.add`: the item has shape ...", template)
    assert not _quotes("`A.add`: the item has shape (3,)", template)  # cut, but not said
    assert not _quotes("`A.add`: the item has the shape (3,).", template)
    assert _quotes("`A.add`: the item has shape (3,).\n  expected: (4,)", template)


def test_errors_page_quotes_every_message():
    # code -> page: the literal parts of every message are on the page, line by line (the page
    # shows a message of several lines as a block). Parts shorter than 10 characters say too
    # little to look for.
    messages = _code_messages()
    assert len(messages) > 80  # the walk found the messages
    page = (DOCS / "errors.md").read_text()
    missing = [
        f"{where}: {line!r}"
        for where, template in messages
        for part in template
        if part is not _ANY
        for line in (piece.strip() for piece in part.split("\n"))
        if len(line) >= 10 and line not in page
    ]
    assert not missing, "docs/errors.md does not quote these messages:\n" + "\n".join(missing)


def test_errors_page_quotes_only_real_messages():
    # page -> code: every message the page quotes is one the code can print.
    quotes = _page_quotes((DOCS / "errors.md").read_text())
    assert len(quotes) > 80  # the page's terms were found
    templates = list(dict.fromkeys(template for _, template in _code_messages()))
    unknown = [
        f"docs/errors.md:{line}: {quote!r}"
        for line, quote in quotes
        if not any(_quotes(quote, template) for template in templates)
    ]
    assert not unknown, "docs/errors.md quotes messages the code does not print:\n" + "\n".join(
        unknown
    )


def _exercise_every_fault_site() -> None:
    """Trace, on valid arguments, every method that reports faults (tracing is enough: the
    messages reach `check_faults` whether a fault holds or not, and nothing is compiled)."""
    item = {"obs": jnp.zeros(2), "reward": jnp.asarray(1.0), "done": jnp.asarray(False)}
    buffers = (
        dx.CircularBuffer(item, 4),
        dx.UniformReplay(item, 4),
        dx.SumTree(4),
        dx.PrioritisedReplay(item, 4),
        dx.ClusteredReplay(
            dx.PrioritisedReplay(item, 4), 2, lambda x: (x["reward"] > 0).astype(jnp.int32)
        ),
        dx.TrajectoryBuffer(item, num_envs=2, max_length=4),
        dx.PrioritisedTrajectoryBuffer(item, num_envs=2, max_length=4, sequence_length=1),
        dx.TrajectoryQueue(item, num_envs=2, max_length=4),
    )

    def run(buffers, key):
        ring, uniform, tree, prioritised, clustered, trajectories, windowed, queue = buffers
        batch = jax.tree.map(lambda x: jnp.stack([x, x]), item)
        slots, ones = jnp.array([0, 1], jnp.int32), jnp.ones(2)
        ring = ring.push_batch(batch)
        ring.get(0)
        ring.pop()
        uniform.add_batch(batch).sample(key, 2)
        tree.set(slots, ones).get(slots)
        prioritised.add_batch(batch, ones).set_priorities(slots, ones).sample(key, 2)
        prioritised.stale(slots, jnp.zeros(2, jnp.uint32))
        dx.importance_weights(jnp.array([0.5, 0.5]), 2, 0.4)
        clustered = clustered.add_batch(batch)
        clustered.sample(key, 2)
        clustered.set_priorities(slots, slots, ones)
        trajectories = trajectories.add(batch)
        trajectories.add(batch, env_ids=slots).peek()
        for source in ("replay", "online"):
            trajectories.sample(key, 2, 2, source=source)
            trajectories.sample(key, 2, 1, burn_in=1, strict=True, source=source)
        trajectories.sample_mixed(key, 1, 1, 2)
        trajectories.sample_mixed(key, 1, 1, 1, period=2, episode_ends="within", done="done")
        trajectories.sample_transitions(key, 2, 1, discount=0.9, reward="reward", terminated="done")
        trajectories.overwritten(slots, slots)
        windows = windowed.add(batch)
        windows.sample(key, 2)
        windows.set_priorities(slots, slots, ones)
        windows.stale(slots, slots)
        queue.add(batch).pop(1)

    def flashbax_layer(key):
        rollout = jax.tree.map(lambda x: jnp.stack([x, x])[:, None], item)  # [2 rows, 1 step]
        traj = fbx.trajectory_buffer.init(item, 2, 4)
        fbx.trajectory_buffer.sample(fbx.trajectory_buffer.add(traj, rollout), key, 2, 1, 1)
        queue = fbx.trajectory_queue.init(item, 2, 4)
        fbx.trajectory_queue.sample(fbx.trajectory_queue.add(queue, rollout), 1)
        windows = fbx.prioritised_trajectory_buffer
        state = windows.prioritised_init(item, 2, 4, 1)
        state = windows.prioritised_add(state, rollout, 2, 1, "cpu")  # sets the window: 2
        sample = windows.prioritised_sample(state, key, 2, 2, 1)
        windows.set_priorities(state, sample.indices, jnp.ones(2), 0.6, "cpu")

    eqx.filter_eval_shape(run, buffers, jax.random.key(0))
    eqx.filter_eval_shape(flashbax_layer, jax.random.key(0))


def test_every_fault_message_is_collected(monkeypatch):
    # The rule that finds the faults' messages in the source, held against what really reaches
    # `check_faults`: every call of it runs here, and every message it is given is one that
    # `_code_messages` found (so the page tests above cover it).
    from dejax_eqx import _checks

    original = _checks.check_faults
    calls: list[tuple[tuple[str, str], str]] = []

    def recording(x, faults, **options):
        caller = sys._getframe(1).f_code
        site = (str(pathlib.Path(caller.co_filename).relative_to(ROOT)), caller.co_name)
        calls.extend((site, message) for _, message in faults)
        return original(x, faults, **options)

    for name, module in sys.modules.items():
        if name.startswith("dejax_eqx") and getattr(module, "check_faults", None) is original:
            monkeypatch.setattr(module, "check_faults", recording)
    _exercise_every_fault_site()

    sites = {
        (source.where, function)
        for source in _package_sources()
        for node, _, function in source.walk()
        if isinstance(node, ast.Call) and _name_of(node.func) == "check_faults"
    }
    missed = sites - {site for site, _ in calls}
    assert not missed, f"exercise these calls of `check_faults` above: {sorted(missed)}"
    templates = list(dict.fromkeys(template for _, template in _code_messages()))
    unknown = {
        f"{where}: {message!r}"
        for (where, _), message in calls
        if not any(re.fullmatch(_regex(t), message, re.S) for t in templates)
    }
    assert not unknown, "messages given to `check_faults` that the source rule misses:\n" + (
        "\n".join(sorted(unknown))
    )


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
