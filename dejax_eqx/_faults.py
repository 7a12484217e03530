"""Data-dependent faults: the one runtime fault path of the library, apart from the static
checks of arguments (`_checks.py`).

Every fault of every buffer goes through `check_faults(x, [(condition, message), ...])`. It
raises (eagerly, or through one `eqx.branched_error_if` when traced), or, inside
`collect_faults`, hands the faults to the caller as data: what a layer needs that decides for
itself where and when a fault is raised (a global buffer raises a shard's fault in every
process; a layer that vectorises buffers checks every lane once).
"""

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, PyTree


_T = TypeVar("_T")

# A data-dependent fault: a boolean (any shape; the fault holds where any entry is True) and the
# message that reports it.
Fault = tuple[ArrayLike, str]

# Equinox reads this variable once, when it is imported; so do we (see `check_faults`).
_ON_ERROR = os.environ.get("EQX_ON_ERROR", "raise")


def is_concrete(x: Any) -> bool:
    """Whether `x` holds a value now (not a tracer inside `jit`, `vmap`, `grad`, ...)."""
    return not isinstance(x, jax.core.Tracer)


# Frames of these packages are never the user's call.
_LIBRARY_MODULES = ("dejax_eqx", "jax", "jaxlib", "equinox", "jaxtyping", "beartype")


def _call_site() -> str | None:
    """`file:line in function` of the innermost frame outside the library and JAX."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _LIBRARY_MODULES and not module.startswith(
            ("functools", "contextlib", "threading")
        ):
            code = frame.f_code
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return None


# What precedes the call site a traced fault's message ends with.
SITE = "\n  (called at "


def _sited(messages: list[str], site: str | None) -> list[str]:
    """`messages`, each ending with the call site `site` (`(called at FILE:LINE in FUNCTION)`),
    but for one that already names its site: a fault recorded inside a call and checked again
    by an enclosing one (`collect_faults`, a `shard_map` that brings faults out) keeps the one
    site it was recorded with."""
    if site is None:
        return messages
    return [m if SITE in m else f"{m}{SITE}{site})" for m in messages]


def _poison(x: Array) -> Array:
    """What `EQX_ON_ERROR=nan` makes of a faulty output `x`."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.full_like(x, jnp.nan)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.full_like(x, jnp.iinfo(x.dtype).max)
    if x.dtype == jnp.bool_:
        return jnp.ones_like(x)
    return x


# The collectors of `collect_faults`, innermost last, per thread (a service traces in its
# callers' threads).
_local = threading.local()


