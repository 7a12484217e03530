"""Writes into storage whose `jax.vmap`s merge into one batching dimension (issue 38).

Every write of a buffer's storage at add goes through `scatter` (rows of a leaf's leading
axis), `scatter_at` (its two leading axes: a stream's `(env, slot)`) or `scatter_rows` (each
env's row at its own slots). Without `vmap` each is the `x.at[...]` scatter it replaces (a
`dynamic_update_slice` for one row), so the unvmapped program is unchanged. Under `vmap`, JAX's
batching rule gives the scatter one more batching dimension per `vmap`, and a stream's per-env
write is already one: under PureJaxRL's `jit(vmap(train))` over seeds (jax 0.5.3) that was a
scatter with two, the seeds' placed last, and XLA transposed the whole storage to that layout
and back on every step (4 `copy`/`transpose` fusions of `[3, 10, 1000, ...]` per add). Here a
`jax.custom_batching.custom_vmap` rule merges the new lanes into the leading axis instead (a
bitcast), and calls a function with the same rule, so however many `vmap`s wrap a write its
scatter has a single, leading batching dimension, which XLA partitions along a sharded lane
axis without communication. (Under one `vmap` this differs from JAX's own rule too: a replay
made inside `jit(vmap(...))` had its storage transposed around the write on jax 0.5.3, and
has not since.)

On jax 0.5.3 XLA:CPU rewrites every scatter, vmapped or not, into a `while` loop of one row per
iteration, in place; that is what the unvmapped adds have always compiled to there. See
`dejax_eqx/README.md`, "Writes under vmap", for the alternatives measured.
"""

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Int, Shaped


Op = Literal["set", "add", "min", "row"]  # "row": one row, by a scalar index
Mode = Literal["drop", "promise_in_bounds"]


def scatter(
    x: Shaped[Array, "m ..."],
    index: Int[Array, "*n"],
    values: Shaped[Array, "..."],
    op: Op = "set",
    *,
    mode: Mode = "drop",
    unique: bool = False,
) -> Shaped[Array, "m ..."]:
    """`x.at[index].<op>(values, mode=mode, unique_indices=unique)`, whose `vmap`s merge into
    one. `index` is in `[0, m]` (`m`, or any index out of range with `mode="drop"`, writes
    nothing); `values` has one row per index.

    A scalar `index` (in range) sets one row, `values` being that row: unbatched, a
    `dynamic_update_slice`, as `x.at[index].set(values)` compiles."""
    if index.ndim == 0:
        assert op == "set" and mode == "promise_in_bounds"
        op = "row"
    return _write(op, mode, unique, False)(x, (index,), values)


def scatter_at(
    x: Shaped[Array, "rows m ..."],
    rows: Int[Array, "..."],
    slots: Int[Array, "..."],
    values: Shaped[Array, "..."],
    *,
    mode: Mode = "drop",
) -> Shaped[Array, "rows m ..."]:
    """`x.at[rows, slots].set(values, mode=mode)` over the two leading axes, whose `vmap`s
    merge into one. A row out of range (`rows == x.shape[0]`) writes nothing with
    `mode="drop"`."""
    return _write("set", mode, False, False)(x, (rows, slots), values)


def scatter_rows(
    x: Shaped[Array, "rows m ..."],
    slots: Int[Array, "rows k"],
    values: Shaped[Array, "rows k ..."],
    *,
    mode: Mode = "promise_in_bounds",
) -> Shaped[Array, "rows m ..."]:
    """Row `r` of `x` takes `values[r]` at its distinct `slots[r]`: `jax.vmap` of
    `row.at[slots].set(values)` over the rows, a scatter whose row axis is a batching
    dimension (sharded along it, every device writes its own rows), and whose `vmap`s merge
    into that same dimension. The slots are in range, or with `mode="drop"` a slot of `m`
    writes nothing (and may repeat)."""
    return _write("set", mode, mode != "drop", True)(x, (slots,), values)


def _apply(
    op: Op, mode: Mode, unique: bool, x: Array, index: tuple[Array, ...], values: Array
) -> Array:
    if op == "row":
        return jax.lax.dynamic_update_index_in_dim(x, values, index[0], 0)
    (first, *more) = index
    ref = x.at[(first, *more)] if more else x.at[first]
    if op == "set":
        return ref.set(values, mode=mode, unique_indices=unique)
    if op == "add":
        return ref.add(values, mode=mode, unique_indices=unique)
    return ref.min(values, mode=mode, unique_indices=unique)


@functools.cache
def _write(op: Op, mode: Mode, unique: bool, lanes_first: bool):
    """The write `op` as a `custom_vmap` function `(x, index, values) -> x`. With
    `lanes_first`, every argument has a leading lane axis and the write is `jax.vmap` of the
    plain one over it; under `vmap` either form becomes the `lanes_first` one, its new lanes
    merged with the leading axis (a bitcast), so that however many `vmap`s wrap it (and the
    per-env `vmap` of `scatter_rows`) the scatter has one batching dimension, the leading one.
    """
    apply = functools.partial(_apply, op, mode, unique)

    @custom_vmap
    def write(x: Array, index: tuple[Array, ...], values: Array) -> Array:
        return jax.vmap(apply)(x, index, values) if lanes_first else apply(x, index, values)

    @write.def_vmap
    def rule(lanes: int, in_batched: Any, x: Array, index: tuple[Array, ...], values: Array):
        # custom_vmap puts the lanes first in every batched argument; the others get them.
        x_batched, index_batched, values_batched = in_batched

        def lead(a: Array, batched: bool) -> Array:
            return a if batched else jnp.broadcast_to(a, (lanes, *a.shape))

        x = lead(x, x_batched)
        index = tuple(lead(i, b) for i, b in zip(index, index_batched))
        values = lead(values, values_batched)
        if not lanes_first:
            return _write(op, mode, unique, True)(x, index, values), True

        def merge(a: Array) -> Array:
            return a.reshape(lanes * a.shape[1], *a.shape[2:])

        out = _write(op, mode, unique, True)(merge(x), tuple(map(merge, index)), merge(values))
        return out.reshape(x.shape), True

    return write
