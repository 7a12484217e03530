"""One registry of every buffer type, for the tests that cut across them.

Each `BufferType` says how to make a small empty instance (also the template for `dx.load`),
how to put a few items in it, and every public method and array-valued property with example
arguments. The cross-cutting tests (`test_transforms.py`: jit, donation, scan, vmap;
`test_sharding.py`: `shard_map`; `test_io.py`: save/load) are parametrised over it, so covering a
new buffer type, or a new method, is adding an entry here; `test_registry_covers_the_public_api`
fails until it is.

A `Method` is `call(buffer, args) -> (new_buffer | None, output | None)`: `args` is a pytree
of arrays (items, keys, indices) and everything static (batch sizes, sources) is baked into
`call`, so the same call runs eagerly, under `jit`, `vmap` (a batch of buffers, one `args` row
each) and `shard_map` (one buffer per device). `args(seed)` makes one buffer's arguments.

Shapes are few and fixed (one item spec, capacity 4, batches of 3), so each `call` compiles
once per transformation and the compiled functions are shared by every test that uses them.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .helpers import bump, random_bits_batch


# The item of every registry instance: a float vector (NaN payloads survive bit for bit), an
# int scalar, and the reward and episode-end leaves that `TrajectoryBuffer`'s windows and
# n-step transitions read (rewards are finite: they are summed).
ITEM = {
    "obs": jax.ShapeDtypeStruct((3,), jnp.float32),
    "act": jax.ShapeDtypeStruct((), jnp.int8),
    "rew": jax.ShapeDtypeStruct((), jnp.float32),
    "done": jax.ShapeDtypeStruct((), jnp.bool_),
}
CAPACITY = 4
BATCH = 3  # items per add_batch, and rows per sample
NUM_ENVS = 3  # TrajectoryBuffer
SEQUENCE = 2  # TrajectoryBuffer: sequence length


class Method(NamedTuple):
    call: Callable[[Any, Any], tuple[Any, Any]]  # (buffer, args) -> (new buffer | None, output)
    args: Callable[[int], Any]  # seed -> one buffer's arguments (a pytree of arrays)
    mutates: bool  # returns a new buffer (which the donation tests donate)


class BufferType(NamedTuple):
    name: str
    cls: type
    make: Callable[[Any, int], Any]  # (item spec, capacity) -> empty buffer
    fill: Method  # puts a few items in an empty buffer (sampling needs some)
    methods: dict[str, Method]  # every public method and array-valued property
    # Public methods and properties that are not in `methods`, and why.
    others: dict[str, str]
    # One random operation that changes the contents, for the save/load round trips:
    # (buffer, item spec, rng) -> buffer. Eager calls of module-level jitted functions.
    step: Callable[[Any, Any, np.random.Generator], Any]


def _new(call, args) -> Method:
    """A method that returns a new buffer (and possibly an output)."""
    return Method(call, args, True)


def _key(seed: int):
    return jax.random.key(seed)


def _items(seed: int, n: int = BATCH, spec=ITEM):
    rng = np.random.default_rng(seed)
    items = random_bits_batch(spec, n, rng)
    if "rew" in items:
        items = {**items, "rew": rng.standard_normal(n).astype(np.float32)}
    return items


def _item(seed: int):
    return jax.tree.map(lambda x: x[0], _items(seed, 1))


def _mask(seed: int, n: int = BATCH):
    mask = np.random.default_rng(seed).random(n) < 0.5
    mask[0] = True  # at least one item goes in
    return mask


def _priorities(seed: int, n: int = BATCH):
    rng = np.random.default_rng(seed)
    return (rng.random(n) * 4.0 + 0.25).astype(np.float32)


def _indices(seed: int, n: int = BATCH, high: int = BATCH):
    # Stored slots of a filled instance (fill adds BATCH items): always in range.
    return np.random.default_rng(seed).integers(0, high, n).astype(np.int32)


def _generations(seed: int, n: int = BATCH):
    return np.random.default_rng(seed).integers(0, 3, n).astype(np.uint32)


def _none(seed: int):
    return ()


def _query(fn, args) -> Method:
    """A method or property that reads the buffer and returns arrays."""
    return Method(lambda b, a: (None, fn(b, a)), args, False)


def policy_version(item):
    """A policy version in [0, 7] read from any registry item (its `act` leaf): a module-level
    function, so that `dx.PolicyAge` traces once."""
    return item["act"].astype(jnp.int32) & 7


def _age(current):
    return dx.PolicyAge(policy_version, current, decay="inverse")


def _key_and_version(seed: int):
    return _key(seed), np.int32(7)


# ---------------------------------------------------------------------------------------------
# CircularBuffer


_circular_fill = _new(lambda b, a: (b.push_batch(a), None), _items)

_CIRCULAR = {
    "push": _new(lambda b, a: (b.push(a), None), _item),
    "push_batch": _new(lambda b, a: (b.push_batch(a), None), _items),
    "push_batch(mask)": _new(
        lambda b, a: (b.push_batch(a[0], mask=a[1]), None),
        lambda s: (_items(s), _mask(s)),
    ),
    "pop": _new(lambda b, a: (lambda item, new: (new, item))(*b.pop()), _none),
    "get": _query(lambda b, a: b.get(a), lambda s: np.int32(s % BATCH)),
    "update": _new(lambda b, a: (b.update(bump), None), _none),
    "size": _query(lambda b, a: b.size, _none),
    "is_empty": _query(lambda b, a: b.is_empty, _none),
    "is_full": _query(lambda b, a: b.is_full, _none),
}


# ---------------------------------------------------------------------------------------------
# The replays: what every AbstractReplay has, then each one's own methods.


def _replay_methods() -> dict[str, Method]:
    return {
        "add": _new(lambda b, a: (b.add(a), None), _item),
        "add_batch": _new(lambda b, a: (b.add_batch(a), None), _items),
        "add_batch(mask)": _new(
            lambda b, a: (b.add_batch(a[0], mask=a[1]), None),
            lambda s: (_items(s), _mask(s)),
        ),
        "sample": _query(lambda b, a: b.sample(a, BATCH), _key),
        "sample_unchecked": _query(lambda b, a: b.sample_unchecked(a, BATCH), _key),
        "add_and_sample": _new(
            lambda b, a: b.add_and_sample(a[0], a[1], BATCH),
            lambda s: (_items(s), _key(s)),
        ),
        "update": _new(lambda b, a: (b.update(bump), None), _none),
        "size": _query(lambda b, a: b.size, _none),
    }


_replay_fill = _new(lambda b, a: (b.add_batch(a), None), _items)

_UNIFORM = {
    **_replay_methods(),
    "sample(age)": _query(lambda b, a: b.sample(a[0], BATCH, age=_age(a[1])), _key_and_version),
}

_PRIORITISED = {
    **_replay_methods(),
    "add(priority)": _new(
        lambda b, a: (b.add(a[0], a[1]), None),
        lambda s: (_item(s), _priorities(s, 1)[0]),
    ),
    "add_batch(priorities, mask)": _new(
        lambda b, a: (b.add_batch(a[0], a[1], mask=a[2]), None),
        lambda s: (_items(s), _priorities(s), _mask(s)),
    ),
    "set_priorities": _new(
        lambda b, a: (b.set_priorities(a[0], a[1]), None),
        lambda s: (_indices(s), _priorities(s)),
    ),
    "set_priorities(mask)": _new(
        lambda b, a: (b.set_priorities(a[0], a[1], mask=a[2]), None),
        lambda s: (_indices(s), _priorities(s), _mask(s)),
    ),
    # After the fill every stored slot has generation 1: some current, some not.
    "set_priorities(generations)": _new(
        lambda b, a: (b.set_priorities(a[0], a[1], generations=a[2]), None),
        lambda s: (_indices(s), _priorities(s), _generations(s)),
    ),
    "stale": _query(lambda b, a: b.stale(a[0], a[1]), lambda s: (_indices(s), _generations(s))),
    "max_priority": _query(lambda b, a: b.max_priority, _none),
    "tree": _query(lambda b, a: b.tree, _none),
    "sample(age, beta)": _query(
        lambda b, a: b.sample(a[0], BATCH, age=_age(a[1]), beta=0.5), _key_and_version
    ),
    "note_priorities": _new(
        lambda b, a: (b.note_priorities(a[0], a[1]), None),
        lambda s: (_indices(s), _priorities(s)),
    ),
    "stale(mask)": _query(
        lambda b, a: b.stale(a[0], a[1], mask=a[2]),
        lambda s: (_indices(s), _generations(s), _mask(s)),
    ),
    # The free function that goes with a prioritised sample.
    "importance_weights": _query(
        lambda b, a: dx.importance_weights(b.sample(a, BATCH).probabilities, b.size, 0.4),
        _key,
    ),
}


def cluster_of(item):
    """0, 1 or 2 from the first entry of the first leaf (zero, positive, negative or NaN):
    works for any item spec, and one module-level function, so compiled steps are reused."""
    x = jnp.ravel(jax.tree.leaves(item)[0])[0].astype(jnp.float32)
    return jnp.where(x > 0, 1, jnp.where(x == 0, 0, 2)).astype(jnp.int32)


NUM_CLUSTERS = 3


def _clustered_uniform(spec, capacity):
    return dx.ClusteredReplay(dx.UniformReplay(spec, capacity), NUM_CLUSTERS, cluster_of, 0.5)


def _clustered_prioritised(spec, capacity):
    inner = dx.PrioritisedReplay(spec, capacity)
    return dx.ClusteredReplay(inner, NUM_CLUSTERS, cluster_of, 0.5)


_CLUSTERED = {
    **_replay_methods(),
    "cluster_sizes": _query(lambda b, a: b.cluster_sizes, _none),
    "sample(age)": _query(lambda b, a: b.sample(a[0], BATCH, age=_age(a[1])), _key_and_version),
}


def _cluster_ids(seed: int):
    return np.random.default_rng(seed).integers(0, NUM_CLUSTERS, BATCH).astype(np.int32)


def _clustered_set_priorities(b, a):
    # Slot 0 of any cluster that holds an item; the others are masked out by pointing them at
    # a cluster's slot 0 only where it is stored.
    ids, priorities = a
    return b.set_priorities((ids, jnp.zeros_like(ids)), priorities)


_CLUSTERED_PRIORITISED = {
    **_CLUSTERED,
    "set_priorities": _new(
        lambda b, a: (_clustered_set_priorities(b, a), None),
        lambda s: (np.zeros(BATCH, np.int32) + s % 2, _priorities(s)),
    ),
    "set_priorities(generations)": _new(
        lambda b, a: (
            b.set_priorities((a[0], jnp.zeros_like(a[0])), a[1], generations=a[2]),
            None,
        ),
        lambda s: (np.zeros(BATCH, np.int32) + s % 2, _priorities(s), _generations(s)),
    ),
    "note_priorities": _new(
        lambda b, a: (b.note_priorities((a[0], jnp.zeros_like(a[0])), a[1]), None),
        lambda s: (np.zeros(BATCH, np.int32) + s % 2, _priorities(s)),
    ),
}


# A fill that puts an item in every cluster (first entries of the first leaf zero, positive,
# negative), so that `set_priorities` of slot 0 of clusters 0 and 1 is in range.
def _clustered_fill_args(seed: int):
    leaves, treedef = jax.tree.flatten(_items(seed))
    first = leaves[0].copy()
    first.reshape(BATCH, -1)[:, 0] = np.asarray([0, 1, -1], first.dtype)
    return jax.tree.unflatten(treedef, [first, *leaves[1:]])


_clustered_fill = _new(_replay_fill.call, _clustered_fill_args)


# ---------------------------------------------------------------------------------------------
# SumTree: no items; leaves are set by index.


def _tree_values(seed: int):
    return _priorities(seed, BATCH)


_sum_tree_fill = _new(lambda b, a: (b.set(jnp.arange(BATCH), a), None), _tree_values)

_SUM_TREE = {
    "set": _new(
        lambda b, a: (b.set(a[0], a[1]), None),
        lambda s: (_indices(s, high=CAPACITY), _tree_values(s)),
    ),
    "set(mask)": _new(
        lambda b, a: (b.set(a[0], a[1], mask=a[2]), None),
        lambda s: (_indices(s, high=CAPACITY), _tree_values(s), _mask(s)),
    ),
    "get": _query(lambda b, a: b.get(a), lambda s: _indices(s, high=CAPACITY)),
    "find": _query(
        lambda b, a: b.find(a * b.total),
        lambda s: np.random.default_rng(s).random(BATCH).astype(np.float32),
    ),
    "total": _query(lambda b, a: b.total, _none),
    "leaves": _query(lambda b, a: b.leaves, _none),
}


# ---------------------------------------------------------------------------------------------
# TrajectoryBuffer: one step per listed env.


def _env_steps(seed: int, ids):
    return _items(seed, len(ids)), np.asarray(ids, np.int32)


def _env_sequences(seed: int, ids, length: int = 2):
    """`length` steps for each of the envs `ids`: leaves `[len(ids), length, ...]`."""
    items = _items(seed, len(ids) * length)
    return (
        {k: v.reshape(len(ids), length, *v.shape[1:]) for k, v in items.items()},
        np.asarray(ids, np.int32),
    )


def _trajectory_fill_call(b, a):
    first, second = a
    return b.add(first).add(second[0], env_ids=second[1]), None


_trajectory_fill = _new(
    (_trajectory_fill_call),
    lambda s: (_items(s, NUM_ENVS), _env_steps(s + 1, [2, 0])),
)

# One module-level window per compiled sampler (a window is static: each new one compiles).
_SEQUENCE = dx.Window(SEQUENCE)
_WINDOWS = dx.Window(1, burn_in=1, bootstrap=1, period=2, episode_ends="within", done="done")
_NSTEP = dx.NStep(1, reward="rew", terminated="done")


# After the fill, envs 0 and 2 hold steps 0 and 1, env 1 step 0: stamps of stored steps.
def _stored_stamps(seed: int):
    return np.asarray([0, 2, 1], np.int32), np.asarray([seed % 2, 1, 0], np.int32)


def _streams_methods(add: str) -> dict[str, Method]:
    """What every trajectory buffer has (`AbstractTrajectoryBuffer`), with `add` the name of
    the one-step append (`append` for `Streams`)."""
    return {
        add: _new(
            lambda b, a: (getattr(b, add)(a[0], env_ids=a[1]), None),
            lambda s: _env_steps(s, [(s + 1) % NUM_ENVS, s % NUM_ENVS]),
        ),
        f"{add}(all envs)": _new(
            lambda b, a: (getattr(b, add)(a), None), lambda s: _items(s, NUM_ENVS)
        ),
        "extend": _new(
            lambda b, a: (b.extend(a[0], env_ids=a[1]), None),
            lambda s: _env_sequences(s, [(s + 1) % NUM_ENVS, s % NUM_ENVS]),
        ),
        "stale": _query(lambda b, a: b.stale(a[0], a[1]), _stored_stamps),
        "head": _query(lambda b, a: b.head, _none),
    }


def _abstract_trajectory_methods() -> dict[str, Method]:
    return {
        **_streams_methods("add"),
        "peek": _query(
            lambda b, a: b.peek(a),
            lambda s: np.asarray([s % NUM_ENVS, 0], np.int32),
        ),
        "peek(all envs)": _query(lambda b, a: b.peek(), _none),
        "peek(mask)": _query(
            lambda b, a: b.peek(a, mask=a > 0),
            lambda s: np.asarray([s % NUM_ENVS, 0], np.int32),
        ),
        "stale(mask)": _query(lambda b, a: b.stale(a[0], a[1], mask=a[0] != 1), _stored_stamps),
        "data": _query(lambda b, a: b.data, _none),
        "step_count": _query(lambda b, a: b.step_count, _none),
        # A query: the buffer it makes has lost its online queue, unread steps or priorities,
        # which the methods after it use.
        "with_streams": _query(lambda b, a: b.with_streams(b.streams), _none),
    }


def _written_back(seed: int):
    """Env ids and one `rew` value each, written back at each env's newest step."""
    ids = np.asarray([seed % NUM_ENVS, 0], np.int32)
    return ids, np.random.default_rng(seed).random((2, 1)).astype(np.float32)


