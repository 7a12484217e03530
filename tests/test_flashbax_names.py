"""Every public name of the installed flashbax (0.1.3) is importable from the same path under
`dejax_eqx.compat.flashbax`, with a compatible kind and signature, unless it is left out on
purpose (`LEFT_OUT`, each with its reason, each also named in docs/migration-flashbax.md).

**Which names are public.** The modules are `flashbax` and every module
`pkgutil.walk_packages` finds under it, except its tests (`*_test`) and `conftest`. A public
name of a module is a name that does not start with `_` and that the module's own source binds
at its top level (outside any `def` or `class`, inside top-level `if`/`try`/`with` blocks too):

- defined there: a `def`, a `class`, or an assignment (`Indices = Array`, `SET_BATCH_FN = {...}`,
  `Experience = TypeVar(...)`); or
- re-exported there: imported from flashbax itself (`from flashbax.utils import
  add_dim_to_args`, or a relative import), so that user code can import it from that module
  (Stoix imports `BufferState` from `flashbax.buffers.trajectory_buffer`, `Experience` from the
  item buffer's module, and so on);

and whose value is not a module. Not public: whatever a module imports from outside flashbax
(`jax`, `chex`, `Array`, `PRNGKey`, `Numeric`, `dataclass`, `Optional`, `TYPE_CHECKING`: another
package's API, whatever name flashbax gives it), and a module bound as an attribute
(`flashbax.buffers.sum_tree` inside `prioritised_trajectory_buffer`): a submodule is checked as a
module of its own. The rule reads each module's source with `ast`, because at run time a name
imported from chex and one assigned in flashbax look alike.

**What counts as compatible** (`_incompatibility`):

- a class of flashbax's: a class of the same name defined in the drop-in, taking the same type
  parameters (`TrajectoryBufferState[Transition]`, as Mava writes it);
- a TypeVar: a TypeVar of the same name and variance, bound to (or constrained by) the
  drop-in's classes of the same names; a bound from outside flashbax must be its counterpart in
  `BOUND_COUNTERPARTS` (`chex.ArrayTree`: the drop-in does not depend on chex);
- a function: a callable with every parameter of flashbax's, by name and kind, the positional
  ones in flashbax's order, with flashbax's default wherever flashbax gives one; a parameter of
  ours that flashbax does not have must have a default;
- a class or function from outside flashbax bound by a flashbax assignment (`Indices =
  jax.Array`): the same object;
- any other value (`sample_types`): a value of the same type, equal to flashbax's, classes
  compared by name.
"""

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import typing
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import dejax_eqx
import dejax_eqx.compat.flashbax as fbx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from beartype.roar import BeartypeCallHintParamViolation
from dejax_eqx.compat.flashbax.buffers import (
    prioritised_trajectory_buffer as ptb,
    trajectory_buffer as tb,
)
from dejax_eqx.compat.flashbax.buffers.flat_buffer import Experience as FlatExperience
from dejax_eqx.compat.flashbax.buffers.item_buffer import Experience as ItemExperience
from dejax_eqx.compat.flashbax.buffers.prioritised_item_buffer import (
    Experience as PrioritisedItemExperience,
)
from dejax_eqx.compat.flashbax.buffers.trajectory_buffer import (
    BufferSample,
    BufferState,
    Experience,
    TrajectoryBufferSample,
    TrajectoryBufferState,
)
from dejax_eqx.compat.flashbax.buffers.trajectory_queue import Experience as QueueExperience

from .helpers import SLOW


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashbax") is None,
    reason="compares with the installed flashbax (pip install flashbax==0.1.3)",
)

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migration-flashbax.md"
DROP_IN = "dejax_eqx.compat.flashbax"

