"""Validation shared by every buffer: the one home of each check.

Static facts (pytree structure, shapes, dtypes, constructor arguments) are checked here in
Python, so they fail at trace time with a message naming the call and the offending leaf. Facts
that depend on data (an empty buffer, an index out of range) are *faults*, reported by
`check_faults`, eagerly and under `jit`, `vmap` and `shard_map` alike.

A public method validates its arguments once, with these helpers, then calls unchecked
internals that never validate again.
"""

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, cast, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree, UInt32

from ._faults import Fault


INT32_MAX = int(np.iinfo(np.int32).max)
_S = TypeVar("_S", bound=str)

# What a constructor accepts as a prototype item: array-likes, or shape/dtype structs.
Prototype = PyTree[ArrayLike | jax.ShapeDtypeStruct]


def plural(n: int, one: str, many: str | None = None) -> str:
    """`"1 item"`, `"2 items"`: `n` and the noun that agrees with it."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def leaf_paths(tree: PyTree) -> list[str]:
    """The `keystr` path of every leaf of `tree`, in flattening order."""
    return [keystr(path) for path, _ in tree_flatten_with_path(tree)[0]]


# ---------------------------------------------------------------------------------------------
# Python arguments: capacities, batch sizes, exponents, options. All static.


def _check_int(value: Any, call: str, minimum: int, maximum: int, what: str) -> int:
    """`value` as an `int` in `[minimum, maximum]`, else a `ValueError`/`TypeError` quoting
    `call`; `what` names the lower bound ("positive", "non-negative")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{call}` must be a Python int, got {value!r} of type {type(value).__name__}."
        )
    value = int(value)
    if value < minimum:
        raise ValueError(f"`{call}` must be {what}, got {value}.")
    if value > maximum:
        raise ValueError(f"`{call}` must be at most {maximum}, got {value}.")
    return value


def check_positive_int(value: Any, call: str, *, maximum: int = INT32_MAX) -> int:
    """`value` as an `int` in `[1, maximum]`, else a `ValueError`/`TypeError` quoting `call`."""
    return _check_int(value, call, 1, maximum, "positive")


def check_nonnegative_int(value: Any, call: str, *, maximum: int = INT32_MAX) -> int:
    """`value` as an `int` in `[0, maximum]`, else a `ValueError`/`TypeError` quoting `call`."""
    return _check_int(value, call, 0, maximum, "non-negative")


def _check_float(value: Any, call: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{call}` must be a Python float, got {value!r} of type {type(value).__name__}."
        )
    try:
        return float(value)
    except OverflowError:  # a Python int past the largest float64
        size = f"an int of {value.bit_length()} bits" if isinstance(value, int) else repr(value)
        raise ValueError(
            f"`{call}` must be finite, got a number too large for any float ({size})."
        ) from None


def check_finite_float(value: Any, call: str) -> float:
    """`value` as a finite Python `float`, else a `ValueError`/`TypeError` quoting `call`."""
    value = _check_float(value, call)
    if not math.isfinite(value):
        raise ValueError(f"`{call}` must be finite, got {value}.")
    return value


def check_nonnegative_float(value: Any, call: str) -> float:
    """`value` as a finite non-negative Python float, else `ValueError`/`TypeError`."""
    value = _check_float(value, call)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`{call}` must be finite and non-negative, got {value}.")
    return value


def check_bool(value: Any, call: str) -> bool:
    """`value` if it is a Python bool, else a `TypeError` quoting `call`."""
    if not isinstance(value, bool):
        raise TypeError(f"`{call}` must be a bool, got {value!r}.")
    return value