_WRITE_BACK = _new(
    lambda b, a: b.write_back(a[0], b.step_count[a[0]] - 1, {"rew": a[1]}), _written_back
)

_TRAJECTORY = {
    **_abstract_trajectory_methods(),
    "write_back": _WRITE_BACK,
    "sample": _query(
        lambda b, a: b.sample(a[0], BATCH, _SEQUENCE, distribution_power=a[1]),
        lambda s: (_key(s), np.float32(1.5)),
    ),
    "sample(online)": _query(lambda b, a: b.sample(a, BATCH, _SEQUENCE, source="online"), _key),
    "sample(source mapping)": _query(
        lambda b, a: b.sample(a, BATCH, _SEQUENCE, source={"replay": 2, "online": 1}), _key
    ),
    "sample(windows)": _query(lambda b, a: b.sample(a, BATCH, _WINDOWS), _key),
    "sample(nstep)": _query(
        lambda b, a: b.sample(a[0], BATCH, _NSTEP, discount=a[1]),
        lambda s: (_key(s), np.float32(0.9)),
    ),
    "sample(age)": _query(
        lambda b, a: b.sample(a[0], BATCH, _SEQUENCE, age=_age(a[1])), _key_and_version
    ),
    "sample(nstep, age)": _query(
        lambda b, a: b.sample(a[0], BATCH, _NSTEP, discount=0.9, age=_age(a[1])),
        _key_and_version,
    ),
    # The windows from each env's newest step (older ones may be stale after a few steps).
    "read": _query(
        lambda b, a: b.read(a, b.step_count[a] - 1, _WINDOWS),
        lambda s: np.asarray([s % NUM_ENVS, 0], np.int32),
    ),
    "read(mask)": _query(
        lambda b, a: b.read(a, b.step_count[a] - 1, _WINDOWS, mask=a == 0),
        lambda s: np.asarray([s % NUM_ENVS, 0], np.int32),
    ),
    "replay_length": _query(lambda b, a: b.replay_length, _none),
    "lengths": _query(lambda b, a: b.lengths(), _none),
    "lengths(online)": _query(lambda b, a: b.lengths("online"), _none),
    "reset_online_queue": _new(lambda b, a: (b.reset_online_queue(), None), _none),
}


