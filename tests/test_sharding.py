"""Checks that need several devices, on the 4 CPU devices every test process has
(`conftest.py`: `jax_num_cpu_devices`). Everything else in the suite runs on the first device.

They need JAX 0.7 or newer: they run docs/sharding.md and examples/sharding_*.py, written for
it. On 0.5.3, besides the missing names, the experimental shard_map has no replication rule for
equinox's error check and explicit mesh axes reject a select of mixed shardings.
"""

import functools
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, cast

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import assert_bits_equal, profile_max_examples, python_blocks, rotation, SLOW, SPECS
from .hlo import aliased_parameters, collectives
from .registry import batch_args, BUFFER_TYPES, filled, filled_batch
from .test_io import batch_step, BUFFER_CASES, make_batch, MAX_SIZES, on_default_device, SPEC_NAMES


pytestmark = pytest.mark.skipif(
    not hasattr(jax.sharding, "reshard"),
    reason="sharding needs JAX 0.7+ (jax.shard_map, jax.sharding.reshard, explicit mesh axes)",
)
assert jax.device_count() == 4, f"conftest.py gives 4 CPU devices; JAX has {jax.device_count()}"

ROOT = Path(__file__).parent.parent
NUM_DEVICES = 4
CAPACITY = 37  # a dimension no other array in the steps has, to recognise buffer data in HLO
ITEMS_PER_STEP = 8
BATCH_SIZE = 16


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


anakin = _load_example("sharding_anakin")
per_device = _load_example("sharding_shard_map")


def _hlo_shape(x) -> str:
    dtype = {"float32": "f32", "int32": "s32", "uint32": "u32", "bool": "pred"}[str(x.dtype)]
    return f"{dtype}[{','.join(map(str, x.shape))}]"


# ---------------------------------------------------------------------------------------------
# Pattern 1: Anakin (vmapped buffers, sharded, one jitted step)


def _host_items(t: int, rng: np.random.Generator) -> dict:
    """Step `t`'s items: device d's are labelled d."""
    n = ITEMS_PER_STEP
    return {
        "obs": rng.normal(size=(NUM_DEVICES, n, 4)).astype(np.float32),
        "device": np.repeat(np.arange(NUM_DEVICES, dtype=np.int32)[:, None], n, 1),
        "step": np.full((NUM_DEVICES, n), t, np.int32),
    }