def check_choice(value: Any, choices: tuple[_S, ...], call: str) -> _S:
    """`value` if it is one of the strings `choices`, else a `ValueError` quoting `call`."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{call}` must be one of {options}, got {value!r}.")
    return choices[choices.index(value)]


def check_float_dtype(dtype: Any, call: str) -> np.dtype:
    """`dtype` as float32 or float64; float64 only when `jax_enable_x64` is on."""
    # `np.dtype(None)` is float64: refuse `None` here rather than blame 64-bit mode for it.
    if dtype is None:
        raise TypeError(f"`{call}` must be jnp.float32 or jnp.float64, got None.")
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"`{call}` must be a dtype, got {dtype!r}.") from e
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"`{call}` must be float32 or float64, got {dtype}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"`{call}`: {dtype} needs 64-bit mode; enable it with "
            "`jax.config.update('jax_enable_x64', True)` or use float32."
        )
    return dtype


# ---------------------------------------------------------------------------------------------
# Items: structure, shapes and dtypes against the prototype.


def as_prototype(prototype: Prototype, call: str) -> PyTree[jax.ShapeDtypeStruct]:
    """Validate a user's prototype item and return its shape/dtype spec.

    Every leaf must be array-like (a JAX or NumPy array, a NumPy scalar or a Python
    bool/int/float) or a `jax.ShapeDtypeStruct`. Python scalars take JAX's default dtype for
    their kind.
    """
    flat, treedef = tree_flatten_with_path(prototype)
    if not flat:
        raise ValueError(
            f"`{call}`: the prototype has no array leaves; a buffer needs at least one."
        )
    specs = []
    for path, leaf in flat:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            specs.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            continue
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
            raise TypeError(
                f"`{call}`: prototype leaf `{keystr(path)}` is a {type(leaf).__name__}, "
                "not an array; every leaf of the prototype must be array-like or a "
                "jax.ShapeDtypeStruct."
            )
        leaf = jnp.asarray(leaf)
        specs.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, specs)


def _structure_message(call: str, what: str, expected: PyTree, actual: PyTree) -> str:
    expected_paths = leaf_paths(expected)
    actual_paths = leaf_paths(actual)
    missing = [p for p in expected_paths if p not in actual_paths]
    extra = [p for p in actual_paths if p not in expected_paths]
    detail = []
    if missing:
        detail.append(f"missing leaves {missing}")
    if extra:
        detail.append(f"unexpected leaves {extra}")
    if not detail:
        detail.append("the same leaf paths but different container types")
    return (
        f"`{call}`: the {what} does not have the prototype's structure ({'; '.join(detail)}).\n"
        f"  expected: {jax.tree.structure(expected)}\n"
        f"  got:      {jax.tree.structure(actual)}"
    )


def _python_scalar(value: bool | int | float | complex, dtype: np.dtype) -> np.ndarray | None:
    """`value` as a 0-d array of `dtype`, or `None` if `dtype` cannot hold it.

    The kind must agree (a bool only into a bool leaf, and only a bool there; no float or
    complex into an integer leaf, no complex into a real one), and the value must survive:
    an int exactly (no wrap, no rounding of a large int in a float leaf), a float without
    overflowing. A float is rounded to the leaf's precision, as every JAX operation rounds a
    Python float (`0.1` into a float32 leaf is the float32 nearest to 0.1).
    """
    kind = dtype.kind  # b: bool, i/u: integer, f: floating (bfloat16 too), c: complex
    if isinstance(value, bool) != (kind == "b"):
        return None
    if isinstance(value, complex) and kind != "c":
        return None
    if kind in "iu":
        if not isinstance(value, int):  # a float or complex, however integral
            return None
        info = np.iinfo(dtype)
        return np.asarray(value, dtype) if info.min <= value <= info.max else None
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(value, dtype)
    if isinstance(value, int) and not isinstance(value, bool):
        return out if out.item() == value else None  # exact, also for large ints
    finite_in = np.isfinite(complex(value))
    return out if bool(np.isfinite(out)) or not finite_in else None


def check_items(
    spec: PyTree[jax.ShapeDtypeStruct],
    items: PyTree[ArrayLike],
    call: str,
    *,
    batched: bool,
    what: str | None = None,
    convert: bool = True,
) -> tuple[PyTree[Array | np.ndarray], int | None]:
    """Check `items` against `spec` and convert its leaves to JAX arrays (with `convert`;
    without it, only check, and return `items` as given: for data that stays on the host).

    With `batched=False`, `items` is one item: each leaf has exactly its spec's shape and dtype.
    With `batched=True`, each leaf has one extra leading axis, of the same length `n` for all
    leaves; `n` is returned (else `None`).

    Arrays must already have the stored dtype: nothing is cast. A Python scalar, which has no
    dtype of its own, is converted when the stored dtype holds it (see `_python_scalar`).

    Raises `ValueError` for a structure or shape mismatch or a Python scalar the stored dtype
    cannot hold, and `TypeError` for a dtype mismatch, naming the leaf path, the expected and
    the actual value.
    """
    if what is None:
        what = "batch of items" if batched else "item"
    expected_def = jax.tree.structure(spec)
    if jax.tree.structure(items) != expected_def:
        raise ValueError(_structure_message(call, what, spec, items))
    flat_items = tree_flatten_with_path(items)[0]
    flat_spec = jax.tree.leaves(spec)
    out = []
    n = None
    first_path = None
    for (path, leaf), want in zip(flat_items, flat_spec):
        name = keystr(path)
        # A NumPy float64 or complex128 scalar is also a Python float or complex, but has a
        # dtype of its own: it is an array here, and must match.
        python = isinstance(leaf, bool | int | float | complex) and not isinstance(leaf, np.generic)
        if python and not batched:
            converted = _python_scalar(leaf, np.dtype(want.dtype))
            if converted is None:
                raise ValueError(
                    f"`{call}`: {what} leaf `{name}` is the Python scalar {leaf!r}, which the "
                    f"stored dtype {want.dtype} cannot hold exactly; pass an array of dtype "
                    f"{want.dtype} to store a converted value."
                )
            leaf = converted
        elif not isinstance(leaf, jax.Array | np.ndarray | np.generic):
            raise TypeError(
                f"`{call}`: {what} leaf `{name}` is a {type(leaf).__name__}, not an array."
            )
        shape = tuple(np.shape(leaf))
        dtype = leaf.dtype
        if batched:
            if shape[1:] != want.shape or len(shape) == 0:
                raise ValueError(
                    f"`{call}`: {what} leaf `{name}` has shape {shape}; expected "
                    f"(n, *{want.shape}): a leading batch axis followed by the prototype's "
                    f"shape {want.shape}."
                )
            if n is None:
                n, first_path = shape[0], name
            elif shape[0] != n:
                raise ValueError(
                    f"`{call}`: the leaves of the {what} disagree on the leading batch axis: "
                    f"`{first_path}` has {n} entries but `{name}` has {shape[0]}."
                )
        elif shape != want.shape:
            raise ValueError(
                f"`{call}`: {what} leaf `{name}` has shape {shape}, expected {want.shape} "
                "(the prototype's shape)."
            )
        if dtype != want.dtype:
            raise TypeError(
                f"`{call}`: {what} leaf `{name}` has dtype {dtype}, expected {want.dtype}. "
                "Buffers keep the prototype's dtypes exactly; cast with `.astype` first."
            )
        out.append(jnp.asarray(leaf) if convert else leaf)
    return jax.tree.unflatten(expected_def, out), n


def check_sequences(
    spec: PyTree[jax.ShapeDtypeStruct], items: PyTree[ArrayLike], call: str, convert: bool = True
) -> tuple[PyTree[Array | np.ndarray], int, int]:
    """`check_items` for a batch of sequences: each leaf has two extra leading axes `(n, T)`,
    the same for all leaves. Returns the items (converted, as `check_items` does with
    `convert`), `n` and `T`."""
    leaves = jax.tree.leaves(items)
    if jax.tree.structure(items) == jax.tree.structure(spec) and leaves:
        first = leaves[0]
        if np.ndim(first) < 2 + len(jax.tree.leaves(spec)[0].shape):
            raise ValueError(
                f"`{call}`: the batch of sequences has a leaf of shape {np.shape(first)}; every "
                "leaf needs two leading axes (n, T), the envs and the steps, before the "
                "prototype's shape."
            )
        length = np.shape(first)[1]
        spec = jax.tree.map(lambda s: jax.ShapeDtypeStruct((length, *s.shape), s.dtype), spec)
    else:
        length = 0
    items, n = check_items(
        spec, items, call, batched=True, what="batch of sequences", convert=convert
    )
    assert n is not None
    return items, n, length


def check_fn_output(
    spec: PyTree[jax.ShapeDtypeStruct], fn: Callable[[PyTree[Array]], PyTree], call: str
) -> None:
    """Check without running it that `fn(item) -> item` keeps structure, shapes and dtypes."""
    out = jax.eval_shape(fn, spec)
    if jax.tree.structure(out) != jax.tree.structure(spec):
        raise ValueError(_structure_message(call, "output of `fn`", spec, out))
    for name, got, want in zip(leaf_paths(spec), jax.tree.leaves(out), jax.tree.leaves(spec)):
        if got.shape != want.shape:
            raise ValueError(
                f"`{call}`: `fn` returned shape {got.shape} at leaf `{name}`, expected "
                f"{want.shape}; `fn` must map one item to one item of the same shapes."
            )
        if got.dtype != want.dtype:
            raise TypeError(
                f"`{call}`: `fn` returned dtype {got.dtype} at leaf `{name}`, expected "
                f"{want.dtype}; cast inside `fn` to keep the stored dtypes."
            )


def check_index_fn(
    spec: PyTree[jax.ShapeDtypeStruct], fn: Callable[[PyTree[Array]], Any], call: str
) -> None:
    """Check without running it that `fn(item)` returns one integer scalar."""
    out = jax.eval_shape(fn, spec)
    ok = isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
    if not ok or not jnp.issubdtype(out.dtype, jnp.integer):
        got = (
            f"{out.dtype}{list(out.shape)}"
            if isinstance(out, jax.ShapeDtypeStruct)
            else f"a {type(out).__name__}"
        )
        raise TypeError(
            f"`{call}` must map one item to one integer scalar (an int array of shape ()), "
            f"but it returned {got}."
        )


LeafName = str | Callable[[Any], Any]
"""Names one leaf of a step: a key of the step (a mapping) or an attribute of it (a named
tuple, a dataclass, a module), or a function that returns the leaf from the step's pytree
(`lambda step: step.info.done`; structure only: it must return the stored leaf itself)."""


def pick_leaf(tree: PyTree, name: LeafName) -> Any:
    """The leaf of `tree` (a step, or stored steps of the same structure) that `name` names."""
    if callable(name):
        return name(tree)
    if isinstance(tree, Mapping):
        return tree[name]
    return getattr(tree, name)


def check_leaf(spec: PyTree[jax.ShapeDtypeStruct], name: Any, what: str, *, floating: bool) -> None:
    """Check at trace time that `name` picks one leaf of a step (`spec`) with one value per
    step, of a floating dtype (`floating`) or bool. `what` names the argument in messages."""
    if not (isinstance(name, str) or callable(name)):
        raise TypeError(
            f"{what} must name a leaf of the step: a str (a key or attribute of the step) or a "
            f"function that returns the leaf, got {name!r}."
        )
    # A function is run on abstract arrays (without running anything), so that one which
    # computes a new array from the leaves is told apart from one that picks a leaf.
    picked: list[Any] = []

    def probe(step: PyTree[Array]) -> Array:
        picked.append(pick_leaf(step, name))
        leaves = jax.tree.leaves(step)
        picked.append(next((i for i, x in enumerate(leaves) if picked[0] is x), None))
        return jnp.zeros(())

    try:
        jax.eval_shape(probe, spec)
    except (KeyError, AttributeError, TypeError, IndexError) as error:
        raise ValueError(
            f"{what}: the step has no leaf {name!r} ({type(error).__name__}: {error})."
        ) from None
    if picked[1] is None:
        raise ValueError(
            f"{what}: {name!r} must pick one leaf of the step as it is stored, but it "
            "returned something else (a new array computed from the step, say)."
        )
    leaf = jax.tree.leaves(spec)[picked[1]]
    if tuple(leaf.shape) != ():
        raise ValueError(
            f"{what}: the leaf {name!r} has shape {tuple(leaf.shape)} per step; it must hold "
            "one value per step (shape ())."
        )
    if floating and not jnp.issubdtype(leaf.dtype, jnp.floating):
        raise TypeError(f"{what}: the leaf {name!r} has dtype {leaf.dtype}, expected a float.")
    if not floating and leaf.dtype != jnp.bool_:
        raise TypeError(f"{what}: the leaf {name!r} has dtype {leaf.dtype}, expected bool.")


def spec_of(
    data: PyTree[Array | jax.ShapeDtypeStruct], axes: int = 1
) -> PyTree[jax.ShapeDtypeStruct]:
    """The per-item spec of stored `data`: each leaf's shape without its first `axes` axes.

    `data` may hold arrays or `jax.ShapeDtypeStruct`s.
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[axes:], x.dtype), data)


