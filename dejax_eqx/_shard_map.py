"""How the global buffers run a buffer's code on every shard: `shard_map` over a mesh axis, the
small collectives its global draws need, and the placement of arguments.

Nothing here knows a buffer type: the callers pass functions of one shard.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, PyTree

from ._faults import (
    carried_veto,
    check_faults,
    collect_faults,
    Fault,
    is_concrete,
    is_recording,
    veto,
)


class Layout(NamedTuple):
    """The mesh and the mesh axis that a stack of shards is split over."""

    mesh: Mesh
    axis: str

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axis))

    def map(
        self,
        shards: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        out_spec: Any,
        *,
        arg_spec: Any = P(),
        module: bool = False,
    ) -> Any:
        """`fn(shard, *args)` inside `shard_map`, each device with its own shard (a module of
        the shards' type). With `module`, `fn` returns `(out, shard)` and so does this, the
        new shards stacked and split over the axis; `out_spec` is that of `out`."""
        dynamic, static = eqx.partition(shards, eqx.is_array)
        new_static: list[Any] = []

        def body(dynamic, *args):
            out = fn(jax.tree.map(lambda x: x[0], eqx.combine(dynamic, static)), *args)
            if not module:
                return out
            out, shard = out
            shard_dynamic, shard_static = eqx.partition(shard, eqx.is_array)
            new_static.append(shard_static)
            return out, jax.tree.map(lambda x: x[None], shard_dynamic)

        mapped = shard_mapped(
            body,
            self.mesh,
            self.axis,
            (P(self.axis), *([arg_spec] * len(args))),
            (out_spec, P(self.axis)) if module else out_spec,
        )
        # `shard_map` takes its inputs only as `in_specs` places them: eagerly, and under
        # `jit` on a mesh of explicit axes, where the sharding is part of an array's type.
        placed = NamedSharding(self.mesh, arg_spec)
        args = tuple(jax.tree.map(lambda x: place(x, placed), a) for a in args)
        out = mapped(dynamic, *args)
        if not module:
            return out
        out, shard_dynamic = out
        return out, eqx.combine(shard_dynamic, new_static[0])

    def update(self, shards: Any, fn: Callable[..., Any], *args: Any, sharded: bool) -> Any:
        """The shards after `fn(shard, *args) -> shard` on every one; `args` split over the
        shards in equal blocks (`sharded`) or replicated."""
        spec = P(self.axis) if sharded else P()
        wrapped = lambda *a: (None, fn(*a))  # noqa: E731
        return self.map(shards, wrapped, args, P(), arg_spec=spec, module=True)[1]


def shard_mapped(
    body: Callable[..., Any], mesh: Mesh, axis: str, in_specs: tuple, out_specs: Any
) -> Callable[..., Any]:
    """`jax.shard_map(body)` over `axis`. Inside a recording call (a `throw=False` buffer's),
    the faults `body` records are brought out of the `shard_map`, held in every device if
    they hold in any (one all-reduce of a word per fault), and recorded for the call; a veto
    of the call's writes (`_faults.vetoing`) is carried in."""
    if not is_recording():
        return jax.shard_map(  # pyright: ignore[reportAttributeAccessIssue]
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis}
        )
    messages: list[str] = []
    outer = veto()
    vetoes = () if outer is None else (place(outer, NamedSharding(mesh, P())),)

    def recorded(vetoes, *args):
        with carried_veto(vetoes[0] if vetoes else None):
            out, found = collect_faults(lambda: body(*args))
        found = replicated_faults(found, axis)
        messages[:] = [message for _, message in found]
        return out, [pred for pred, _ in found]

    mapped = jax.shard_map(  # pyright: ignore[reportAttributeAccessIssue]
        recorded,
        mesh=mesh,
        in_specs=(P(), *in_specs),
        out_specs=(out_specs, P()),
        axis_names={axis},
    )

    def call(*args):
        out, preds = mapped(vetoes, *args)
        check_faults((), list(zip(preds, messages)))  # recorded for the call
        return out

    return call


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, compiled once per signature (one `eqx.filter_jit` per function) when
    called with concrete arguments, and as it is inside a trace. `fn` is a function of module
    level whose arguments are arrays and static values: an eager `shard_map` of a closure
    would be traced afresh at every call."""
    if all(is_concrete(x) for x in jax.tree.leaves(args) if eqx.is_array(x)):
        return _jitted(fn)(*args)
    return fn(*args)


@functools.cache
def _jitted(fn: Callable[..., Any]) -> Callable[..., Any]:
    return eqx.filter_jit(fn)


def place(x: Any, sharding: NamedSharding) -> Any:
    if is_concrete(x):
        return put(x, sharding)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in getattr(sharding.mesh, "axis_types", ()):
        return jax.sharding.reshard(x, sharding)
    return x


def put(x: Any, sharding: NamedSharding) -> Array:
    """`x` placed with `sharding`: a global array as it is if already so placed, else moved;
    a local or host value (the same in every process) as every process's part of it."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda y: y, out_shardings=sharding)(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def per_shard(values: PyTree[Array], axis: str, n: int) -> PyTree[Array]:
    """Every shard's `values` (a pytree of arrays), each leaf stacked in shard order, in
    every device: one all-reduce, of `n` rows (each device writes its own row, zeros
    elsewhere, so the sum is exact)."""
    me = jax.lax.axis_index(axis)
    values = jax.tree.map(jnp.asarray, values)
    rows = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype).at[me].set(x), values)
    return psum_words(rows, axis)