def _row(tree, d: int):
    """Row `d` of a batch, on the default device (an explicitly sharded array cannot be
    indexed eagerly)."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[d]), tree)


@pytest.fixture(scope="module")
def mesh():
    return anakin.make_mesh()


@pytest.fixture(scope="module")
def sharding(mesh):
    return NamedSharding(mesh, P("devices"))


def _anakin_step(buffers, items, key, sharding):
    return anakin.step(buffers, items, key, sharding=sharding, batch_size=BATCH_SIZE)


def _anakin_hlo(mesh, sharding) -> str:
    buffers = anakin.make_buffers(mesh, CAPACITY)
    items = jax.device_put(_host_items(0, np.random.default_rng(0)), sharding)
    lowered = anakin.step.lower(
        buffers, items, jax.random.key(0), sharding=sharding, batch_size=BATCH_SIZE
    )
    return lowered.compile().compiled.as_text()


def test_anakin_step_moves_no_buffer_data_between_devices(mesh, sharding):
    hlo = _anakin_hlo(mesh, sharding)
    assert "num_partitions=4" in hlo
    # Each device's program sees its own buffer only: the per-device parameter shape, and no
    # array anywhere with all four buffers' storage.
    assert f"f32[1,{CAPACITY},4]" in hlo
    assert f"[{NUM_DEVICES},{CAPACITY}" not in hlo

    found = collectives(hlo)
    # No all-gather, all-to-all, collective-permute, reduce-scatter, broadcast, send or recv.
    assert {c.op for c in found} <= {"all-reduce"}, found
    # No collective touches an array with the capacity axis: buffer storage never moves.
    capacity = re.compile(rf"[\[,]{CAPACITY}[\],]")
    assert not [c for c in found if any(capacity.search(s) for s in c.shapes)], found
    # What remains comes from the runtime check in `sample`, vmapped: on every step, one
    # all-reduce of a single boolean ("is any buffer empty?"); and, inside the branch that runs
    # only when that error is raised, the broadcast of the error callback's placeholder
    # result, the check's boolean token (`check_faults` guards a token, not the sample).
    assert [c.shapes for c in found if c.every_step] == [("pred[]",)], found
    assert {s for c in found if not c.every_step for s in c.shapes} <= {"pred[]"}, found


def test_hlo_check_catches_a_gather_of_buffer_data(mesh, sharding):
    # The check above must be able to fail: replicating the storage makes every device gather
    # all four buffers.
    @eqx.filter_jit
    def gathers(buffers):
        return jax.sharding.reshard(buffers.storage.data["obs"], NamedSharding(mesh, P()))

    # `eqx.filter_jit` is typed as giving back the function it wraps, without its `.lower`.
    lowered = cast(Any, gathers).lower(anakin.make_buffers(mesh, CAPACITY))
    hlo = lowered.compile().compiled.as_text()
    found = collectives(hlo)
    assert [(c.op, c.shapes) for c in found] == [("all-gather", (f"f32[4,{CAPACITY},4]",))], found


def test_anakin_step_is_in_place_keeps_sharding_and_matches_one_device(mesh, sharding):
    hlo = _anakin_hlo(mesh, sharding)
    buffers = anakin.make_buffers(mesh, CAPACITY)
    num_leaves = len(jax.tree.leaves(buffers))
    # The buffers are the first arguments; each of their parameters is aliased to an output.
    assert set(range(num_leaves)) <= aliased_parameters(hlo)

    pointers = [
        [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
        for leaf in jax.tree.leaves(buffers)
    ]
    references = [dx.UniformReplay(anakin.ITEM, CAPACITY) for _ in range(NUM_DEVICES)]
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    batch = None
    for t in range(6):  # 48 items per buffer: wraps around the 37 slots
        host = _host_items(t, rng)
        key, subkey = jax.random.split(key)
        old = buffers
        buffers, batch = _anakin_step(buffers, jax.device_put(host, sharding), subkey, sharding)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))  # donated
        keys = jax.random.split(subkey, NUM_DEVICES)
        for d in range(NUM_DEVICES):
            references[d], expected = references[d].add_and_sample(
                _row(host, d), keys[d], BATCH_SIZE
            )
            assert_bits_equal(_row(batch, d), expected)

    for leaf, before in zip(jax.tree.leaves(buffers), pointers):
        # Same sharding as when made: one row per device, each on its own device...
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        assert [s.data.shape[0] for s in leaf.addressable_shards] == [1] * NUM_DEVICES
        # ...and updated in place: every shard still lives at the same address.
        assert [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards] == before
    for d in range(NUM_DEVICES):
        assert_bits_equal(_row(buffers, d), references[d])
    # The samples stay where they were drawn: row d on device d, from device d's items only.
    assert batch is not None
    for shard in batch["device"].addressable_shards:
        d = shard.index[0].start
        assert shard.device == mesh.devices[d]
        assert (np.asarray(shard.data) == d).all()


def test_anakin_example_runs():
    anakin.main(num_steps=3)


# ---------------------------------------------------------------------------------------------
# Pattern 2: one logical buffer per device, inside `jax.shard_map`


@pytest.fixture(scope="module")
def plain_mesh():
    return jax.make_mesh((NUM_DEVICES,), ("devices",))


def test_shard_map_samples_come_from_the_same_device(plain_mesh):
    mesh = plain_mesh
    sharding = NamedSharding(mesh, P("devices"))
    buffers = per_device.make_buffers(mesh, CAPACITY)
    step = per_device.make_step(mesh, BATCH_SIZE)
    items = jax.device_put(_host_items(0, np.random.default_rng(0)), sharding)
    hlo = step.lower(buffers, items, jax.random.key(0)).compile().compiled.as_text()
    assert collectives(hlo) == []  # nothing at all crosses devices
    assert f"f32[1,{CAPACITY},4]" in hlo and f"[{NUM_DEVICES},{CAPACITY}" not in hlo

    pointers = [
        [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
        for leaf in jax.tree.leaves(buffers)
    ]
    references = [dx.UniformReplay(per_device.ITEM, CAPACITY) for _ in range(NUM_DEVICES)]
    rng = np.random.default_rng(1)
    key = jax.random.key(1)
    batch = None
    for t in range(6):
        host = _host_items(t, rng)
        key, subkey = jax.random.split(key)
        buffers, batch = step(buffers, jax.device_put(host, sharding), subkey)
        for d in range(NUM_DEVICES):
            references[d], expected = references[d].add_and_sample(
                _row(host, d), jax.random.fold_in(subkey, d), BATCH_SIZE
            )
            assert_bits_equal(_row(batch, d), expected)
    for d in range(NUM_DEVICES):
        assert_bits_equal(_row(buffers, d), references[d])
    after = [
        [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
        for leaf in jax.tree.leaves(buffers)
    ]
    assert after == pointers  # in place
    for leaf in jax.tree.leaves(buffers):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    # Device d's samples are device d's items, and they are on device d.
    assert batch is not None
    for shard in batch["device"].addressable_shards:
        d = shard.index[0].start
        assert shard.device == mesh.devices[d]
        assert (np.asarray(shard.data) == d).all()


def test_shard_map_empty_buffer_raises(plain_mesh):
    mesh = plain_mesh
    buffers = per_device.make_buffers(mesh, CAPACITY)
    step = per_device.make_step(mesh, BATCH_SIZE)
    nothing = {k: v[:, :0] for k, v in _host_items(0, np.random.default_rng(0)).items()}
    nothing = jax.device_put(nothing, NamedSharding(mesh, P("devices")))
    with pytest.raises(RuntimeError, match="cannot sample from an empty UniformReplay"):
        jax.block_until_ready(step(buffers, nothing, jax.random.key(0)))


def test_shard_map_example_runs():
    per_device.main(num_steps=3)


# ---------------------------------------------------------------------------------------------
# TrajectoryBuffer, one logical buffer with its env axis sharded

TRAJ_ENVS = 8  # two whole env streams per device
TRAJ_ITEM = {"obs": jnp.zeros(4, jnp.float32), "reward": jnp.zeros((), jnp.float32)}


def _traj_steps(rng: np.random.Generator) -> dict:
    return {
        "obs": rng.normal(size=(TRAJ_ENVS, 4)).astype(np.float32),
        "reward": rng.normal(size=TRAJ_ENVS).astype(np.float32),
    }


@eqx.filter_jit(donate="all-except-first")
def _traj_step(key, buf, steps):
    buf = buf.add(steps)
    return buf, buf.sample(key, BATCH_SIZE, dx.Window(5))


def test_trajectory_buffer_sharded_along_envs():
    # An `Auto` mesh: XLA chooses how the sample's gather is partitioned.
    mesh = jax.make_mesh((NUM_DEVICES,), ("devices",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("devices"))
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree
    )
    buf = place(dx.TrajectoryBuffer(TRAJ_ITEM, TRAJ_ENVS, CAPACITY))
    reference = dx.TrajectoryBuffer(TRAJ_ITEM, TRAJ_ENVS, CAPACITY)
    rng = np.random.default_rng(3)
    steps = place(_traj_steps(rng))
    lowered = cast(Any, _traj_step).lower(jax.random.key(0), buf, steps)  # an eqx.filter_jit
    hlo = lowered.compile().compiled.as_text()
    # Each device holds 2 of the 8 env streams, and no program holds all of them.
    assert f"f32[2,{CAPACITY},4]" in hlo and f"[{TRAJ_ENVS},{CAPACITY}" not in hlo
    found = collectives(hlo)
    # No collective touches an array with the max_length axis: storage never moves. What
    # crosses devices is the sampled batch (the gather is a masked local gather on every
    # device and an all-reduce), per-env weights and scalars; the added steps do not move.
    capacity = re.compile(rf"[\[,]{CAPACITY}[\],]")
    assert not [c for c in found if any(capacity.search(s) for s in c.shapes)], found
    assert {c.op for c in found} <= {"all-reduce", "all-gather", "collective-permute"}, found
    gathered = {s for c in found if c.op == "all-gather" for s in c.shapes}
    assert gathered <= {f"f32[{TRAJ_ENVS}]", f"s32[{TRAJ_ENVS}]"}, found
    num_leaves = len(jax.tree.leaves(buf))
    assert len(aliased_parameters(hlo)) >= num_leaves  # the buffer, in place

    pointers = [
        [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
        for leaf in jax.tree.leaves(buf)
    ]
    for t in range(45):  # 45 steps per env: wraps around the 37 slots
        host = _traj_steps(rng) if t else jax.tree.map(np.asarray, steps)
        key = jax.random.key(t)
        buf, sample = _traj_step(key, buf, place(host))
        reference, expected = _traj_step(key, reference, host)
        assert_bits_equal(sample, expected)
    for leaf, before in zip(jax.tree.leaves(buf), pointers):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        assert [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards] == before
    assert_bits_equal(jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), buf), reference)


# ---------------------------------------------------------------------------------------------
# Every method of every buffer type inside `shard_map`, with its default checks (check_vma)


def _block(tree):
    """This device's block (leading axis 1) -> its one buffer or argument."""
    return jax.tree.map(lambda x: x[0], tree)