# ---------------------------------------------------------------------------------------------
# Other array arguments: masks, vectors, scalars, indices.


def _array_like(x: Any, call: str, what: str) -> None:
    """Refuse what is not array-like (a list, a tuple, None, ...) with a message naming `call`."""
    if not isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
        raise TypeError(
            f"`{call}`: `{what}` must be an array (a JAX or NumPy array), got a "
            f"{type(x).__name__}; convert it with `jnp.asarray` first."
        )


def check_mask(mask: ArrayLike, n: int, call: str) -> Array:
    """A boolean `(n,)` mask for a batch of `n` items, as a JAX array."""
    _array_like(mask, call, "mask")
    shape = tuple(np.shape(mask))
    dtype = jnp.result_type(mask)
    if shape != (n,):
        raise ValueError(f"`{call}`: `mask` has shape {shape}, expected ({n},): one flag per item.")
    if dtype != jnp.bool_:
        raise TypeError(f"`{call}`: `mask` has dtype {dtype}, expected bool.")
    return jnp.asarray(mask)


def check_mask_like(mask: ArrayLike, like: Array, call: str) -> Array:
    """A boolean mask of one flag per entry of `like` (the checked ids it goes with), as a
    JAX array."""
    _array_like(mask, call, "mask")
    shape = tuple(np.shape(mask))
    dtype = jnp.result_type(mask)
    if shape != tuple(like.shape):
        raise ValueError(
            f"`{call}`: `mask` has shape {shape}, expected {tuple(like.shape)}: one flag per entry."
        )
    if dtype != jnp.bool_:
        raise TypeError(f"`{call}`: `mask` has dtype {dtype}, expected bool.")
    return jnp.asarray(mask)