def _trajectory(spec, capacity):
    return dx.TrajectoryBuffer(spec, NUM_ENVS, capacity)


# PrioritisedTrajectoryBuffer: windows of 2 steps on a period of 2. After the fill, envs 0 and
# 2 hold steps 0 and 1 (one window each, starting at 0), env 1 step 0.
def _prioritised_trajectory(spec, capacity):
    # Any capacity (the save/load tests try several): the period divides it.
    period = 2 if capacity % 2 == 0 else 1
    window = dx.Window(1, burn_in=min(1, capacity - 1), period=period, strict=True)
    return dx.PrioritisedTrajectoryBuffer(spec, NUM_ENVS, capacity, window)


def _window_stamps(seed: int):
    return np.asarray([0, 2, 0], np.int32), np.zeros(BATCH, np.int32)


_PRIORITISED_TRAJECTORY = {
    **_abstract_trajectory_methods(),
    "write_back": _WRITE_BACK,
    "sample": _query(
        lambda b, a: b.sample(a[0], BATCH, beta=a[1]), lambda s: (_key(s), np.float32(0.5))
    ),
    "set_priorities": _new(
        lambda b, a: (b.set_priorities(a[0], a[1], a[2]), None),
        lambda s: (*_window_stamps(s), _priorities(s)),
    ),
    "stale(windows)": _query(lambda b, a: b.stale(*a), _window_stamps),
    "num_windows": _query(lambda b, a: b.num_windows, _none),
    "stamp_of": _query(lambda b, a: b.stamp_of(a), lambda s: np.asarray([s % 6, 0, 5], np.int32)),
    "window_priorities": _query(lambda b, a: b.window_priorities(), _none),
    "with_window_priorities": _new(
        lambda b, a: (b.with_window_priorities(a[:, : b.leaves_per_env]), None),
        lambda s: np.random.default_rng(s).random((NUM_ENVS, 8)).astype(np.float32),
    ),
    "note_priorities": _new(
        lambda b, a: (b.note_priorities(a[0], a[1], a[2]), None),
        lambda s: (*_window_stamps(s), _priorities(s)),
    ),
    "tree": _query(lambda b, a: b.tree, _none),
    "max_priority": _query(lambda b, a: b.max_priority, _none),
    "sample(age, beta)": _query(
        lambda b, a: b.sample(a[0], BATCH, age=_age(a[1]), beta=0.5), _key_and_version
    ),
}