def _unblock(tree):
    return jax.tree.map(lambda x: x[None], tree)


@functools.cache
def _per_device(call):
    """`call` on each device's own buffer and arguments, in `shard_map` with default checks."""

    def local(bufs, args):
        return _unblock(call(_block(bufs), _block(args)))

    mesh = jax.make_mesh((NUM_DEVICES,), ("devices",))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("devices"), out_specs=P("devices")))


def _sharded(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P("devices")))


@pytest.mark.parametrize("t", rotation(BUFFER_TYPES, 5, keep=1), ids=lambda t: t.name)
def test_every_method_inside_shard_map(plain_mesh, t):
    # One buffer per device, each filled with its own items, and every method called on it
    # with its own arguments: device d's results are what buffer d gives alone, on one device.
    # All the methods of a type in one program: one compilation per type, not per method.
    names = list(t.methods)

    def every(buf, args):
        return {name: t.methods[name].call(buf, args[name]) for name in names}

    bufs = _sharded(filled_batch(t, NUM_DEVICES), plain_mesh)
    args = {name: batch_args(t.methods[name], NUM_DEVICES) for name in names}
    out = _per_device(every)(bufs, _sharded(args, plain_mesh))
    for leaf in jax.tree.leaves(out):
        assert len(leaf.sharding.device_set) == NUM_DEVICES  # each row stays on its device
    reference = eqx.filter_jit(every)
    for d in range(NUM_DEVICES):
        expected = reference(filled(t, d), {name: t.methods[name].args(d) for name in names})
        assert_bits_equal(_row(out, d), expected)