def check_vector(x: ArrayLike, n: int | None, call: str, name: str) -> Array | np.ndarray:
    """A one-axis array of `n` real entries (any length if `n` is None), returned as given
    (not converted: `as_float` converts it).

    Integer and floating dtypes are accepted (not bool, not complex).
    (Index vectors go through `check_index`.)
    """
    _array_like(x, call, name)
    shape = tuple(np.shape(x))
    want = "(n,)" if n is None else f"({n},)"
    if len(shape) != 1 or (n is not None and shape[0] != n):
        raise ValueError(
            f"`{call}`: `{name}` has shape {shape}, expected {want}: one entry per item."
        )
    _check_real_dtype(x, call, name)
    return cast(Array | np.ndarray, x)


def check_real_scalar(x: ArrayLike, call: str, name: str) -> ArrayLike:
    """A real scalar (integer or floating; not bool, not complex), returned as given (not
    converted: `as_float` converts it)."""
    _array_like(x, call, name)
    shape = tuple(np.shape(x))
    if shape != ():
        raise ValueError(f"`{call}`: `{name}` has shape {shape}, expected a scalar.")
    _check_real_dtype(x, call, name)
    return x


def _check_real_dtype(x: ArrayLike, call: str, name: str) -> None:
    if isinstance(x, int | float) and not isinstance(x, bool):
        return  # a Python number of any size (`jnp.result_type` refuses an int past int64)
    dtype = jnp.result_type(x)
    if isinstance(x, bool) or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(
            f"`{call}`: `{name}` has dtype {dtype}, expected a floating or integer dtype."
        )