# What the drop-in does not have, by flashbax's dotted path (a module: all of it), and why.
# Each is named, by this path in backticks, in docs/migration-flashbax.md.
LEFT_OUT = {
    "flashbax.vault": "Vault is on-disk storage through tensorstore; the drop-in has none "
    "(dx.save/dx.load and dx.Dataset are dejax_eqx's)",
    "flashbax.vault.vault": "Vault's module, as `flashbax.vault`",
    "flashbax.buffers.sum_tree.init": "builds flashbax's raw node array; the drop-in's "
    "SumTreeState is a read-only view of a buffer's priorities",
    "flashbax.buffers.sum_tree.set_non_batched": "writes flashbax's raw node array; priorities "
    "change through set_priorities",
    "flashbax.buffers.sum_tree.set_batch_bincount": "as set_non_batched",
    "flashbax.buffers.sum_tree.set_batch_scan": "as set_non_batched",
    "flashbax.buffers.prioritised_trajectory_buffer.SET_BATCH_FN": "flashbax's choice of "
    "sum-tree writer per device, whose values are the writers above",
}


def _bound_counterparts() -> dict[Any, Any]:
    import chex
    import jaxtyping

    return {chex.ArrayTree: jaxtyping.PyTree}


def _import(name: str):
    # flashbax and chex warn about deprecations of their own on recent JAX.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


