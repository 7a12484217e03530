"""Every buffer's add, vmapped over buffers, compiles to writes in place with no copy of the
storage and no loop over lanes (issue 38), on whichever JAX is installed (CI runs this file on
jax 0.5.3 too).

Each case compiles `jax.jit(jax.vmap(add), donate_argnums=0)` of a buffer of `M` slots (or `M`
steps per env) for `LANES` buffers and reads the optimized HLO: every storage array of the
buffers is aliased to an output (updated in place), no instruction copies or transposes an
array of storage size, and the writes (`dejax_eqx/_writes.py`) are one scatter per leaf whose
single batching dimension holds every lane. On jax 0.5.3 XLA:CPU rewrites every scatter, vmapped
or not, into a `while` loop of one row per iteration: there each loop must come from a write and
run once per written row of all lanes together (O(items)).
"""

from collections.abc import Callable
from typing import Any

import dejax_eqx as dx
import dejax_eqx.compat.flashbax as fbx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .hlo import aliased_parameters, copies, loops


LANES = 3
# The tests' XLA flags (conftest.py) turn XLA:CPU's fusion emitters off to compile faster; with
# them off, jax 0.5.3 compiled the old writes of the training loop below without the copies
# users got. These programs are compiled as users compile them. (jax 0.11 has no such flag.)
USERS_XLA: dict[str, Any] = (
    {"xla_cpu_use_fusion_emitters": True} if jax.__version_info__ < (0, 11) else {}
)
M = 1000  # slots of a replay, steps of a stream: above every item, sample and batch
ENVS, N, T = 4, 5, 3  # envs of a stream; items of an add_batch; steps of an extend

ITEM = {"obs": jnp.zeros(2), "action": jnp.zeros((), jnp.int32), "done": jnp.zeros((), bool)}


def _batch(*shape: int) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: jnp.ones((LANES, *shape, *x.shape), x.dtype), ITEM)


def _by_action(item) -> jax.Array:
    return item["action"] % 2


def _flat_add(state, items):
    buffer = fbx.make_flat_buffer(M * ENVS, 2, 2, add_batch_size=ENVS)
    return buffer.add(state, items)


# name: (make one buffer, add, the items of every lane, the most rows a write writes per lane)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any, Any], Any], Any, int]] = {
    "UniformReplay.add_batch": (
        lambda: dx.UniformReplay(ITEM, M),
        lambda b, x: b.add_batch(x),
        _batch(N),
        N,
    ),
    "UniformReplay.add": (
        lambda: dx.UniformReplay(ITEM, M),
        lambda b, x: b.add(x),
        _batch(),
        1,
    ),
    "UniformReplay.add_batch(mask=...)": (
        lambda: dx.UniformReplay(ITEM, M),
        lambda b, x: b.add_batch(x, mask=x["action"] == 1),
        _batch(N),
        N,
    ),
    "PrioritisedReplay.add_batch": (
        lambda: dx.PrioritisedReplay(ITEM, M),
        lambda b, x: b.add_batch(x),
        _batch(N),
        N,
    ),
    "ClusteredReplay.add_batch": (
        lambda: dx.ClusteredReplay(dx.UniformReplay(ITEM, M), 2, _by_action),
        lambda b, x: b.add_batch(x),
        _batch(N),
        2 * N,  # every cluster makes a masked add of the whole batch
    ),
    "TrajectoryBuffer.add": (
        lambda: dx.TrajectoryBuffer(ITEM, ENVS, M),
        lambda b, x: b.add(x),
        _batch(ENVS),
        ENVS,
    ),
    "TrajectoryBuffer.extend": (
        lambda: dx.TrajectoryBuffer(ITEM, ENVS, M),
        lambda b, x: b.extend(x),
        _batch(ENVS, T),
        ENVS * T,
    ),
    "TrajectoryBuffer.add(env_ids=...)": (
        lambda: dx.TrajectoryBuffer(ITEM, ENVS, M),
        lambda b, x: b.add(x, env_ids=jnp.array([2, 0], jnp.int32)),
        _batch(2),
        2,
    ),
    "PrioritisedTrajectoryBuffer.add": (
        lambda: dx.PrioritisedTrajectoryBuffer(ITEM, ENVS, M, dx.Window(2, strict=True)),
        lambda b, x: b.add(x),
        _batch(ENVS),
        2 * ENVS,  # the sum tree: a window enters and one leaves per env
    ),
    "TrajectoryQueue.add": (
        lambda: dx.TrajectoryQueue(ITEM, ENVS, M),
        lambda b, x: b.add(x),
        _batch(ENVS),
        ENVS,
    ),
    "flashbax drop-in make_flat_buffer add": (
        lambda: fbx.make_flat_buffer(M * ENVS, 2, 2, add_batch_size=ENVS).init(ITEM),
        _flat_add,
        _batch(ENVS),
        ENVS,
    ),
}


