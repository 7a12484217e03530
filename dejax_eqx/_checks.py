"""Validation shared by every buffer.

Static facts (pytree structure, shapes, dtypes, constructor arguments) are checked here in
Python, so they fail at trace time with a message naming the offending leaf. Facts that depend on
data (an empty buffer, an index out of range) go through `eqx.error_if`, so they are reported
eagerly and under `jit` alike.
"""

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import Array, ArrayLike, PyTree


_INT32_MAX = int(np.iinfo(np.int32).max)
_S = TypeVar("_S", bound=str)

# What a constructor accepts as a prototype item: array-likes, or shape/dtype structs.
Prototype = PyTree[ArrayLike | jax.ShapeDtypeStruct]


def leaf_paths(tree: PyTree) -> list[str]:
    """The `keystr` path of every leaf of `tree`, in flattening order."""
    return [keystr(path) for path, _ in tree_flatten_with_path(tree)[0]]


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


def check_positive_int(value: Any, call: str, *, maximum: int = _INT32_MAX) -> int:
    """`value` as an `int` in `[1, maximum]`, else a `ValueError`/`TypeError` quoting `call`."""
    return _check_int(value, call, 1, maximum, "positive")


def check_finite_float(value: Any, call: str) -> float:
    """`value` as a finite Python `float`, else a `ValueError`/`TypeError` quoting `call`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{call}` must be a Python float, got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{call}` must be finite, got {value}.")
    return value


def is_concrete(x: Any) -> bool:
    """Whether `x` holds a value now (not a tracer inside `jit`, `vmap`, `grad`, ...)."""
    return not isinstance(x, jax.core.Tracer)


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


def check_items(
    spec: PyTree[jax.ShapeDtypeStruct],
    items: PyTree[ArrayLike],
    call: str,
    *,
    batched: bool,
    what: str | None = None,
) -> tuple[PyTree[Array], int | None]:
    """Check `items` against `spec` and convert its leaves to JAX arrays.

    With `batched=False`, `items` is one item: each leaf has exactly its spec's shape and dtype.
    With `batched=True`, each leaf has one extra leading axis, of the same length `n` for all
    leaves; `n` is returned (else `None`).

    Arrays must already have the stored dtype: nothing is silently cast. Python scalars (which
    have no dtype of their own) are converted to the stored dtype.

    Raises `ValueError` for a structure or shape mismatch and `TypeError` for a dtype mismatch,
    naming the leaf path, the expected and the actual value.
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
        if isinstance(leaf, bool | int | float | complex) and not batched:
            try:
                leaf = jnp.asarray(leaf, dtype=want.dtype)
            except OverflowError as e:
                raise ValueError(
                    f"`{call}`: {what} leaf `{name}` is the Python scalar {leaf!r}, which does "
                    f"not fit the stored dtype {want.dtype}."
                ) from e
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
        out.append(jnp.asarray(leaf))
    return jax.tree.unflatten(expected_def, out), n


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


def spec_of(data: PyTree[Array], axes: int = 1) -> PyTree[jax.ShapeDtypeStruct]:
    """The per-item spec of stored `data`: each leaf's shape without its first `axes` axes."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[axes:], x.dtype), data)


def check_mask(mask: ArrayLike, n: int, call: str) -> Array:
    """A boolean `(n,)` mask for a batch of `n` items, as a JAX array."""
    shape = tuple(np.shape(mask))
    dtype = jnp.result_type(mask)
    if shape != (n,):
        raise ValueError(f"`{call}`: `mask` has shape {shape}, expected ({n},): one flag per item.")
    if dtype != jnp.bool_:
        raise TypeError(f"`{call}`: `mask` has dtype {dtype}, expected bool.")
    return jnp.asarray(mask)


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


def out_of_range(index: Array, n: int) -> Array:
    """Where the integer array `index` lies outside `[0, n)`, compared in its own dtype.

    No cast first: a cast to int32 could wrap an out-of-range int64 or uint32 value into range.
    """
    info = jnp.iinfo(index.dtype)
    bad = jnp.zeros(index.shape, jnp.bool_)
    if info.min < 0:
        bad = bad | (index < 0)
    if n <= info.max:  # else every value of the dtype is below n
        bad = bad | (index >= jnp.asarray(n, index.dtype))
    return bad


def check_nonnegative_int(value: Any, call: str, *, maximum: int = _INT32_MAX) -> int:
    """`value` as an `int` in `[0, maximum]`, else a `ValueError`/`TypeError` quoting `call`."""
    return _check_int(value, call, 0, maximum, "non-negative")


def check_choice(value: Any, choices: tuple[_S, ...], call: str) -> _S:
    """`value` if it is one of the strings `choices`, else a `ValueError` quoting `call`."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{call}` must be one of {options}, got {value!r}.")
    return choices[choices.index(value)]


