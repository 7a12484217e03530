"""The docs cannot drift from the code.

- Every ```python block in `docs/*.md`, `README.md` and the public docstrings (the `!!! Example`
  blocks) runs as written, on its own, in a fresh namespace. A block that imports flashbax is
  skipped where flashbax is not installed (it is in the `benchmarks` extra).
- Every public name has an entry in the API reference.
- The errors page's table of messages is the one `docs/_ext/messages.py` generates from the
  source, and every message the page's prose quotes is one the code prints. The extractor's
  rule for the faults is held against what really reaches `check_faults`.
"""

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
import numpy as np
import pytest

from .helpers import python_blocks_with_lines, SLOW


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
    # The README's examples run in the README's test command, with the first example of every
    # other guide and of every fourth docstring (in name order); the rest are `slow` (CI runs
    # them: tests/helpers.py).
    params = []
    guides = sorted(DOCS.glob("*.md"))
    for path in [*guides, ROOT / "README.md"]:
        later = path in guides and guides.index(path) % 2 == 1
        for i, (line, code) in enumerate(python_blocks_with_lines(path.read_text())):
            marks = [SLOW] if path.parent == DOCS and (i or later) else []
            params.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    docstrings = [
        (f"{qualname}:{line}", code)
        for qualname, doc in sorted(_public_docstrings().items())
        for line, code in python_blocks_with_lines(doc)
    ]
    for k, (name, code) in enumerate(docstrings):
        params.append(pytest.param(code, id=name, marks=[SLOW] if k % 4 else []))
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
    if re.search(r"\bjax\.(shard_map|sharding\.reshard)\b|dx\.Global", code) and not hasattr(
        jax.sharding, "reshard"
    ):
        pytest.skip("the sharding guide needs JAX 0.7+ (jax.shard_map, jax.sharding.reshard)")
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
# The errors page: a table generated from the source, and prose that quotes only real messages.