# The README's command compiles three (a replay, a stream, the drop-in PureJaxRL uses); the
# rest run with `-m slow`.
FAST = ("UniformReplay.add_batch", "TrajectoryBuffer.add", "flashbax drop-in make_flat_buffer add")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_vmapped_add_writes_in_place_without_copies_or_lane_loops(name):
    make, add, items, rows = CASES[name]
    buffers = jax.vmap(lambda _: make())(jnp.arange(LANES))
    num_leaves = len(jax.tree.leaves(buffers))
    step = jax.jit(jax.vmap(add), donate_argnums=0)
    hlo = step.lower(buffers, items).compile(USERS_XLA).as_text()
    assert hlo is not None

    # In place: every leaf of the buffers is aliased to an output...
    assert set(range(num_leaves)) <= aliased_parameters(hlo)
    # ...and nothing copies or transposes storage (the smallest storage array holds M * LANES
    # elements; an item batch, a sample or a counter holds far fewer).
    assert copies(hlo, M * LANES) == [], copies(hlo, M * LANES)[:3]

    # XLA:CPU makes a scatter a `while` loop of one row per iteration where it does not emit
    # it as such (every scatter on jax 0.5.3; small ones under the tests' flags elsewhere).
    # Every such loop here comes from a write (nothing else scatters) and must run once per
    # row written by all lanes together, at most `rows` per lane: no loop per lane.
    scatters = [
        loop for loop in loops(hlo) if loop.op_name.rsplit("/", 1)[-1].startswith("scatter")
    ]
    trips = [loop.trips for loop in scatters]
    assert all(t is not None and t % LANES == 0 and t <= LANES * rows for t in trips), scatters

    # The same step runs in place: the storage keeps its addresses and the old buffers are
    # consumed.
    pointers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(buffers)]
    new = step(buffers, items)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(buffers))
    after = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(new)]
    big = [i for i, leaf in enumerate(jax.tree.leaves(new)) if leaf.size >= M * LANES]
    assert big and all(after[i] == pointers[i] for i in big)


def test_nested_vmaps_and_unbatched_operands_write_the_same_as_a_loop():
    # Two vmaps, the storage batched by both, the items by the outer one only, and an index
    # unbatched: the flattened scatter must equal a Python loop of single adds.
    def make(_):
        return dx.UniformReplay(ITEM, 7)

    inner = jax.vmap(lambda b, x: b.add_batch(x), in_axes=(0, None))
    step = jax.jit(jax.vmap(inner), donate_argnums=0)
    buffers = jax.vmap(jax.vmap(make))(jnp.zeros((2, 3)))
    rng = np.random.default_rng(0)
    for n in (5, 4, 9):
        items = {
            "obs": jnp.asarray(rng.normal(size=(2, n, 2)), jnp.float32),
            "action": jnp.asarray(rng.integers(0, 9, size=(2, n)), jnp.int32),
            "done": jnp.asarray(rng.random((2, n)) < 0.5),
        }
        expected = [
            [
                jax.tree.map(lambda x: x[i, j], buffers).add_batch(
                    jax.tree.map(lambda x: x[i], items)
                )
                for j in range(3)
            ]
            for i in range(2)
        ]
        buffers = step(buffers, items)
        for i in range(2):
            for j in range(3):
                got = jax.tree.map(lambda x: x[i, j], buffers)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected[i][j])):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _flat_buffer():
    return fbx.make_flat_buffer(M * ENVS, 2, 8, add_batch_size=ENVS)


# name: (make one buffer, add, sample one scalar from the buffer, items of one add)
TRAINING: dict[str, tuple[Callable[[], Any], Callable, Callable, Any]] = {
    "flashbax drop-in make_flat_buffer": (
        lambda: _flat_buffer().init(ITEM),
        lambda s, x: _flat_buffer().add(s, x),
        lambda s, k: jnp.sum(_flat_buffer().sample(s, k).experience.first["obs"]),
        (ENVS,),
    ),
    "UniformReplay": (
        lambda: dx.UniformReplay(ITEM, M),
        lambda b, x: b.add_batch(x),
        lambda b, k: jnp.sum(b.sample(k, 8)["obs"]),
        (N,),
    ),
    "TrajectoryBuffer": (
        lambda: dx.TrajectoryBuffer(ITEM, ENVS, M),
        lambda b, x: b.add(x),
        lambda b, k: jnp.sum(b.sample(k, 8, dx.Window(2)).items["obs"]),
        (ENVS,),
    ),
}


@pytest.mark.parametrize(
    "name",
    [n if n.startswith("flashbax") else pytest.param(n, marks=pytest.mark.slow) for n in TRAINING],
)
def test_vmapped_training_loop_never_copies_its_storage(name):
    # PureJaxRL's shape: `jit(vmap(train))` over seeds, the buffer made inside `train` and
    # carried through a `scan` of adds and samples. Before the writes went through
    # `_writes.py`, jax 0.5.3 compiled the flat buffer's loop with 14 copies and transposes of
    # its storage (to and from the lanes-last layout of a scatter with two batching
    # dimensions), on every step.
    make, add, sample, shape = TRAINING[name]

    def train(key):
        def step(carry, key):
            buf, total = carry
            new = jax.tree.map(
                lambda x: jax.random.normal(key, shape + x.shape).astype(x.dtype), ITEM
            )
            buf = add(buf, new)
            return (buf, total + sample(buf, key)), None

        return jax.lax.scan(step, (make(), jnp.zeros(())), jax.random.split(key, 5))[0]

    keys = jax.random.split(jax.random.key(0), LANES)
    hlo = jax.jit(jax.vmap(train)).lower(keys).compile(USERS_XLA).as_text()
    assert hlo is not None
    assert copies(hlo, M * LANES) == [], copies(hlo, M * LANES)[:3]