def check_ids(
    ids: ArrayLike, call: str, num: int, *, ndim: int | None = None, length: int | None = None
) -> Array:
    """An integer index array (env ids, cluster ids, ...) of ids in `[0, num)`, as int32.

    Trace-time checks: the dtype must be integer (not bool) and, when given, the array must
    have `ndim` axes and a leading axis of `length`. Whether the values are in range is data:
    every value outside `[0, num)`, compared in its own dtype, becomes -1 (a plain cast could
    wrap an int64 or uint32 id into range), for the caller's run-time check (see `count_ids`).
    """
    shape = tuple(np.shape(ids))
    dtype = jnp.result_type(ids)
    if isinstance(ids, bool) or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"`{call}` must be an integer array, got dtype {dtype}.")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"`{call}` must have {ndim} axis/axes, got shape {shape}.")
    if length is not None and shape[0] != length:
        raise ValueError(
            f"`{call}` has {shape[0]} entries but the batch of items has {length}: one id per item."
        )
    arr = jnp.asarray(ids)
    return jnp.where(out_of_range(arr, num), -1, arr).astype(jnp.int32)


def count_ids(ids: Array, num: int) -> tuple[Array, Array]:
    """How often each of `num` ids occurs in `ids`, for run-time checks with `eqx.error_if`.

    **Returns:** `(in_range, counts)`: the per-entry flag `0 <= id < num`, and for each id in
    `[0, num)` its number of occurrences (out-of-range entries are not counted). Then
    `~in_range.all()` flags an id out of range and `(counts > 1).any()` a duplicate. Cost
    O(len(ids) + num).
    """
    in_range = (ids >= 0) & (ids < num)
    # Out-of-range entries are sent to index `num` and dropped (a negative index would wrap).
    counts = jnp.zeros(num, jnp.int32).at[jnp.where(in_range, ids, num)].add(1, mode="drop")
    return in_range, counts


def error_if_any(x: PyTree, faults: Sequence[tuple[ArrayLike, str]]) -> PyTree:
    """`eqx.error_if` for several faults at once: raise the message of the first that holds.

    One conditional in the compiled program, however many faults: cheaper than chaining
    `error_if`s, each of which passes `x` through a branch of its own. Thread the outputs of
    the operation through `x` (see `dejax_eqx/README.md`).
    """
    preds = jnp.stack([jnp.asarray(pred) for pred, _ in faults])
    # argmax of booleans: the index of the first fault that holds.
    index = jnp.argmax(preds)
    return eqx.branched_error_if(x, jnp.any(preds), index, [msg for _, msg in faults])


def check_vector(x: ArrayLike, n: int | None, call: str, name: str, *, kind: str) -> Array:
    """A one-axis array of `n` entries (any length if `n` is None), as a JAX array.

    `kind="integer"` accepts integer dtypes; `kind="real"` accepts integer and floating dtypes
    (not bool, not complex). The dtype is not converted.
    """
    shape = tuple(np.shape(x))
    dtype = jnp.result_type(x)
    want = "(n,)" if n is None else f"({n},)"
    if len(shape) != 1 or (n is not None and shape[0] != n):
        raise ValueError(
            f"`{call}`: `{name}` has shape {shape}, expected {want}: one entry per item."
        )
    integer = jnp.issubdtype(dtype, jnp.integer)
    if kind == "integer" and not integer:
        raise TypeError(f"`{call}`: `{name}` has dtype {dtype}, expected an integer dtype.")
    if kind == "real" and not (integer or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"`{call}`: `{name}` has dtype {dtype}, expected a floating or integer dtype."
        )
    return jnp.asarray(x)


def check_float_dtype(dtype: Any, call: str) -> np.dtype:
    """`dtype` as float32 or float64; float64 only when `jax_enable_x64` is on."""
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


def check_nonnegative_float(value: Any, call: str) -> float:
    """`value` as a finite non-negative Python float, else `ValueError`/`TypeError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{call}` must be a Python float, got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"`{call}` must be finite and non-negative, got {value}.")
    return value