@cache
def flashbax_modules() -> tuple[str, ...]:
    flashbax = _import("flashbax")

    def refuse(name: str) -> None:  # a module that fails to import must not vanish silently
        raise ImportError(f"pkgutil.walk_packages could not import {name}")

    found = ["flashbax"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(flashbax.__path__, "flashbax.", onerror=refuse):
            last = info.name.rsplit(".", 1)[-1]
            if not (last.endswith("_test") or last == "conftest"):
                found.append(info.name)
    return tuple(found)


def _from_flashbax(node: ast.ImportFrom) -> bool:
    module = node.module or ""
    return node.level > 0 or module == "flashbax" or module.startswith("flashbax.")


def _top_level_bindings(statements: list[ast.stmt], out: dict[str, bool]) -> None:
    """`out[name]`: whether `name`'s last top-level binding is flashbax's (a definition, or an
    import from flashbax) rather than an import from elsewhere."""
    for node in statements:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = True
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue  # `x: int` binds nothing
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = True
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = _from_flashbax(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = False
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                _top_level_bindings(getattr(node, block, []), out)
            for handler in getattr(node, "handlers", []):
                _top_level_bindings(handler.body, out)


@cache
def public_names(module_name: str) -> tuple[str, ...]:
    """The public names of flashbax's module `module_name` (the rule of the docstring)."""
    module = _import(module_name)
    assert module.__file__ is not None
    bindings: dict[str, bool] = {}
    _top_level_bindings(ast.parse(Path(module.__file__).read_text()).body, bindings)
    return tuple(
        sorted(
            name
            for name, ours in bindings.items()
            if ours and not name.startswith("_") and not inspect.ismodule(getattr(module, name))
        )
    )


def _is_flashbax(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "flashbax" or module.startswith("flashbax.")


def _is_drop_in(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith(DROP_IN)


def _names(objects: Any) -> list[str]:
    return [getattr(o, "__name__", repr(o)) for o in objects]


def _type_parameters(cls: type) -> list[str]:
    return _names(getattr(cls, "__parameters__", ()))


def _same_type(theirs: Any, ours: Any) -> bool:
    """`ours` stands for flashbax's type `theirs` (a bound or constraint of a TypeVar)."""
    if _is_flashbax(theirs):
        return inspect.isclass(ours) and _is_drop_in(ours) and ours.__name__ == theirs.__name__
    return ours is _bound_counterparts().get(theirs, theirs)


def _signature_incompatibility(theirs: Callable, ours: Callable) -> str | None:
    try:
        expected, got = inspect.signature(theirs), inspect.signature(ours)
    except (TypeError, ValueError) as err:
        return f"no signature to compare ({err})"
    ours_params = got.parameters
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    our_positions = [n for n, p in ours_params.items() if p.kind in positional]
    their_positions = [n for n, p in expected.parameters.items() if p.kind in positional]
    for name, p in expected.parameters.items():
        if name not in ours_params:
            return f"no parameter `{name}`"
        q = ours_params[name]
        if q.kind != p.kind:
            return f"parameter `{name}` is {q.kind.description}, flashbax's {p.kind.description}"
        same = q.default is p.default or (
            type(q.default) is type(p.default) and q.default == p.default
        )
        if p.default is not inspect.Parameter.empty and not same:
            return f"parameter `{name}` defaults to {q.default!r}, flashbax's to {p.default!r}"
    if our_positions[: len(their_positions)] != their_positions:
        return f"positional parameters {our_positions}, flashbax's {their_positions}"
    for name, q in ours_params.items():
        variadic = q.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if name not in expected.parameters and not variadic and q.default is q.empty:
            return f"parameter `{name}`, which flashbax does not have, has no default"
    return None


def _incompatibility(theirs: Any, ours: Any) -> str | None:
    """Why `ours` cannot stand for flashbax's `theirs` (None if it can)."""
    if isinstance(theirs, typing.TypeVar):
        if not isinstance(ours, typing.TypeVar):
            return f"not a TypeVar but {ours!r}"
        if ours.__name__ != theirs.__name__:
            return f"a TypeVar named {ours.__name__}"
        if (ours.__covariant__, ours.__contravariant__) != (
            theirs.__covariant__,
            theirs.__contravariant__,
        ):
            return "a TypeVar of another variance"
        if (theirs.__bound__ is None) != (ours.__bound__ is None) or (
            theirs.__bound__ is not None and not _same_type(theirs.__bound__, ours.__bound__)
        ):
            return f"bound to {ours.__bound__!r}, flashbax's to {theirs.__bound__!r}"
        constraints = (theirs.__constraints__, ours.__constraints__)
        if len(constraints[0]) != len(constraints[1]) or not all(
            _same_type(t, o) for t, o in zip(*constraints)
        ):
            theirs_, ours_ = _names(constraints[0]), _names(constraints[1])
            return f"constrained by {ours_}, flashbax's by {theirs_}"
        return None
    if (inspect.isclass(theirs) or callable(theirs)) and not _is_flashbax(theirs):
        # An assignment of another package's object (`Indices = Array`): the object itself.
        return None if ours is theirs else f"{ours!r}, not {theirs!r}"
    if inspect.isclass(theirs):
        if not inspect.isclass(ours):
            return f"not a class but {ours!r}"
        if ours.__name__ != theirs.__name__ or not _is_drop_in(ours):
            return f"the class {ours.__module__}.{ours.__qualname__}"
        if _type_parameters(ours) != _type_parameters(theirs):
            return (
                f"a class with type parameters {_type_parameters(ours)}, flashbax's "
                f"{_type_parameters(theirs)}"
            )
        return None
    if callable(theirs):
        if not callable(ours) or inspect.isclass(ours):
            return f"not a function but {ours!r}"
        return _signature_incompatibility(theirs, ours)
    if type(ours) is not type(theirs):
        return f"a {type(ours).__name__}, flashbax's a {type(theirs).__name__}"
    if isinstance(theirs, list | tuple):
        return None if _names(ours) == _names(theirs) else f"{_names(ours)}, not {_names(theirs)}"
    return None if ours == theirs else f"{ours!r}, not {theirs!r}"


class Name(NamedTuple):
    module: str  # flashbax's module
    name: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"


def _all_names() -> list[Name]:
    return [Name(m, n) for m in flashbax_modules() for n in public_names(m)]


def _left_out(name: Name) -> bool:
    return any(
        name.path == key or name.module == key or name.module.startswith(key + ".")
        for key in LEFT_OUT
    )


def _drop_in_path(module: str) -> str:
    return DROP_IN + module.removeprefix("flashbax")


def test_the_rule_finds_what_it_should():
    # What Stoix imports, and what the rule must not take for flashbax's API.
    names = {n.path for n in _all_names()}
    for path in [
        "flashbax.make_flat_buffer",
        "flashbax.buffers.trajectory_buffer.BufferState",
        "flashbax.buffers.trajectory_buffer.BufferSample",
        "flashbax.buffers.trajectory_buffer.Experience",
        "flashbax.buffers.prioritised_trajectory_buffer.BufferState",
        "flashbax.buffers.item_buffer.Experience",
        "flashbax.buffers.flat_buffer.Experience",
        "flashbax.buffers.prioritised_item_buffer.Experience",
        "flashbax.buffers.trajectory_queue.Experience",
        "flashbax.buffers.prioritised_trajectory_buffer.Indices",
        "flashbax.buffers.mixer.sample_types",
        "flashbax.utils.get_timestep_count",
    ]:
        assert path in names, path
    for path in [
        "flashbax.buffers.trajectory_buffer.jax",  # a module
        "flashbax.buffers.trajectory_buffer.Array",  # jax's
        "flashbax.buffers.trajectory_buffer.TYPE_CHECKING",  # typing's
        "flashbax.buffers.flat_buffer.PRNGKey",  # chex's
        "flashbax.buffers.mixer.Numeric",  # chex's
        "flashbax.buffers.trajectory_buffer.dataclass",  # chex's
        "flashbax.buffers.item_buffer.utils",  # flashbax's, but a module
        "flashbax.buffers",  # a module of `flashbax`, checked on its own
    ]:
        assert path not in names, path
    assert "flashbax.buffers.sum_tree" in flashbax_modules()
    assert not any(m.endswith(("_test", "conftest")) for m in flashbax_modules())


def test_every_public_name_of_flashbax_is_in_the_drop_in():
    problems = []
    checked = 0
    for name in _all_names():
        if _left_out(name):
            continue
        theirs = getattr(_import(name.module), name.name)
        where = _drop_in_path(name.module)
        try:
            module = importlib.import_module(where)
        except ImportError:
            problems.append(f"{where}: no such module (flashbax has {name.module})")
            continue
        if not hasattr(module, name.name):
            problems.append(f"{where}.{name.name}: missing")
            continue
        why = _incompatibility(theirs, getattr(module, name.name))
        if why is not None:
            problems.append(f"{where}.{name.name}: {why}")
        checked += 1
    assert not problems, "\n".join(problems)
    assert checked > 100  # the walk found flashbax's modules


def test_what_is_left_out_is_flashbax_s_and_named_in_the_migration_guide():
    guide = GUIDE.read_text()
    names = {n.path for n in _all_names()}
    for key, reason in LEFT_OUT.items():
        assert reason
        assert key in names or key in flashbax_modules(), f"{key} is no public flashbax name"
        assert f"`{key}`" in guide, f"docs/migration-flashbax.md does not name `{key}`"
        module, _, attr = key.rpartition(".")
        if key in flashbax_modules():
            with pytest.raises(ModuleNotFoundError):  # else it is there now: drop it from LEFT_OUT
                importlib.import_module(_drop_in_path(key))
        else:
            there = importlib.import_module(_drop_in_path(module))
            assert not hasattr(there, attr), f"{key} is in the drop-in now: drop it from LEFT_OUT"


def test_the_check_catches_what_it_should():
    # The comparison itself: each kind of mismatch is caught.
    def f(a, b=1, *, c=None): ...

    f.__module__ = "flashbax.buffers.example"  # compared as flashbax's own function
    assert _incompatibility(f, lambda a, b=1, *, c=None, d=0: None) is None
    assert "no parameter `c`" in str(_incompatibility(f, lambda a, b=1: None))
    assert "defaults to 2" in str(_incompatibility(f, lambda a, b=2, *, c=None: None))
    assert "positional parameters" in str(_incompatibility(f, lambda b=1, a=0, *, c=None: None))
    assert "keyword-only" in str(_incompatibility(f, lambda a, *, b=1, c=None: None))
    assert "has no default" in str(_incompatibility(f, lambda a, b=1, *, c=None, d: None))
    fbx_tb = _import("flashbax.buffers.trajectory_buffer")
    assert "not a TypeVar" in str(_incompatibility(fbx_tb.BufferState, fbx_tb.TrajectoryBuffer))
    bound_elsewhere = typing.TypeVar("BufferState", bound=int)  # pyright: ignore[reportGeneralTypeIssues]
    assert "bound to" in str(_incompatibility(fbx_tb.BufferState, bound_elsewhere))
    # flashbax's own class is not the drop-in's.
    assert "the class" in str(_incompatibility(fbx_tb.TrajectoryBuffer, fbx_tb.TrajectoryBuffer))


# ---------------------------------------------------------------------------------------------
# What Stoix does: its systems import the type variables and annotate jitted steps with them.


def test_stoix_imports_and_annotations_under_jit():
    assert BufferState.__bound__ is TrajectoryBufferState
    assert BufferSample.__bound__ is TrajectoryBufferSample
    assert ItemExperience is FlatExperience is PrioritisedItemExperience is Experience
    assert isinstance(QueueExperience, typing.TypeVar)

    class Transition(NamedTuple):
        obs: jax.Array
        reward: jax.Array

    # Stoix uses the type variables as plain annotations (beartype checks them against their
    # bounds), which a static checker calls meaningless: hence the `pyright: ignore`s below.
    class LearnerState(NamedTuple):  # Stoix's OffPolicyLearnerState, cut down
        buffer_state: BufferState  # pyright: ignore[reportGeneralTypeIssues]
        key: jax.Array

    num_envs, rollout = 2, 3
    # Stoix's DQN: an item buffer fed [num_envs, rollout] batches.
    buffer = fbx.make_item_buffer(
        max_length=64, min_length=4, sample_batch_size=8, add_batches=True, add_sequences=True
    )

    # beartype checks each TypeVar against its bound: the states and samples the drop-in makes
    # are what the annotations promise, also under `jit`.
    @beartype
    def learner_step(
        state: LearnerState,
        traj: Experience,  # pyright: ignore[reportInvalidTypeVarUse]
    ) -> tuple[LearnerState, BufferSample]:  # pyright: ignore[reportInvalidTypeVarUse]
        buffer_state: BufferState = buffer.add(state.buffer_state, traj)  # pyright: ignore[reportGeneralTypeIssues]
        key, sample_key = jax.random.split(state.key)
        sample: BufferSample = buffer.sample(buffer_state, sample_key)
        return LearnerState(buffer_state, key), sample

    @beartype
    def can_learn(buffer_state: BufferState) -> jax.Array:  # pyright: ignore[reportInvalidTypeVarUse]
        return buffer.can_sample(buffer_state)

    step = jax.jit(learner_step)
    state = LearnerState(buffer.init(Transition(jnp.zeros(2), jnp.zeros(()))), jax.random.key(0))
    sample = None
    for t in range(2):
        steps = jnp.arange(num_envs * rollout, dtype=jnp.float32).reshape(num_envs, rollout)
        traj = Transition(jnp.stack([steps, -steps], axis=-1) + 10 * t, steps)
        state, sample = step(state, traj)
        assert isinstance(state.buffer_state, TrajectoryBufferState)
        assert isinstance(sample, TrajectoryBufferSample)
    assert sample is not None
    transitions: Transition = sample.experience
    assert transitions.obs.shape == (8, 2) and bool(can_learn(state.buffer_state))
    # The annotations are checked: a queue's state is no BufferState.
    queue = fbx.make_trajectory_queue(8, num_envs, rollout, rollout)
    with pytest.raises(BeartypeCallHintParamViolation):
        can_learn(queue.init(Transition(jnp.zeros(2), jnp.zeros(()))))


def test_states_and_samples_take_flashbax_s_type_arguments():
    # Mava and Stoix write `TrajectoryBufferState[Transition]` as a type alias.
    Transition = dict[str, jax.Array]
    for alias in [
        tb.TrajectoryBufferState[Transition],
        tb.TrajectoryBufferSample[Transition],
        ptb.PrioritisedTrajectoryBufferState[Transition],
        ptb.PrioritisedTrajectoryBufferSample[Transition],
        tb.TrajectoryBuffer[Transition, tb.BufferState, tb.BufferSample],  # pyright: ignore[reportGeneralTypeIssues]
    ]:
        assert typing.get_args(alias)[0] is Transition


# ---------------------------------------------------------------------------------------------
# The names added for this file work as flashbax's do: the same answers, errors and warnings.


def _outcome(function: Callable, *args) -> tuple[Any, type | None, frozenset[type]]:
    """What `function(*args)` returns, the class of what it raises, and the classes of what it
    warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = function(*args), None
        except Exception as err:  # compared by class with flashbax's
            result, error = None, type(err)
    return result, error, frozenset(w.category for w in caught)


@pytest.mark.parametrize(
    "module, name, cases",
    [
        ("buffers.flat_buffer", "validate_sample_batch_size", [(4, 8), (8, 8), (9, 8)]),
        ("buffers.flat_buffer", "validate_min_length", [(0, 2, 4), (6, 2, 4), (7, 2, 3)]),
        ("buffers.flat_buffer", "validate_max_length_add_batch_size", [(4, 2), (3, 2), (1, 1)]),
        ("buffers.flat_buffer", "validate_flat_buffer_args", [(8, 2, 4, 2), (8, 20, 4, 2)]),
        ("buffers.item_buffer", "validate_min_length", [(3, 4), (4, 4), (5, 4)]),
        ("buffers.item_buffer", "validate_sample_batch_size", [(4, 8), (9, 8)]),
        ("buffers.item_buffer", "validate_item_buffer_args", [(8, 2, 4), (8, 9, 4), (8, 2, 9)]),
        ("buffers.trajectory_buffer", "validate_size", [(8, None, 2), (None, 16, 2), (8, 16, 2)]),
        (
            "buffers.trajectory_buffer",
            "validate_trajectory_buffer_args",
            # (max_length_time_axis, min_length_time_axis, add_batch_size, sample_sequence_length,
            # period, max_size)
            [
                (8, 4, 2, 4, 1, None),
                (8, 2, 2, 4, 1, None),  # the minimum raised to the window: a warning
                (8, 4, 2, 4, 5, None),  # a period past the window: a warning
                (None, 4, 2, 4, 1, 16),  # max_size: a warning
                (8, 4, 2, 4, 1, 16),  # both sizes
                (4, 4, 2, 6, 1, None),  # a window past the time axis
                (4, 6, 2, 2, 1, None),  # a minimum past the time axis
                (None, 4, 2, 6, 1, None),  # no time axis known: nothing to compare with
            ],
        ),
        ("buffers.prioritised_flat_buffer", "validate_priority_exponent", [(0.0,), (1.0,), (1.5,)]),
        (
            "buffers.prioritised_trajectory_buffer",
            "validate_device",
            [("cpu",), ("gpu",), ("tpu",), ("xpu",)],
        ),
        ("buffers.prioritised_trajectory_buffer", "get_max_divisible_length", [(10, 3), (9, 3)]),
        ("buffers.prioritised_trajectory_buffer", "get_num_items_in_row", [(10, 3), (9, 1)]),
        ("buffers.prioritised_trajectory_buffer", "get_sum_tree_capacity", [(10, 3, 4), (9, 1, 2)]),
        ("buffers.prioritised_trajectory_buffer", "get_tree_depth", [(1,), (5,), (8,), (9,)]),
    ],
)
def test_helpers_answer_raise_and_warn_as_flashbax_s(module, name, cases):
    theirs = getattr(_import(f"flashbax.{module}"), name)
    ours = getattr(importlib.import_module(f"{DROP_IN}.{module}"), name)
    for args in cases:
        assert _outcome(ours, *args) == _outcome(theirs, *args), (name, args)


def test_get_invalid_indices_is_flashbax_s():
    theirs_module = _import("flashbax.buffers.trajectory_buffer")
    step = {"x": jnp.zeros(())}
    for max_length, period, length, adds in [(8, 2, 3, 5), (9, 3, 2, 7), (6, 1, 1, 13)]:
        ours = tb.init(step, 2, max_length)
        theirs = theirs_module.init(step, 2, max_length)
        for _ in range(adds):
            batch = {"x": jnp.ones((2, 1))}
            ours, theirs = tb.add(ours, batch), theirs_module.add(theirs, batch)
            args = (length, period, 2, max_length)
            with jax.numpy_rank_promotion("allow"):  # flashbax broadcasts ranks
                expected = _import("flashbax.buffers.prioritised_trajectory_buffer")
                expected = expected.get_invalid_indices(theirs, *args)
            np.testing.assert_array_equal(ptb.get_invalid_indices(ours, *args), expected)


def _tree(values: list[float]):
    """The drop-in's and flashbax's sum trees of the same leaves."""
    ours = fbx.buffers.sum_tree.SumTreeState(
        dejax_eqx.SumTree(len(values)).set(jnp.arange(len(values)), jnp.asarray(values)),
        jnp.float32(1),
        1.0,
    )
    sum_tree = _import("flashbax.buffers.sum_tree")
    theirs = sum_tree.init(len(values))
    for i, v in enumerate(values):
        theirs = sum_tree.set_non_batched(theirs, jnp.int32(i), jnp.float32(v))
    return ours, theirs


# The drop-in sum tree's draws: tests/test_flashbax_helpers.py's
# test_sum_tree_sample_takes_flashbax_s_queries_in_0_1 in the default tier; against flashbax's
# own, in the slow tier.
@SLOW
def test_sum_tree_draws_are_flashbax_s_and_never_a_leaf_of_zero():
    sum_tree, theirs_module = fbx.buffers.sum_tree, _import("flashbax.buffers.sum_tree")
    ours, theirs = _tree([1.0, 0.0, 3.0])
    # Inside the intervals (of 0.25 and 0.75 of the total), the same leaf.
    for q in [0.0, 0.1, 0.24, 0.26, 0.5, 0.99]:
        expected = int(theirs_module.sample(theirs, query_value=jnp.float32(q)))
        assert int(sum_tree.sample(ours, query_value=q)) == expected, q
    # At the end of the last interval flashbax's descent falls off the last positive leaf,
    # onto a padding leaf past the capacity (of value 0); the drop-in keeps to leaf 2.
    assert int(theirs_module.sample(theirs, query_value=jnp.float32(1.0))) == 3
    assert int(sum_tree.sample(ours, query_value=1.0)) == 2
    # A key instead of a query value; neither is an error, as in flashbax.
    assert int(sum_tree.sample(ours, jax.random.key(0))) in (0, 2)
    with pytest.raises(ValueError, match="give `rng_key` or `query_value`"):
        sum_tree.sample(ours)
    # Stratified: one draw from each eighth of the total, so exactly 2 of leaf 0, 6 of leaf 2.
    drawn = sum_tree.stratified_sample(ours, 8, jax.random.key(1))
    assert drawn.tolist() == [0, 0, 2, 2, 2, 2, 2, 2]
    assert theirs_module.stratified_sample(theirs, 8, jax.random.key(1)).tolist() == drawn.tolist()
    empty, _ = _tree([0.0, 0.0])
    for draw in [
        lambda: sum_tree.sample(empty, jax.random.key(0)),
        lambda: sum_tree.stratified_sample(empty, 2, jax.random.key(0)),
    ]:
        with pytest.raises(eqx.EquinoxRuntimeError, match="every leaf is 0"):
            draw()