def as_float(
    x: ArrayLike, dtype: Any, call: str, name: str, *, mask: ArrayLike | None = None
) -> tuple[Float[Array, "*s"], list[Fault]]:
    """The one conversion of a numeric argument to the float `dtype` it is used in:
    `(converted, faults)`. `x` is a real array or scalar checked by `check_vector` or
    `check_real_scalar`.

    The value is converted from its own dtype, where its magnitude survives: a NumPy or
    Python value in NumPy (an int64 `2**32` becomes float32 `4294967296.0`, where
    `jnp.asarray` without 64-bit mode would first wrap it to the int32 0), a JAX array with
    `astype`. Rounding to the precision of `dtype` is what every JAX operation does, and is
    allowed; overflow is not. The fault holds where a finite value (a Python int of any size
    included) becomes infinite in `dtype`; the converted value there is infinite, for the
    caller's own checks to see. Entries where `mask` is False are not checked. `faults` is
    empty when no value of the dtype of `x` can overflow (integers into float32, float32 into
    float32): the hot paths, JAX arrays of float32, carry no extra check.
    """
    dtype = np.dtype(dtype)
    message = (
        f"`{call}`: `{name}` holds a finite value too large for {dtype}, the dtype it is used "
        "in (it would become inf)"
    )
    if isinstance(x, jax.Array):
        out = x.astype(dtype)
        wider = (
            jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).max > np.finfo(dtype).max
        )
        bad = (jnp.isfinite(x) & ~jnp.isfinite(out)) if wider else None
    else:
        if isinstance(x, int) and not isinstance(x, bool):
            try:
                value = np.asarray(float(x))
            except OverflowError:  # past the largest float64: infinite in every float dtype
                value = np.asarray(math.inf if x > 0 else -math.inf)
            finite = np.asarray(True)
        else:
            value = np.asarray(x)
            finite = np.isfinite(value)
        with np.errstate(over="ignore", invalid="ignore"):
            host = value.astype(dtype)
        bad = finite & ~np.isfinite(host)
        wider = value.dtype.kind == "f" and np.finfo(value.dtype).max > np.finfo(dtype).max
        bad = bad if wider or bad.any() else None  # (a Python int past float64 is not wider)
        out = jnp.asarray(host)
    if bad is None:
        return out, []
    if mask is not None:
        bad = bad & jnp.asarray(mask)
    return out, [(bad, message)]