def _extractor():
    """`docs/_ext/messages.py`, the table of messages (a script of the docs, not a package)."""
    spec = importlib.util.spec_from_file_location("docs_messages", DOCS / "_ext" / "messages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


extractor = _extractor()
ANY = extractor.ANY


def test_errors_page_table_is_generated():
    page = (DOCS / "errors.md").read_text()
    block = extractor.generated_block(page)
    assert block is not None, (
        f"docs/errors.md lost its markers: {extractor.BEGIN} ... {extractor.END}"
    )
    assert len(extractor.messages()) > 200  # the walk found the messages
    assert block == extractor.catalogue(), (
        f"docs/errors.md's table of messages is out of date: run `{extractor.COMMAND}`."
    )


# The prose quotes a message as a code span that starts with the call it names, in the form
# the library prints it: `` `UniformReplay.sample`: cannot sample ... ``. The last section
# quotes JAX's own messages, not the library's.
_JAX_SECTION = "## Errors from JAX you may meet"
_FENCE = re.compile(r"^([ \t]*)```.*?^\1```", re.M | re.S)
_QUOTE = re.compile(r"``\s(`[^`\n]+`[:\s].*?)\s``")


def _prose_quotes(page: str) -> list[tuple[int, str]]:
    """`(line, message)` for every message the hand-written part of `page` quotes."""
    block = extractor.generated_block(page) or ""
    prose = page.replace(block, "\n" * block.count("\n")).split(_JAX_SECTION)[0]
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    return [
        (prose.count("\n", 0, match.start()) + 1, match.group(1))
        for match in _QUOTE.finditer(prose)
    ]


def test_errors_page_quotes_only_real_messages():
    quotes = _prose_quotes((DOCS / "errors.md").read_text())
    assert len(quotes) > 10  # the page's quotes were found
    templates = list(dict.fromkeys(m.template for m in extractor.messages()))
    unknown = [
        f"docs/errors.md:{line}: {quote!r}"
        for line, quote in quotes
        if not any(extractor.quotes(quote, template) for template in templates)
    ]
    assert not unknown, "docs/errors.md quotes messages the code does not print:\n" + "\n".join(
        unknown
    )


_EXAMPLE = {
    "doors.py": """
def check_range(x, call):
    if x < 0:
        raise ValueError(f"`{call}`: x must be non-negative, got {x}.")
    return x > 9, f"`{call}`: x is past the end"
""",
    "example.py": """
from .doors import check_range

_EMPTY = {"a": "nothing in a", "b": "nothing in b"}


def _range(n):
    return f"id out of range [0, {n})"


def _corrupt(call, detail):
    return OSError(f"`{call}`: {detail}; nothing was loaded.")


def _check(value, what):
    if value < 0:
        raise TypeError(f"value must be {what}, got {value}.")


class Thing:
    def f(self, x, source, k):
        call = "Thing.f"
        message = f"`{call}`: {_range(k)}"
        if x:
            raise _corrupt(call, f"{source!r} is truncated")
        _check(x, "positive")
        _check(x, what="non-negative")
        faults = [(x > 0, message), (x < 0, f"`{call}`: {_EMPTY[source]}")]
        check_faults(x, [*faults, check_range(x, call)])
        y: Float[Array, " n"] = x  # an annotation, no fault
        return (y, "a pair, no message")

    def g(self, x):
        check_range(x, f"{type(self).__name__}.g")
""",
}


def test_message_templates_follow_helpers(tmp_path):
    # The extractor's rules on a small package: every way a message is put together.
    (tmp_path / "pkg").mkdir()
    for name, text in _EXAMPLE.items():
        (tmp_path / "pkg" / name).write_text(text)
    found = {
        f"{m.where} {m.kind}: {m.text}" for m in extractor.package(tmp_path / "pkg").messages()
    }
    assert found == {
        "pkg/example.py:Thing.f OSError: `Thing.f`: … is truncated; nothing was loaded.",
        "pkg/example.py:_check TypeError: value must be positive, got ….",
        "pkg/example.py:_check TypeError: value must be non-negative, got ….",
        "pkg/example.py:Thing.f runtime: `Thing.f`: id out of range [0, …)",
        "pkg/example.py:Thing.f runtime: `Thing.f`: nothing in a",
        "pkg/example.py:Thing.f runtime: `Thing.f`: nothing in b",
        # A parameter stands for what each call passes, in another file too.
        "pkg/doors.py:check_range ValueError: `Thing.f`: x must be non-negative, got ….",
        "pkg/doors.py:check_range runtime: `Thing.f`: x is past the end",
        "pkg/doors.py:check_range ValueError: `Thing.g`: x must be non-negative, got ….",
        "pkg/doors.py:check_range runtime: `Thing.g`: x is past the end",
    }


def test_quote_matching():
    template = ("`", ANY, "`: the item has shape ", ANY, ".\n  expected: ", ANY)
    assert extractor.quotes("`A.add`: the item has shape (3,).", template)  # cut at a line break
    assert extractor.quotes("`A.add`: the item has shape ...", template)
    assert not extractor.quotes("`A.add`: the item has shape (3,)", template)  # cut, but not said
    assert not extractor.quotes("`A.add`: the item has the shape (3,).", template)
    assert extractor.quotes("`A.add`: the item has shape (3,).\n  expected: (4,)", template)


def _exercise_every_fault_site() -> None:
    """Trace, on valid arguments, every function that reports faults (tracing is enough: the
    messages reach `check_faults` whether a fault holds or not, and nothing is compiled)."""
    item = {"obs": jnp.zeros(2), "reward": jnp.asarray(1.0), "done": jnp.asarray(False)}
    window = dx.Window(1, strict=True)
    buffers = (
        dx.CircularBuffer(item, 4),
        dx.UniformReplay(item, 4),
        dx.SumTree(4),
        dx.PrioritisedReplay(item, 4),
        dx.ClusteredReplay(
            dx.PrioritisedReplay(item, 4), 2, lambda x: (x["reward"] > 0).astype(jnp.int32)
        ),
        dx.TrajectoryBuffer(item, num_envs=2, max_length=4),
        dx.PrioritisedTrajectoryBuffer(item, num_envs=2, max_length=4, window=window),
        dx.TrajectoryQueue(item, num_envs=2, max_length=4),
        dx.Streams(item, num_envs=2, max_length=4),
    )

    def run(buffers, key):
        ring, uniform, tree, prioritised, clustered, trajectories, windowed, queue, streams = (
            buffers
        )
        batch = jax.tree.map(lambda x: jnp.stack([x, x]), item)
        rollout = jax.tree.map(lambda x: x[:, None], batch)  # [2 envs, 1 step]
        slots, ones = jnp.array([0, 1], jnp.int32), jnp.ones(2)
        ring = ring.push_batch(batch)
        ring.get(0)
        ring.pop()
        uniform.add_batch(batch).sample(key, 2)
        tree.set(slots, ones).get(slots)
        # NumPy float64 values, which could overflow float32: the only kind that is checked.
        tree.find(np.ones(2))
        dx.sequence_priorities(np.ones((2, 2)), jnp.ones((2, 2), bool))
        prioritised = prioritised.add_batch(batch, ones)
        sample = prioritised.set_priorities(slots, ones).sample(key, 2)
        prioritised.stale(sample.indices, sample.generations)
        dx.importance_weights(jnp.array([0.5, 0.5]), 2, 0.4)
        clustered = clustered.add_batch(batch)
        clustered.sample(key, 2)
        clustered.set_priorities((slots, slots), ones)
        trajectories = trajectories.add(batch).extend(rollout, env_ids=slots)
        trajectories.peek()
        for source in ("replay", "online"):
            trajectories.sample(key, 2, dx.Window(2), source=source)
            trajectories.sample(key, 2, dx.Window(1, burn_in=1, strict=True), source=source)
        mixed = {"replay": 1, "online": 1}
        trajectories.sample(key, 2, dx.Window(2), source=mixed)
        within = dx.Window(1, period=2, episode_ends="within", done="done")
        trajectories.sample(key, 2, within, source=mixed)
        nstep = dx.NStep(1, reward="reward", terminated="done")
        trajectories.sample(key, 2, nstep, discount=0.9)
        trajectories.stale(slots, slots)
        trajectories.read(slots, slots, dx.Window(1))
        windows = windowed.add(batch)
        drawn = windows.sample(key, 2).sample
        windows.set_priorities(drawn.env, drawn.start, ones)
        windows.stale(slots, slots)
        windows.stamp_of(slots)
        windows.with_window_priorities(windows.window_priorities().mass)
        queue.add(batch).extend(rollout).pop(1)
        streams = streams.append(batch).extend(rollout, env_ids=slots)
        streams.newest()
        streams.stale(slots, slots)
        episodes = dx.Episodes("done", autoreset="same-step")
        kept = dx.TrajectoryBuffer(item, num_envs=2, max_length=4, episodes=episodes)
        kept = kept.add(batch)
        kept.episodes_of(slots, jnp.zeros(2, jnp.int32))
        kept.write_back(slots, slots, {"reward": jnp.ones((2, 1))}, mask=jnp.ones((2, 1), bool))
        kept.sample(key, 2, dx.Window(1, starts="episode"))
        kept.sample(key, 2, dx.WholeEpisode(2))
        steps = jax.tree.map(lambda x: jnp.zeros((2, 4, *x.shape), x.dtype), item)
        streams.restore(steps, jnp.array([4, 2], jnp.int32), jnp.array([4, 2], jnp.int32))
        # Policy age: `current` and `max_age` as arrays, whose range is checked at run time.
        age = dx.PolicyAge(lambda x: x["done"].astype(jnp.int32), jnp.asarray(3), jnp.asarray(2))
        uniform.add_batch(batch).sample(key, 2, age=age)
        prioritised.sample(key, 2, age=age)
        trajectories.sample(key, 2, dx.Window(2), age=age)
        windows.sample(key, 2, age=age)
        # Rate limiting: a traced amount is checked at run time.
        limited = dx.RateLimited(uniform, dx.RateLimiter.sample_to_insert_ratio(1, 1, 4))
        n = jnp.asarray(1, jnp.int32)
        limited.limiter.can_insert(n)
        limited.limiter.can_sample(n)
        limited = limited.add(item).add_batch(batch, mask=jnp.array([True, False]))
        limited.sample(key, 1)
        # With `throw=False` the law judges an insert before it is written.
        recording = dx.RateLimited(uniform.with_throw(False), limited.limiter)
        recording.add(item).sample(key, 1)
        # A mixture: traced fractions (their range), a part with a `max_fraction`.
        mixture = dx.Mixture(
            {"a": dx.Part("t", dx.Window(2), max_fraction=0.5), "b": dx.Part("t", dx.Window(2))}
        )
        mixture.sample(key, 2, {"t": trajectories}, jnp.array([0.5, 0.5]))

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
        for read in (fbx.buffers.sum_tree.get, fbx.buffers.sum_tree.get_batch):
            read(state.sum_tree_state, sample.indices)
        fbx.buffers.sum_tree.get_probability(state.sum_tree_state, sample.indices)
        fbx.buffers.sum_tree.sample(state.sum_tree_state, key)
        fbx.buffers.sum_tree.stratified_sample(state.sum_tree_state, 2, key)
        fbx.buffers.sum_tree.get_tree_index(jnp.int32(1), jnp.int32(0))

    eqx.filter_eval_shape(run, buffers, jax.random.key(0))
    eqx.filter_eval_shape(flashbax_layer, jax.random.key(0))
    if hasattr(jax, "shard_map"):  # the global buffers need JAX 0.7+
        _exercise_global_buffers(item, window)


def _exercise_global_buffers(item, window) -> None:
    """The global buffers' fault sites, on a mesh of this process's one device."""
    mesh = jax.make_mesh((1,), ("replay",))
    odd = lambda x: (x["reward"] > 0).astype(jnp.int32)  # noqa: E731
    makers = {
        "uniform": lambda: dx.UniformReplay(item, 4),
        "prioritised": lambda: dx.PrioritisedReplay(item, 4),
        "clustered": lambda: dx.ClusteredReplay(dx.PrioritisedReplay(item, 4), 2, odd),
        "trajectories": lambda: dx.TrajectoryBuffer(item, num_envs=2, max_length=4),
        "windows": lambda: dx.PrioritisedTrajectoryBuffer(item, 2, 4, window),
        "queue": lambda: dx.TrajectoryQueue(item, num_envs=2, max_length=4),
    }
    replays = ("uniform", "prioritised", "clustered")
    kind = {
        name: dx.GlobalReplay if name in replays else dx.GlobalTrajectoryBuffer for name in makers
    }
    buffers = {name: kind[name](mesh, make) for name, make in makers.items()}

    def run(b, key):
        batch = jax.tree.map(lambda x: jnp.stack([x, x]), item)
        slots, ones = jnp.array([0, 1], jnp.int32), jnp.ones(2)
        b["uniform"].add_batch(batch).sample(key, 2)
        sample = b["prioritised"].add_batch(batch).sample(key, 2)
        b["prioritised"].set_priorities(sample.indices, ones)
        b["prioritised"].stale(sample.indices, sample.generations)
        b["clustered"].add_batch(batch).sample(key, 2)
        b["clustered"].set_priorities((slots, slots), ones)
        trajectories = b["trajectories"].add(batch).add(batch, env_ids=slots)
        trajectories.sample(key, 2, dx.Window(2))
        trajectories.stale(slots, slots)
        windows = b["windows"].add(batch)
        drawn = windows.sample(key, 2).sample
        windows.set_priorities(drawn.env, drawn.start, ones)
        b["queue"].add(batch).pop(1)

    eqx.filter_eval_shape(run, buffers, jax.random.key(0))

    # Rate limiting over two shards: each counts its share of an insert, a sample folds them in.
    two = jax.make_mesh((2,), ("replay",), devices=jax.devices()[:2])
    limiter = dx.RateLimiter.min_size(1)
    limited = dx.RateLimited(dx.GlobalReplay(two, makers["uniform"]), limiter)

    def limit(limited, key):
        limited = limited.add_batch(jax.tree.map(lambda x: jnp.stack([x, x]), item))
        limited.sample(key, 1)

    eqx.filter_eval_shape(limit, limited, jax.random.key(0))
    # With `throw=False`, the faults found inside `shard_map` are brought out of it.
    recording = dx.RateLimited(
        dx.GlobalReplay(two, lambda: dx.UniformReplay(item, 4, throw=False)), limiter
    )
    eqx.filter_eval_shape(limit, recording, jax.random.key(0))


@SLOW
def test_every_fault_message_is_collected(monkeypatch):
    # The extractor's rule for the faults' messages, held against what really reaches
    # `check_faults`: every function that calls it runs here, and every message it is given is
    # one the extractor found as a runtime message (so the table in docs/errors.md lists it).
    from dejax_eqx import _faults

    original = _faults.check_faults
    calls: list[tuple[tuple[str, str], str]] = []

    def recording(x, faults, **options):
        caller = sys._getframe(1).f_code
        site = (pathlib.Path(caller.co_filename).relative_to(ROOT).as_posix(), caller.co_name)
        calls.extend((site, message) for _, message in faults)
        return original(x, faults, **options)

    for name, module in sys.modules.items():
        if name.startswith("dejax_eqx") and getattr(module, "check_faults", None) is original:
            monkeypatch.setattr(module, "check_faults", recording)
    _exercise_every_fault_site()

    missed = extractor.package().callers("check_faults") - {site for site, _ in calls}
    if not hasattr(jax, "shard_map"):  # the global buffers need JAX 0.7+
        missed = {(where, name) for where, name in missed if "/_global" not in where}
        missed -= {("dejax_eqx/_shard_map.py", "call")}
    assert not missed, f"exercise these calls of `check_faults` above: {sorted(missed)}"
    templates = list(dict.fromkeys(m.template for m in extractor.messages() if m.kind == "runtime"))
    unknown = {
        f"{where}: {message!r}"
        for (where, _), message in calls
        if not any(
            re.fullmatch(extractor.regex(t), message.split(_faults.SITE)[0], re.S)
            for t in templates
        )
    }
    assert not unknown, "messages given to `check_faults` that the extractor misses:\n" + (
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


@SLOW
def test_eqx_on_error_nan_poisons_every_lane():
    # What docs/jit-patterns.md says about EQX_ON_ERROR=nan. Equinox reads the variable when it
    # is imported, hence a fresh interpreter.
    env = {**os.environ, "EQX_ON_ERROR": "nan"}
    result = subprocess.run(
        [sys.executable, "-c", _NAN_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