# TrajectoryQueue: after the fill, envs 0 and 2 hold 2 unread steps, env 1 one, so `pop` takes
# one. A training step adds more than it pops (the tests run three steps from the fill, up to
# 9 unread steps in an env), so the queue holds three times the capacity.
_QUEUE = {
    **_abstract_trajectory_methods(),
    "can_add": _query(lambda b, a: b.can_add(2), _none),
    "can_pop": _query(lambda b, a: b.can_pop(1), _none),
    "pop": _new(lambda b, a: (lambda items, new: (new, items))(*b.pop(1)), _none),
}


def _queue(spec, capacity):
    return dx.TrajectoryQueue(spec, NUM_ENVS, 3 * capacity)


# Streams: the storage of every trajectory buffer, on its own.
_STREAMS = {
    **_streams_methods("append"),
    "newest": _query(lambda b, a: b.newest(a), lambda s: np.asarray([s % 2, 0], np.int32)),
    # Steps for streams of up to 8 steps, cut to the streams' length.
    "restore": _new(
        lambda b, a: (
            b.restore(
                jax.tree.map(lambda x: x[:, : b.max_length], a),
                jnp.asarray([5, 0, 2]),
                jnp.asarray([min(4, b.max_length), 0, 2]),
            ),
            None,
        ),
        lambda s: jax.tree.map(
            lambda x: x.reshape(NUM_ENVS, 8, *x.shape[1:]), _items(s, NUM_ENVS * 8)
        ),
    ),
}


