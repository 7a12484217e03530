"""How the global buffers run a buffer's code on every shard: `shard_map` over a mesh axis, the
small collectives its global draws need, and the placement of arguments.

Nothing here knows a buffer type: the callers pass functions of one shard.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree

from ._faults import is_concrete


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

        mapped = jax.shard_map(  # pyright: ignore[reportAttributeAccessIssue]
            body,
            mesh=self.mesh,
            in_specs=(P(self.axis), *([arg_spec] * len(args))),
            out_specs=(out_spec, P(self.axis)) if module else out_spec,
            axis_names={self.axis},
        )
        # `shard_map` takes its inputs only as `in_specs` places them: eagerly, and under
        # `jit` on a mesh of explicit axes, where the sharding is part of an array's type.
        placed = NamedSharding(self.mesh, arg_spec)
        args = tuple(jax.tree.map(lambda x: _place(x, placed), a) for a in args)
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


def compiled(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` under one `eqx.filter_jit` per method, when called outside `jit`: each of its
    `shard_map`s is then compiled once per signature, not at every eager call (a method's
    body closes over its static arguments, so eager `shard_map` would trace it afresh). Inside
    a traced function the method runs as it is."""
    jitted = eqx.filter_jit(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        leaves = jax.tree.leaves((self, args, kwargs))
        if not all(is_concrete(x) for x in leaves if eqx.is_array(x)):
            return method(self, *args, **kwargs)
        return jitted(self, *args, **kwargs)

    return call


def _place(x: Any, sharding: NamedSharding) -> Any:
    if is_concrete(x):
        return _put(x, sharding)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in getattr(sharding.mesh, "axis_types", ()):
        return jax.sharding.reshard(x, sharding)
    return x


def _put(x: Any, sharding: NamedSharding) -> Array:
    """`x` placed with `sharding`: a global array as it is if already so placed, else moved;
    a local or host value (the same in every process) as every process's part of it."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda y: y, out_shardings=sharding)(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put(jax.random.key_data(x), sharding)
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
    return _psum_bits(rows, jnp.arange(n) == me, axis)


def assemble(rows: PyTree[Array], mine: Bool[Array, " b"], axis: str) -> PyTree[Array]:
    """The rows each device owns (`mine`, one flag per row of every leaf), put together in
    every device: one all-reduce of the batch."""
    return _psum_bits(rows, mine, axis)


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _psum_bits(rows: PyTree[Array], mine: Bool[Array, " b"], axis: str) -> PyTree[Array]:
    """`psum` of the rows where `mine` (zeros elsewhere), as one all-reduce: every leaf's
    rows are turned into 32-bit words, side by side, and back. Values travel as their bits,
    so a float comes back bit for bit (-0.0 and NaN payloads included), never as a sum of
    floats; and one collective costs one round trip, where one per leaf (as XLA leaves
    collectives of different dtypes) costs one each."""
    leaves, treedef = jax.tree.flatten(rows)
    if not leaves:
        return rows
    words = [_to_words(x) for x in leaves]
    packed = jnp.concatenate(words, axis=1)
    packed = jax.lax.psum(jnp.where(mine[:, None], packed, 0), axis)
    splits = np.cumsum([w.shape[1] for w in words])[:-1]
    parts = jnp.split(packed, splits, axis=1)
    return jax.tree.unflatten(treedef, [_from_words(w, x) for w, x in zip(parts, leaves)])


def _to_words(x: Array) -> Array:
    """`x` (a leading axis of rows) as uint32 words, `(rows, words per row)`."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint64), jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize]).astype(jnp.uint32)
    return bits.reshape(x.shape[0], -1)


def _from_words(words: Array, like: Array) -> Array:
    """The inverse of `_to_words`, for an array of `like`'s shape and dtype."""
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


def locate(targets: Array, masses: Array) -> tuple[Int[Array, " b"], Array]:
    """For each target in `[0, Σ masses)`, the shard whose slice of the total holds it and the
    target's place in that shard's slice. `masses` is `(shards,)` or, per row, `(b,
    shards)`. A shard of zero mass is never chosen; a target rounded up to the total goes to
    the last shard of positive mass."""
    ends = jnp.cumsum(masses, axis=-1)
    if masses.ndim == 1:
        owner = jnp.searchsorted(ends, targets, side="right", method="compare_all")
        owner = jnp.minimum(owner, jnp.argmax(ends)).astype(jnp.int32)
        begin = (ends - masses)[owner]
        return owner, jnp.minimum(targets - begin, masses[owner])
    owner = jnp.sum(ends <= targets[:, None], axis=-1)
    owner = jnp.minimum(owner, jnp.argmax(ends, axis=-1)).astype(jnp.int32)
    rows = jnp.arange(targets.shape[0])
    begin = (ends - masses)[rows, owner]
    return owner, jnp.minimum(targets - begin, masses[rows, owner])


def float_targets(key: PRNGKeyArray, batch_size: int, total: Array, stratified: bool) -> Array:
    """What `draw_leaves` draws from one tree of mass `total`, for a total over shards (a
    scalar, or one per row)."""
    dtype = total.dtype
    uniform = jax.random.uniform(key, (batch_size,), dtype)
    if stratified:
        return (jnp.arange(batch_size, dtype=dtype) + uniform) * (total / batch_size)
    return uniform * total