def _collectors() -> list[list[tuple[Bool[Array, ""], str]]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _passed(x: PyTree, token: Any, order_reads: bool) -> PyTree:
    """`x` through a conditional (or a `where`) on `token`: poisoned where it holds."""
    arrays, rest = eqx.partition(x, eqx.is_array)
    if order_reads:
        arrays = jax.lax.cond(token, lambda a: jax.tree.map(_poison, a), lambda a: a, arrays)
    else:
        arrays = jax.tree.map(lambda a: jnp.where(token, _poison(a), a), arrays)
    return eqx.combine(arrays, rest)


def recording(fn: Callable[[], _T], *, record: bool) -> tuple[_T, list[Fault] | None]:
    """`fn()` as a public call of a buffer: `(out, faults)`.

    The outermost public call decides how every fault inside it is reported, in the calls it
    makes of other buffers too (a layer's shards, a wrapper's buffer), whatever those were
    built with: raised (`record=False`, a `throw=True` buffer; `faults` is `None`), or
    recorded and returned (`record=True`, a `throw=False` buffer), with no conditional and no
    callback compiled. A call made inside another runs as that one decided (`faults` is
    `None`)."""
    if getattr(_local, "mode", None) is not None:
        return fn(), None
    _local.mode = "record" if record else "raise"
    try:
        if record:
            out, found = collect_faults(fn)
            return out, list(found)
        return fn(), None
    finally:
        _local.mode = None


@contextlib.contextmanager
def vetoing(faults: Sequence[Fault]) -> Iterator[None]:
    """Inside a recording call (`throw=False`), every write made in this block is dropped
    where one of `faults` holds (or an enclosing block's): the write primitives of the
    storage, the streams and the priorities ask `veto()`. Faults are checked before the
    writes they guard, so that a faulty call changes nothing. Elsewhere, a faulty call
    raises (or poisons, with `EQX_ON_ERROR=nan`), and this does nothing."""
    if not faults or not is_recording():
        yield
        return
    preds = [jnp.any(jnp.asarray(pred)) for pred, _ in faults]
    outer = veto()
    bad = jnp.any(jnp.stack(preds))
    _vetoes().append(bad if outer is None else outer | bad)
    try:
        yield
    finally:
        _vetoes().pop()


@contextlib.contextmanager
def carried_veto(vetoed: Bool[Array, ""] | None) -> Iterator[None]:
    """Inside a `shard_map` (or any trace of its own), the veto of the enclosing call, as the
    trace received it (`vetoed`, an argument; `None`: none), in place of the outer one (a
    tracer of the outer trace)."""
    saved = _vetoes()[:]
    _vetoes()[:] = [] if vetoed is None else [vetoed]
    try:
        yield
    finally:
        _vetoes()[:] = saved


def veto() -> Bool[Array, ""] | None:
    """Whether the writes made now must be dropped (see `vetoing`), or `None` where
    nothing can drop them."""
    stack = _vetoes()
    return stack[-1] if stack else None


def _vetoes() -> list[Bool[Array, ""]]:
    if not hasattr(_local, "vetoes"):
        _local.vetoes = []
    return _local.vetoes


def is_recording() -> bool:
    """Whether faults are being recorded: inside a public call of a `throw=False` buffer."""
    return getattr(_local, "mode", None) == "record"


def check_faults(
    x: PyTree, faults: Sequence[Fault], *, order_reads: bool = True, safe: PyTree = None
) -> PyTree:
    """Return `x`, after raising the message of the first fault that holds.

    The one runtime check of the library: every data-dependent fault of every buffer goes
    through here, each as `(condition, message)`. A message starts with the call it is about.

    - Eagerly (the conditions are concrete), the conditions are read at once and
        `equinox.EquinoxRuntimeError` is raised from the caller's own line: its traceback
        is the user's call, nothing else.
    - Traced (`jit`, `vmap`, `scan`, `shard_map`), one `eqx.branched_error_if` holds them all:
        one conditional in the compiled program however many faults there are. Under `vmap`
        a fault in any lane raises, with the message of a faulty lane.
        The check guards a token, which then passes `x` through a conditional: unlike
        guarding `x` itself, this passes `shard_map`'s check of varying manual axes (the
        error branch's callback output is never varying). Each message gains the line of
        the user's code that called the library, `(called at FILE:LINE in FUNCTION)`.
    - Inside `collect_faults`, nothing raises: the faults are recorded for the caller, and
        `x` still passes through the conditional (which orders the reads, see below).

    `x` must be what the operation's result is built from, so that the check cannot be
    removed as dead code: small outputs (a sampled batch, counters, the indices a scatter
    writes), never a whole storage array, which a conditional could copy.

    `order_reads=False` is for a result that is handed to the caller and that no write of the
    operation reads (a sampled batch): it then passes through a `where` on the token, which
    fuses into the batch's own gather, rather than through the conditional, whose result
    is a copy of the batch (23.82 µs per 256 sampled items of 131 floats from a 1M replay on
    CPU). Inputs to a write keep the conditional (see below).

    `EQX_ON_ERROR` is honoured: `nan` poisons `x` (NaN for floats, the largest value for
    integers, `True` for bools) where a fault holds, `off` skips the checks.

    - Inside a public call of a `throw=False` buffer (`recording`), nothing is compiled
        but the faults' conditions: they are recorded for the call's result, and `x` is
        returned as it is, or, where a fault holds, as `safe` (a pytree like `x`): what a
        write uses so that a faulty call changes nothing (its slots out of range, its
        counters as they were). `EQX_ON_ERROR` does not apply.
    """
    if not faults:
        return x
    if is_recording():
        preds = [jnp.any(jnp.asarray(pred)) for pred, _ in faults]
        messages = [msg for _, msg in faults]
        # Which call it was, as a raised fault says it.
        messages = _sited(messages, None if all(is_concrete(p) for p in preds) else _call_site())
        _collectors()[-1].extend(zip(preds, messages))
        if safe is None:
            return x
        bad = jnp.any(jnp.stack(preds))
        outer = veto()
        bad = bad if outer is None else bad | outer
        return jax.tree.map(lambda s, a: jnp.where(bad, s, a), safe, x)
    if _ON_ERROR == "off":
        return x
    preds = [jnp.any(jnp.asarray(pred)) for pred, _ in faults]
    messages = [msg for _, msg in faults]
    concrete = all(is_concrete(p) for p in preds)
    collectors = _collectors()
    if collectors:
        collectors[-1].extend(zip(preds, messages))
        if concrete:
            return x
        # No error branch: the caller raises. The conditional still orders the reads that
        # feed `x` before the writes that use it, as below.
        return _passed(x, jnp.any(jnp.stack(preds)), order_reads)
    if concrete and _ON_ERROR == "raise":
        for pred, msg in zip(preds, messages):
            if bool(pred):
                raise eqx.EquinoxRuntimeError(msg)
        return x
    # The caller's line goes into the messages: under plain `jax.jit` it is the only pointer to
    # the failing call inside the user's function. It also keys Equinox's cache of traced checks
    # by call site, whose "stack inside JIT" would otherwise be that of the first call with the
    # same messages and shapes.
    messages = _sited(messages, _call_site())
    pred = jnp.stack(preds)
    # argmax of booleans: the first fault that holds, and 0 (the smallest, which loses to any
    # faulty lane under vmap's maximum) where none does. With one fault the index is a Python
    # int: under vmap over a sharded batch a traced one costs a second cross-device reduction.
    index = jnp.argmax(pred) if len(preds) > 1 else 0
    token = eqx.branched_error_if(jnp.zeros((), jnp.bool_), jnp.any(pred), index, messages)
    # A conditional, not a `where`: its operands are computed before it and its result after,
    # which orders the reads of a buffer that feed `x` before the writes that use `x` (with a
    # `where` fused into a scatter, XLA copies the buffer instead of updating it in place).
    return _passed(x, token, order_reads)


def collect_faults(fn: Callable[[], _T]) -> tuple[_T, list[tuple[Bool[Array, ""], str]]]:
    """`fn()`, with the faults its checks would raise recorded instead: `(result, faults)`,
    each fault a boolean scalar (concrete or traced) and its message, in the order they were
    checked. Nothing raises for a fault inside `fn` (static checks still do).

    The result is what `fn` returns with every fault unchecked: the caller must check the
    faults itself (`check_faults`), on something the result is built from. Faults checked
    under a `vmap` inside `fn` must be brought out of it by `vmap_checked`."""
    found: list[tuple[Bool[Array, ""], str]] = []
    collectors = _collectors()
    collectors.append(found)
    try:
        out = fn()
    finally:
        collectors.pop()
    return out, found


def vmap_checked(fn: Callable[..., _T], *args: Any) -> tuple[_T, list[Fault]]:
    """`eqx.filter_vmap(fn)(*args)` and the faults of every lane, brought out of the `vmap`
    (each condition with a leading axis of lanes): for the caller to check once, with
    `check_faults` or `guarded`, on what the result is built from."""
    messages: list[str] = []

    def lane(*a: Any) -> tuple[Any, list[Array]]:
        out, found = collect_faults(lambda: fn(*a))
        messages[:] = [message for _, message in found]
        return out, [pred for pred, _ in found]

    out, preds = eqx.filter_vmap(lane)(*args)
    return out, list(zip(preds, messages))


def guarded(module: _T, faults: Sequence[Fault]) -> _T:
    """`module` (a buffer) with `faults` checked on its smallest array: for a layer that has
    made a new buffer and checks its faults after the fact. A small array keeps the check
    alive without a copy of the storage; the buffer's own operations have ordered their
    reads already."""
    if not faults or (_ON_ERROR == "off" and not is_recording()):
        return module
    arrays = [x for x in jax.tree.leaves(module) if eqx.is_array(x)]
    smallest = min(range(len(arrays)), key=lambda i: arrays[i].size)
    checked = check_faults(arrays[smallest], faults)
    leaves, treedef = jax.tree.flatten(module)
    k = -1
    for i, leaf in enumerate(leaves):
        if eqx.is_array(leaf):
            k += 1
            if k == smallest:
                leaves[i] = checked
                break
    return jax.tree.unflatten(treedef, leaves)