def _streams(spec, capacity):
    return dx.Streams(spec, NUM_ENVS, capacity)


def _streams_fill_call(b, a):
    first, second = a
    return b.append(first).append(second[0], env_ids=second[1]), None


_streams_fill = _new(_streams_fill_call, _trajectory_fill.args)


# ---------------------------------------------------------------------------------------------
# Random steps for the save/load round trips: any item spec, arbitrary bit patterns.

_BATCH_SIZES = [1, 6]  # part of a buffer, or wrapping around it

_push_batch = eqx.filter_jit(lambda b, x: b.push_batch(x))
_add_batch = eqx.filter_jit(lambda b, x: b.add_batch(x))
_add_batch_masked = eqx.filter_jit(lambda b, x, m: b.add_batch(x, mask=m))
_add_batch_p = eqx.filter_jit(lambda b, x, p: b.add_batch(x, p))
_set_priorities = eqx.filter_jit(lambda b, i, p: b.set_priorities(i, p))
_set_leaves = eqx.filter_jit(lambda t, i, v: t.set(i, v))
_add_envs = eqx.filter_jit(lambda b, x, ids: b.add(x, env_ids=ids))
_reset_online = eqx.filter_jit(lambda b: b.reset_online_queue())


def _random_items(spec, rng):
    n = int(rng.choice(_BATCH_SIZES))
    return random_bits_batch(spec, n, rng), n