def test_faults_inside_shard_map_still_raise(plain_mesh):
    # The checks pass shard_map's default type checks and are not optimised away: an empty
    # replay on every device, a bad env id, a bad slot each raise from inside `shard_map`.
    def run(make, call):
        def local(x):
            return _unblock(call(make()))

        step = jax.shard_map(local, mesh=plain_mesh, in_specs=P("devices"), out_specs=P("devices"))
        jax.block_until_ready(eqx.filter_jit(step)(_sharded(jnp.zeros(NUM_DEVICES), plain_mesh)))

    item = {"obs": jnp.zeros(2)}
    one = {"obs": jnp.ones((1, 2))}
    with pytest.raises(eqx.EquinoxRuntimeError, match="empty UniformReplay"):
        run(lambda: dx.UniformReplay(item, 4), lambda b: b.sample(jax.random.key(0), 2))
    with pytest.raises(eqx.EquinoxRuntimeError, match="an env id is out of range"):
        run(lambda: dx.TrajectoryBuffer(item, 2, 4), lambda b: b.add(one, env_ids=jnp.array([7])))
    with pytest.raises(eqx.EquinoxRuntimeError, match="index out of range"):
        run(
            lambda: dx.PrioritisedReplay(item, 4).add_batch(one),
            lambda b: b.set_priorities(jnp.array([3]), jnp.ones(1)),
        )