def check_generations(generations: ArrayLike, n: int, call: str) -> UInt32[Array, " n"]:
    """Generations as `sample` returns them: a uint32 array of shape `(n,)` (any other dtype
    would be converted, and an int32 generation past 2**31 wraps)."""
    if not isinstance(generations, jax.Array | np.ndarray):
        raise TypeError(
            f"`{call}`: `generations` must be the uint32 array a sample returned, got a "
            f"{type(generations).__name__}."
        )
    if generations.dtype != jnp.uint32:
        raise TypeError(
            f"`{call}`: `generations` has dtype {generations.dtype}, expected uint32 (as a "
            "sample returns them)."
        )
    if tuple(generations.shape) != (n,):
        raise ValueError(
            f"`{call}`: `generations` has shape {tuple(generations.shape)}, expected ({n},): "
            "one per index."
        )
    return jnp.asarray(generations)


def check_index(
    index: Any,
    bound: int,
    call: str,
    *,
    ndim: int | None = None,
    length: tuple[int, str] | None = None,
) -> tuple[Int[Array, "*s"], Bool[Array, "*s"]]:
    """The one check of every index or id that enters the library: `(int32 index, fault)`.

    Trace time: `index` must be an integer array or a Python int (not a bool, not a list), of
    `ndim` axes where given, and where `length = (n, what)` is given, of a leading axis of `n`,
    one entry per element of `what` (else `TypeError` / `ValueError` naming `call`).

    Whether each entry lies in `[0, bound)` is data. It is decided in the index's own dtype,
    before any cast: a cast to int32 first would wrap an int64 or uint32 value into range.
    NumPy values are compared in NumPy, before `jnp.asarray` (which, without 64-bit mode,
    wraps an int64 into int32 silently).

    **Returns:** the index as int32, with every out-of-range entry replaced by `bound` (one past
    the end: a scatter with `mode="drop"` drops it, a gather with `mode="fill"` fills it; for
    `bound = 2**31`, by `2**31 - 1`, past the end of any array), and
    the boolean `fault` of the same shape, `True` at those entries, for `check_faults`.
    """
    if isinstance(index, bool) or not isinstance(index, jax.Array | np.ndarray | np.generic | int):
        got = f"the bool {index!r}" if isinstance(index, bool) else f"a {type(index).__name__}"
        raise TypeError(
            f"`{call}` must be an integer array (a JAX or NumPy array) or a Python int, got {got}."
        )
    shape = tuple(np.shape(index))
    if not isinstance(index, int) and not jnp.issubdtype(index.dtype, jnp.integer):
        raise TypeError(f"`{call}` must be an integer array, got dtype {index.dtype}.")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"`{call}` must have {plural(ndim, 'axis', 'axes')}, got shape {shape}.")
    if length is not None and shape[0] != length[0]:
        raise ValueError(
            f"`{call}` has {shape[0]} entries, expected {length[0]}: one per {length[1]}."
        )
    assert 0 < bound <= INT32_MAX + 1
    # What a bad entry becomes: past the end of anything it indexes (arrays hold at most
    # 2**31 - 1 entries), and an int32.
    past = min(bound, INT32_MAX)
    if isinstance(index, int | np.ndarray | np.generic):
        value = np.asarray(index, object if isinstance(index, int) else None)
        bad = (value < 0) | (value >= bound)
        safe = np.where(bad, past, value).astype(np.int64)
        return jnp.asarray(safe, jnp.int32), jnp.asarray(bad, jnp.bool_)
    info = jnp.iinfo(index.dtype)
    bad = jnp.zeros(shape, jnp.bool_)
    if info.min < 0:
        bad = bad | (index < 0)
    if bound <= info.max:  # else every value of the dtype is below the bound
        bad = bad | (index >= jnp.asarray(bound, index.dtype))
    return jnp.where(bad, past, index.astype(jnp.int32)), bad


def count_ids(ids: Int[Array, " n"], num: int) -> Int[Array, " num"]:
    """How often each id in `[0, num)` occurs in `ids` (from `check_index`: the out-of-range
    entries, which it set to `num`, are not counted). `(counts > 1).any()` flags a repeated id.
    O(len(ids) + num)."""
    return jnp.zeros(num, jnp.int32).at[ids].add(1, mode="drop")