def _random_priorities(rng, n):
    # Every magnitude, zeros included.
    return ((rng.random(n) * 10.0 ** rng.integers(-3, 4, n)) * (rng.random(n) < 0.8)).astype(
        np.float32
    )


def _circular_step(buf, spec, rng):
    return _push_batch(buf, _random_items(spec, rng)[0])


def _uniform_step(buf, spec, rng):
    items, n = _random_items(spec, rng)
    if rng.random() < 0.5:
        return _add_batch_masked(buf, items, rng.random(n) < 0.5)
    return _add_batch(buf, items)


def _prioritised_step(buf, spec, rng):
    items, n = _random_items(spec, rng)
    # The maximum priority is state too.
    buf = _add_batch_p(buf, items, _random_priorities(rng, n))
    k = int(rng.integers(1, 4))
    return _set_priorities(buf, rng.integers(0, int(buf.size), k), rng.random(k).astype(np.float32))


def _clustered_step(buf, spec, rng):
    return _add_batch(buf, _random_items(spec, rng)[0])


def _sum_tree_step(tree, spec, rng):
    n = int(rng.choice(_BATCH_SIZES))
    indices = rng.integers(0, tree.capacity, n).astype(np.int32)
    return _set_leaves(tree, indices, _random_priorities(rng, n))


def _trajectory_step(buf, spec, rng):
    # Steps for a random subset of envs, in random order; now and then a new online queue.
    if rng.random() < 0.25:
        buf = _reset_online(buf)
    n = int(rng.integers(1, NUM_ENVS + 1))
    ids = rng.permutation(NUM_ENVS)[:n].astype(np.int32)
    return _add_envs(buf, random_bits_batch(spec, n, rng), ids)


def _prioritised_trajectory_step(buf, spec, rng):
    # Steps for a random subset of envs (windows enter and leave), now and then new priorities.
    n = int(rng.integers(1, NUM_ENVS + 1))
    ids = rng.permutation(NUM_ENVS)[:n].astype(np.int32)
    return _add_envs(buf, random_bits_batch(spec, n, rng), ids)


_pop = eqx.filter_jit(lambda q: q.pop(1)[1])
_append_envs = eqx.filter_jit(lambda b, x, ids: b.append(x, env_ids=ids))


def _queue_step(queue, spec, rng):
    # Pop when every env has an unread step, then add to envs that have room.
    if bool(queue.can_pop(1)) and rng.random() < 0.5:
        queue = _pop(queue)
    room = np.flatnonzero(np.asarray(queue.unread) < queue.max_length)
    if room.size == 0:
        return _pop(queue)
    ids = rng.permutation(room)[: int(rng.integers(1, room.size + 1))].astype(np.int32)
    return _add_envs(queue, random_bits_batch(spec, ids.size, rng), ids)


def _streams_step(streams, spec, rng):
    n = int(rng.integers(1, NUM_ENVS + 1))
    ids = rng.permutation(NUM_ENVS)[:n].astype(np.int32)
    return _append_envs(streams, random_bits_batch(spec, n, rng), ids)


# ---------------------------------------------------------------------------------------------