# ---------------------------------------------------------------------------------------------
# Saving sharded buffers, loading them onto one device


# Saved from four devices and loaded onto one in the default tier
# (test_buffers_saved_from_four_devices_load_onto_one); every buffer type, sharded and round
# tripped, in the slow tier.
@SLOW
@pytest.mark.parametrize("case", BUFFER_CASES, ids=lambda c: c.name)
# Each example compiles a sharded save and a load for its shapes: a fifth of the profile's
# examples (2 in `ci`, 30 in `dev`), per buffer type.
@settings(max_examples=max(2, profile_max_examples() // 5))
@given(
    spec_name=st.sampled_from(SPEC_NAMES),
    max_size=st.sampled_from(MAX_SIZES),
    num_steps=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_sharded_round_trip_loads_onto_one_device(
    tmp_path_factory, case, spec_name, max_size, num_steps, seed
):
    # An `Auto` mesh, so that `batch_step` can index the sharded rows eagerly.
    mesh = jax.make_mesh((NUM_DEVICES,), ("devices",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("devices"))
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    buffers = make_batch(case.make, spec, max_size, NUM_DEVICES)
    for _ in range(num_steps):
        buffers = batch_step(case, buffers, spec, rng, NUM_DEVICES)
    buffers = jax.device_put(buffers, sharding)
    assert all(len(leaf.sharding.device_set) == NUM_DEVICES for leaf in jax.tree.leaves(buffers))
    path = tmp_path_factory.mktemp("sharded") / "buffers.dx"
    dx.save(path, buffers)
    loaded = dx.load(path, like=make_batch(case.make, spec, max_size, NUM_DEVICES))
    assert on_default_device(loaded)  # one device, whatever layout it was saved from
    assert_bits_equal(loaded, buffers)
    # Placed again, it carries on like the original.
    step_seed = int(rng.integers(2**32))
    resharded = jax.device_put(loaded, sharding)
    after = batch_step(case, buffers, spec, np.random.default_rng(step_seed), NUM_DEVICES)
    again = batch_step(case, resharded, spec, np.random.default_rng(step_seed), NUM_DEVICES)
    assert_bits_equal(again, after)


def test_buffers_saved_from_four_devices_load_onto_one(mesh, sharding, tmp_path):
    buffers = anakin.make_buffers(mesh, CAPACITY)
    rng = np.random.default_rng(2)
    for t in range(6):
        items = jax.device_put(_host_items(t, rng), sharding)
        buffers, _ = _anakin_step(buffers, items, jax.random.key(t), sharding)
    dx.save(tmp_path / "sharded.dx", buffers)
    like = eqx.filter_vmap(lambda: dx.UniformReplay(anakin.ITEM, CAPACITY), axis_size=4)()
    loaded = dx.load(tmp_path / "sharded.dx", like=like)
    leaves, saved = jax.tree.leaves(loaded), jax.tree.leaves(buffers)
    assert len(leaves) == len(saved)
    for leaf, want in zip(leaves, saved):
        assert leaf.sharding.device_set == {jax.devices()[0]}
        assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype)
        assert np.asarray(leaf).tobytes() == np.asarray(want).tobytes()
    sizes = eqx.filter_vmap(lambda buffer: buffer.size)(loaded)
    assert np.asarray(sizes).tolist() == [CAPACITY] * 4


# ---------------------------------------------------------------------------------------------
# The docs' snippets, with four devices


# Every block of the guide also runs in tests/test_docs.py, on the same four devices (its first
# in the default tier, every one in the slow tier); here, in the slow tier.
@SLOW
@pytest.mark.parametrize("block", python_blocks((ROOT / "docs" / "sharding.md").read_text()))
def test_sharding_docs_snippets_run(block):
    exec(compile(block, "docs/sharding.md", "exec"), {})


# ---------------------------------------------------------------------------------------------
# orbax: a training state holding sharded buffers, saved asynchronously, restored elsewhere


class _TrainState(eqx.Module):
    streams: dx.PrioritisedTrajectoryBuffer  # envs sharded over the mesh
    replays: dx.UniformReplay  # a batch of NUM_DEVICES replays, one per device
    step: jax.Array  # replicated


def _state_shardings(state: _TrainState, mesh) -> _TrainState:
    """Where each leaf goes on `mesh`: the streams' env axis and the replay batch axis along
    the mesh's one axis; the priorities (sum tree, scalars) replicated."""
    split, whole = NamedSharding(mesh, P(mesh.axis_names[0])), NamedSharding(mesh, P())
    every = lambda tree, sharding: jax.tree.map(lambda _: sharding, tree)  # noqa: E731
    streams = state.streams
    return _TrainState(
        streams=eqx.tree_at(
            lambda b: (b.trajectories, b.priorities),
            streams,
            (every(streams.trajectories, split), every(streams.priorities, whole)),
        ),
        replays=every(state.replays, split),
        step=cast(Any, whole),  # the state's shape, with shardings for leaves
    )


@SLOW
def test_orbax_checkpoints_sharded_buffers_and_restores_them_on_other_meshes(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    auto = (AxisType.Auto,)  # XLA places the gathers of an eager sample
    mesh4 = jax.make_mesh((NUM_DEVICES,), ("devices",), axis_types=auto)
    window = dx.Window(4, burn_in=1, bootstrap=1, period=2, strict=True)
    streams = dx.PrioritisedTrajectoryBuffer(TRAJ_ITEM, TRAJ_ENVS, CAPACITY, window)
    rng = np.random.default_rng(5)
    add = jax.jit(lambda b, steps: b.add(steps))
    for _ in range(45):  # past the wrap of the 37 slots
        streams = add(streams, _traj_steps(rng))
    out = streams.sample(jax.random.key(0), 8)
    streams = streams.set_priorities(out.sample.env, out.sample.start, jnp.arange(8.0) + 0.5)
    replays = make_batch(dx.UniformReplay, {"x": jnp.zeros(3)}, 16, NUM_DEVICES)
    replays = eqx.filter_vmap(lambda r, x: r.add_batch({"x": x}))(
        replays, jnp.arange(NUM_DEVICES * 5 * 3.0).reshape(NUM_DEVICES, 5, 3)
    )
    state = _TrainState(streams, replays, jnp.asarray(7, jnp.int32))
    state = jax.device_put(state, _state_shardings(state, mesh4))
    assert state.streams.trajectories.data["obs"].sharding.spec == P("devices")

    checkpointer = ocp.StandardCheckpointer()  # asynchronous: save returns before the write
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()

    targets = {
        "two devices": jax.make_mesh((2,), ("half",), axis_types=auto, devices=jax.devices()[:2]),
        "one device": jax.make_mesh((1,), ("one",), axis_types=auto, devices=jax.devices()[:1]),
    }
    for name, mesh in targets.items():
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state,
            _state_shardings(state, mesh),
        )
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
        assert_bits_equal(restored, state)
        for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
            assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim), name
        # The restored buffers are buffers: the same sample as the state that was saved.
        sample = jax.jit(lambda b: b.sample(jax.random.key(1), 8))
        assert_bits_equal(sample(restored.streams), sample(state.streams))
    checkpointer.close()