def assemble(rows: PyTree[Array], mine: Bool[Array, " b"], axis: str) -> PyTree[Array]:
    """The rows each device owns (`mine`, one flag per row of every leaf), put together in
    every device: one all-reduce of the batch, laid out as `(rows, words per row)`."""
    return psum_words(_owned(rows, mine), axis, rows=mine.shape[0])


def assemble_with_faults(
    rows: PyTree[Array], mine: Bool[Array, " b"], faults: Sequence[Fault], axis: str
) -> tuple[PyTree[Array], list[Fault]]:
    """`assemble` of the rows, and the faults each device found for its own rows, held in
    every device if they hold in any: one all-reduce for both."""
    preds = jnp.stack([jnp.any(p) for p, _ in faults]) if faults else jnp.zeros(0, jnp.bool_)
    rows, counts = psum_words((_owned(rows, mine), preds.astype(jnp.uint32)), axis)
    return rows, [(counts[i] > 0, message) for i, (_, message) in enumerate(faults)]


def replicated_faults(faults: Sequence[Fault], axis: str) -> list[Fault]:
    """The faults each device found, held in every device if they hold in any: one
    all-reduce of a word per fault (none without faults)."""
    return assemble_with_faults((), jnp.zeros(0, jnp.bool_), faults, axis)[1]


def _owned(rows: PyTree[Array], mine: Bool[Array, " b"]) -> PyTree[Array]:
    """The rows where `mine`, zeros elsewhere."""

    def keep(x: Array) -> Array:
        return jnp.where(mine.reshape(mine.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))

    return jax.tree.map(keep, rows)


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def psum_words(tree: PyTree[Array], axis: str, *, rows: int | None = None) -> PyTree[Array]:
    """`psum` of every leaf of `tree` over `axis`, as one all-reduce: every leaf is turned
    into 32-bit words, side by side, and back. Values travel as their bits, so where only one
    device contributes a non-zero value (an assembled row), it comes back bit for bit
    (-0.0 and NaN payloads included), never as a sum of floats; and one collective costs one
    round trip, where one per leaf (as XLA leaves collectives of different dtypes) costs one
    each. A bool leaf comes back as the count of devices where it holds (uint32).

    With `rows`, every leaf has that many rows (its leading axis), and the words are laid
    out as `(rows, words per row)`, each leaf's in columns of their own. A batch is gathered
    so: packed into one flat vector, XLA's CPU fusion reads every leaf's rows in one fusion
    and computes the rows' indices again for every word (measured: a one-process sample of
    256 rows of 129 words twice as slow); in columns, each leaf's gather stays a fusion of its
    own and reads indices computed once."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    per_row = -1 if rows is None else (rows, -1)
    words = [_to_words(x).reshape(per_row) for x in leaves]
    along = 0 if rows is None else 1
    packed = jax.lax.psum(jnp.concatenate(words, axis=along), axis)
    splits = np.cumsum([w.shape[along] for w in words])[:-1]
    parts = jnp.split(packed, splits, axis=along)
    return jax.tree.unflatten(treedef, [_from_words(w, x) for w, x in zip(parts, leaves)])


def _to_words(x: Array) -> Array:
    """`x` as a flat vector of uint32 words."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint64), jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize]).astype(jnp.uint32)
    return bits.reshape(-1)


def _from_words(words: Array, like: Array) -> Array:
    """The inverse of `_to_words`, for an array of `like`'s shape and dtype (a bool as its
    count, uint32)."""
    dtype, shape = like.dtype, like.shape
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.zeros((*shape, 2), jnp.real(like).dtype)
        pair = _from_words(words, part)
        return jax.lax.complex(pair[..., 0], pair[..., 1]).astype(dtype)
    if dtype == jnp.bool_:
        return words.reshape(shape) != 0
    if dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(words.reshape(*shape, 2), jnp.uint64)
    else:
        bits = words.reshape(shape).astype(_BITS[dtype.itemsize])
    return jax.lax.bitcast_convert_type(bits, dtype)