_STATIC = "a static Python value, not an array"
_TRAJECTORY_STATIC = {
    "item_spec": _STATIC,
    "num_envs": _STATIC,
    "max_length": _STATIC,
    "episodes": _STATIC,
    "episodes_of": "tests/test_relabel.py, a buffer made with `episodes=` (refused at once "
    "without)",
}
_LAYERS = "tests/test_layers.py, every layer over every kind"
# What every buffer states for the layers over its family: covered there.
_PROTOCOL = {
    "law": f"the law the layers draw by ({_LAYERS})",
    "layered": _STATIC,
    "num_shards": _STATIC,
    "place_shards": f"where a layer keeps per-shard counts ({_LAYERS})",
    "map_shards": f"a layer's code on each shard ({_LAYERS})",
    "counts": f"None for a buffer that counts nothing ({_LAYERS})",
    "with_counts": f"the buffer as it is for a buffer that counts nothing ({_LAYERS})",
    "priority_settings": f"static: what a dataset keeps of the priorities ({_LAYERS})",
    # How faults are reported: every method of every type again with `throw=False` in
    # tests/test_results.py.
    "throw": _STATIC,
    "with_throw": "tests/test_results.py, every method with `throw=False`",
    "with_result": "tests/test_results.py, the first fault kept",
    "check": "tests/test_results.py, every kind of fault",
}
_NO_PRIORITIES = "refused at once for a buffer without priorities (tests/test_layers.py)"
_REPLAY_PROTOCOL = {
    **_PROTOCOL,
    "split_indices": f"how a name maps to its shard ({_LAYERS})",
    "window_priorities": f"None: a replay has no windows ({_LAYERS})",
    "with_window_priorities": f"refused at once: a replay has no windows ({_LAYERS})",
}
_REPLAY_WITHOUT_PRIORITIES = {
    "set_priorities": _NO_PRIORITIES,
    "stale": _NO_PRIORITIES,
    "note_priorities": f"the buffer as it is, without priorities ({_LAYERS})",
}
_TRAJECTORY_PROTOCOL = {
    **_PROTOCOL,
    "with_written": "the buffer holding streams that `write_back` wrote into "
    "(tests/test_write_back.py)",
    "split_envs": f"how an env id maps to its shard ({_LAYERS})",
    "sample_by": "the step of `sample` that evaluates a law, for a mixture's parts "
    "(tests/test_mixture.py: plain, prioritised, rate-limited and global parts)",
}
_TRAJECTORY_WITHOUT_PRIORITIES = {
    "set_priorities": _NO_PRIORITIES,
    "note_priorities": f"the buffer as it is, without priorities ({_LAYERS})",
    "window_priorities": f"None for a buffer without priorities ({_LAYERS})",
    "with_window_priorities": _NO_PRIORITIES,
}
_NOT_A_QUEUE = {
    "pop": "refused at once: the buffer is sampled, not read once (tests/test_layers.py)",
    "can_pop": "refused at once: the buffer is sampled, not read once (tests/test_layers.py)",
}

BUFFER_TYPES = [
    BufferType(
        "CircularBuffer",
        dx.CircularBuffer,
        dx.CircularBuffer,
        _circular_fill,
        _CIRCULAR,
        {"item_spec": _STATIC},
        _circular_step,
    ),
    BufferType(
        "UniformReplay",
        dx.UniformReplay,
        dx.UniformReplay,
        _replay_fill,
        _UNIFORM,
        {
            "max_size": _STATIC,
            "item_spec": _STATIC,
            **_REPLAY_PROTOCOL,
            **_REPLAY_WITHOUT_PRIORITIES,
        },
        _uniform_step,
    ),
    BufferType(
        "PrioritisedReplay",
        dx.PrioritisedReplay,
        dx.PrioritisedReplay,
        _replay_fill,
        _PRIORITISED,
        {
            "max_size": _STATIC,
            "item_spec": _STATIC,
            "priority_exponent": _STATIC,
            "stratified": _STATIC,
            **_REPLAY_PROTOCOL,
        },
        _prioritised_step,
    ),
    BufferType(
        "ClusteredReplay(UniformReplay)",
        dx.ClusteredReplay,
        _clustered_uniform,
        _clustered_fill,
        _CLUSTERED,
        {
            "max_size": _STATIC,
            "item_spec": _STATIC,
            **_REPLAY_PROTOCOL,
            **_REPLAY_WITHOUT_PRIORITIES,
            "set_priorities": "refused at trace time: the inner replay has no priorities",
        },
        _clustered_step,
    ),
    BufferType(
        "ClusteredReplay(PrioritisedReplay)",
        dx.ClusteredReplay,
        _clustered_prioritised,
        _clustered_fill,
        _CLUSTERED_PRIORITISED,
        {
            "max_size": _STATIC,
            "item_spec": _STATIC,
            **_REPLAY_PROTOCOL,
            "stale": "refused at once: a ClusteredReplay keeps no write generations of its own",
        },
        _clustered_step,
    ),
    BufferType(
        "SumTree",
        dx.SumTree,
        lambda spec, capacity: dx.SumTree(capacity),
        _sum_tree_fill,
        _SUM_TREE,
        {},
        _sum_tree_step,
    ),
    BufferType(
        "Streams",
        dx.Streams,
        _streams,
        _streams_fill,
        _STREAMS,
        {"item_spec": _STATIC, "episodes": _STATIC},
        _streams_step,
    ),
    BufferType(
        "TrajectoryBuffer",
        dx.TrajectoryBuffer,
        _trajectory,
        _trajectory_fill,
        _TRAJECTORY,
        {
            **_TRAJECTORY_STATIC,
            **_TRAJECTORY_PROTOCOL,
            **_TRAJECTORY_WITHOUT_PRIORITIES,
            **_NOT_A_QUEUE,
            "overwritten": "a deprecated alias of `stale`",
            "sample_mixed": "a deprecated form of `sample` (tests/test_trajectory.py)",
            "sample_transitions": "a deprecated form of `sample` (tests/test_trajectory.py)",
        },
        _trajectory_step,
    ),
    BufferType(
        "PrioritisedTrajectoryBuffer",
        dx.PrioritisedTrajectoryBuffer,
        _prioritised_trajectory,
        _trajectory_fill,
        _PRIORITISED_TRAJECTORY,
        {
            **_TRAJECTORY_STATIC,
            "leaves_per_env": _STATIC,
            "priority_exponent": _STATIC,
            "stratified": _STATIC,
            **{
                name: f"a deprecated alias of `{new}`"
                for name, new in [
                    ("slots_per_env", "leaves_per_env"),
                    ("sequence_length", "window.sequence_length"),
                    ("burn_in", "window.burn_in"),
                    ("bootstrap", "window.bootstrap"),
                    ("period", "window.period"),
                ]
            },
            "streams": "`trajectories.streams`, a `Streams` (its own entry covers it)",
            **_TRAJECTORY_PROTOCOL,
            **_NOT_A_QUEUE,
            "read": "refused at once: a PrioritisedTrajectoryBuffer reads its windows by "
            "priority (`trajectories.read` reads by stamp)",
        },
        _prioritised_trajectory_step,
    ),
    BufferType(
        "TrajectoryQueue",
        dx.TrajectoryQueue,
        _queue,
        _trajectory_fill,
        _QUEUE,
        {
            **_TRAJECTORY_STATIC,
            **_TRAJECTORY_PROTOCOL,
            **_TRAJECTORY_WITHOUT_PRIORITIES,
            "sample": "refused at once: a queue is read once with `pop` (tests/test_layers.py)",
            "read": "refused at once: a queue is read once with `pop` (tests/test_layers.py)",
            "write_back": "refused at once: a queue is read once with `pop` "
            "(tests/test_write_back.py)",
        },
        _queue_step,
    ),
]

BY_NAME = {t.name: t for t in BUFFER_TYPES}

# (type, method name) pairs, for tests parametrised over every method of every type.
METHODS = [(t, name) for t in BUFFER_TYPES for name in t.methods]


def method_id(pair) -> str:
    t, name = pair
    return f"{t.name}.{name}"


# ---------------------------------------------------------------------------------------------
# Instances and compiled calls, shared by every test that uses them.


@functools.cache
def jitted(call):
    """`eqx.filter_jit(call)`, one per call, so that its compilations are shared."""
    return eqx.filter_jit(call)


def empty(t: BufferType):
    return t.make(ITEM, CAPACITY)


def filled(t: BufferType, seed: int = 0):
    """A small instance with a few items in it (every cluster and env has some)."""
    return jitted(t.fill.call)(empty(t), t.fill.args(seed))[0]


@eqx.filter_jit
def _make_batch(make, spec, capacity, copies):
    return eqx.filter_vmap(lambda: make(spec, capacity), axis_size=copies)()


def make_batch(make, spec, capacity: int, copies: int):
    """`copies` independent empty buffers as one batch, as `eqx.filter_vmap` makes them."""
    return _make_batch(make, spec, capacity, copies)


def stack(trees: list) -> Any:
    """Independent buffers (or arguments) of one configuration as one batch."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def row(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


def filled_batch(t: BufferType, copies: int, seed: int = 0):
    """`copies` filled buffers, each with its own items, as one batch."""
    return stack([filled(t, seed + i) for i in range(copies)])


def batch_args(method: Method, copies: int, seed: int = 0):
    """`copies` buffers' worth of arguments for `method`, stacked."""
    args = [method.args(seed + i) for i in range(copies)]
    if not jax.tree.leaves(args[0]):
        return args[0]
    return stack(args)


def array_leaves_on(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
