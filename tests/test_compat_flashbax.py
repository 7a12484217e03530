"""`dejax_eqx.compat.flashbax` on its own (flashbax's own tests run against it in
`.ci/run`, see tests/flashbax_upstream.py): where it is stricter than flashbax, where it differs
on purpose (the mixer's exact shares), and that it runs under `jit` with donation, `vmap` and
`scan`. None of these needs flashbax installed."""

import re

import dejax_eqx.compat.flashbax as fbx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import assert_frequencies, SLOW


STEP = {"obs": jnp.zeros(2), "t": jnp.zeros((), jnp.int32)}


def _rollout(rows: int, start: int, length: int) -> dict[str, jax.Array]:
    """Steps `start .. start + length - 1` of each row; `t` is `1000 * row + step`."""
    t = 1000 * jnp.arange(rows)[:, None] + jnp.arange(start, start + length)[None, :]
    return {"obs": jnp.stack([t, -t], axis=-1).astype(jnp.float32), "t": t.astype(jnp.int32)}


def test_trajectory_buffer_counts_the_period_from_the_oldest_step_as_flashbax_does():
    # 2 rows of 10 steps, adds of 3, windows of 4 on a period of 3: after 5 adds (15 steps) the
    # rows hold steps 5..14, and flashbax's starts are 5, 8, 11 (oldest + k * period, whole
    # windows), where dx.TrajectoryBuffer's own would be 6 and 9 (multiples of the period).
    buffer = fbx.make_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=4096,
        sample_sequence_length=4,
        period=3,
        min_length_time_axis=4,
        max_length_time_axis=10,
    )
    state = buffer.init(STEP)
    add = jax.jit(buffer.add, donate_argnums=0)
    for i in range(5):
        state = add(state, _rollout(2, 3 * i, 3))
    assert int(state.current_index) == 5 and bool(state.is_full)
    t = np.asarray(jax.jit(buffer.sample)(state, jax.random.key(0)).experience["t"])
    assert (np.diff(t, axis=1) == 1).all()  # whole windows of consecutive steps of one row
    outcomes = [0, 3, 6, 1000, 1003, 1006]  # (row, start - 5)
    first = t[:, 0] - 5
    assert set(first.tolist()) <= set(outcomes)
    # Uniform over the 6 (row, start) pairs; false-failure rate 1e-6.
    assert_frequencies([np.sum(first == o) for o in outcomes], [1 / 6] * 6)


def test_sampling_too_early_raises_where_flashbax_returned_zeros():
    buffer = fbx.make_trajectory_buffer(
        add_batch_size=2,
        sample_batch_size=3,
        sample_sequence_length=4,
        period=1,
        min_length_time_axis=4,
        max_length_time_axis=8,
    )
    state = buffer.add(buffer.init(STEP), _rollout(2, 0, 3))
    assert not bool(buffer.can_sample(state))
    # Under plain `jax.jit`, as flashbax users call it, the error surfaces as JAX's own.
    with pytest.raises(jax.errors.JaxRuntimeError, match="fewer than sequence_length = 4 steps"):
        jax.jit(buffer.sample)(state, jax.random.key(0))
    with pytest.raises(ValueError, match="9 steps per row do not fit"):
        buffer.add(state, _rollout(2, 3, 9))


def test_flat_and_item_buffers_in_a_donated_scan():
    flat = fbx.make_flat_buffer(max_length=16, min_length=4, sample_batch_size=5, add_batch_size=2)
    items = fbx.make_item_buffer(max_length=8, min_length=1, sample_batch_size=5)

    @jax.jit
    def run(states, key):
        def body(states, i):
            f, it = states
            step = jax.tree.map(lambda x: x[:, 0], _rollout(2, 0, 1))
            step = jax.tree.map(lambda x: x + i.astype(x.dtype), step)
            return (flat.add(f, step), items.add(it, jax.tree.map(lambda x: x[0], step))), None

        states = jax.lax.scan(body, states, jnp.arange(10))[0]
        return states, flat.sample(states[0], key), items.sample(states[1], key)

    states = (flat.init(STEP), items.init(STEP))
    (f, it), pair, item = jax.jit(run, donate_argnums=0)(states, jax.random.key(1))
    first, second = np.asarray(pair.experience.first["t"]), np.asarray(pair.experience.second["t"])
    assert (second == first + 1).all() and first.shape == (5,)
    assert set((first % 1000).tolist()) <= set(range(2, 9))  # 8 steps per row: 2..9
    assert set(np.asarray(item.experience["t"]).tolist()) <= set(range(2, 10))
    assert int(fbx.utils.get_timestep_count(f)) == 16 and int(fbx.utils.get_timestep_count(it)) == 8


def test_queue_refuses_to_overwrite_or_over_read():
    queue = fbx.make_trajectory_queue(
        max_length_time_axis=6, add_batch_size=2, add_sequence_length=4, sample_sequence_length=3
    )
    state = queue.add(queue.init(STEP), _rollout(2, 0, 4))
    assert not bool(queue.can_add(state)) and bool(queue.can_sample(state))
    add = eqx.filter_jit(queue.add)
    with pytest.raises(eqx.EquinoxRuntimeError, match="would overwrite unread ones"):
        add(state, _rollout(2, 4, 4))
    state, sample = eqx.filter_jit(queue.sample)(state)
    assert np.asarray(sample.experience["t"]).tolist() == [[0, 1, 2], [1000, 1001, 1002]]
    assert (int(state.read_index), int(state.write_index), bool(state.is_full)) == (3, 4, False)
    with pytest.raises(eqx.EquinoxRuntimeError, match="fewer than 3 unread steps"):
        eqx.filter_jit(queue.sample)(state)


def test_mixer_samples_each_buffer_its_exact_share():
    # Shares int(p * 10) for p = 1/4, 3/4: 2 and 7, the remainder to the first: 3 and 7. The
    # second share exceeds its buffer's own sample_batch_size (4): it is drawn, not sliced.
    buffers = [
        fbx.make_item_buffer(max_length=8, min_length=1, sample_batch_size=4, add_batches=True)
        for _ in range(2)
    ]
    states = [
        b.add(b.init(STEP), jax.tree.map(lambda x: x[:, 0], _rollout(4, k, 1)))
        for k, b in zip([0, 500], buffers)
    ]
    mixer = fbx.make_mixer(buffers, sample_batch_size=10, proportions=[1, 3])
    assert bool(jax.jit(mixer.can_sample)(states))
    t = np.asarray(jax.jit(mixer.sample)(states, jax.random.key(2)).experience["t"])
    assert t.shape == (10,)
    assert (t[:3] % 1000 == 0).all() and (t[3:] % 1000 == 500).all()
    with pytest.raises(ValueError, match="2 buffers but 3 proportions"):
        fbx.make_mixer(buffers, 10, [1, 1, 1])


# ---------------------------------------------------------------------------------------------
# Bad input is an error that names flashbax's function: nothing is cast, wrapped or dropped.


def _trajectory(**kwargs):
    args = dict(
        add_batch_size=1,
        sample_batch_size=2,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=8,
    )
    return fbx.make_trajectory_buffer(**{**args, **kwargs})


def _prioritised(**kwargs):
    args = dict(
        add_batch_size=1,
        sample_batch_size=2,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=2,
        max_length_time_axis=8,
    )
    return fbx.make_prioritised_trajectory_buffer(**{**args, **kwargs})


def test_flat_and_item_adds_cast_nothing():
    # flashbax's `add_dim_to_args` (`jnp.expand_dims`) made a float64 float32 and wrapped an
    # int64 before the batch was checked; a Python 1e39 became inf in a float32 leaf.
    flat = fbx.make_flat_buffer(max_length=8, min_length=2, sample_batch_size=2)
    call = "`trajectory_buffer.add`: item leaf `['obs']`"
    state = flat.init({"obs": jnp.zeros(2)})
    with pytest.raises(TypeError, match=re.escape(f"{call} has dtype float64, expected float32")):
        flat.add(state, {"obs": np.ones(2)})
    items = fbx.make_item_buffer(max_length=8, min_length=1, sample_batch_size=2)
    state = items.init({"obs": jnp.zeros(()), "t": jnp.zeros((), jnp.int32)})
    for item, match in [
        ({"obs": np.float64(0.5), "t": np.int32(1)}, "`['obs']` has dtype float64"),
        ({"obs": np.float32(0.5), "t": np.int64(2**32 + 1)}, "`['t']` has dtype int64"),
        ({"obs": 1e39, "t": 1}, "`['obs']` is the Python scalar 1e+39"),
        ({"obs": 0.5, "t": 2**32 + 1}, "`['t']` is the Python scalar 4294967297"),
    ]:
        with pytest.raises((TypeError, ValueError), match=re.escape(match)):
            items.add(state, item)
    # Python scalars the leaves hold, and arrays of their dtypes, are added as flashbax does.
    state = items.add(state, {"obs": 0.5, "t": 7})
    state = items.add(state, {"obs": np.float32(1.5), "t": np.int32(8)})
    assert state.experience["t"][0, :2].tolist() == [7, 8]
    batches = fbx.make_item_buffer(
        max_length=8, min_length=1, sample_batch_size=2, add_batches=True
    )
    state = batches.init({"obs": jnp.zeros(())})
    with pytest.raises(TypeError, match=re.escape("has dtype float64, expected float32")):
        batches.add(state, {"obs": np.ones(3)})
    # The utility itself adds an axis and changes nothing else.
    expand = fbx.utils.add_dim_to_args(lambda s, x: x, axis=0)
    for x in [np.int64(2**32 + 1), np.ones(2), 1e39]:
        out = expand(None, x)
        assert out.dtype == np.asarray(x).dtype and out.tolist() == [np.asarray(x).tolist()]


# A dtype edge case: the slow tier.
@SLOW
def test_set_priorities_checks_indices_and_priorities_in_their_own_dtype():
    buffer = fbx.make_prioritised_item_buffer(max_length=8, min_length=1, sample_batch_size=2)
    state = buffer.init({"obs": jnp.zeros(())})
    for value in [1.0, 2.0, 3.0]:
        state = buffer.add(state, {"obs": value})
    call = "`prioritised_trajectory_buffer.set_priorities`"
    # 2**32 + 1 wrapped to the stored leaf 1.
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(f"{call}: an index names no")):
        buffer.set_priorities(state, np.array([2**32 + 1], np.int64), jnp.array([5.0]))
    msg = re.escape(f"{call}(indices=...)` must be an integer") + "|parameter 'indices'"
    with pytest.raises(TypeError, match=msg):
        buffer.set_priorities(state, jnp.array([0.0]), jnp.array([5.0]))
    # A priority of 2**32 was wrapped to 0 (never drawn again).
    state = buffer.set_priorities(state, jnp.array([0, 1]), np.array([2**32, 2**33], np.int64))
    assert float(state.module.max_priority) == 2.0**33
    masses = fbx.buffers.sum_tree.get_batch(state.sum_tree_state, jnp.array([0, 1]))
    np.testing.assert_allclose(np.asarray(masses), [(2.0**32) ** 0.6, (2.0**33) ** 0.6], rtol=1e-6)
    for priorities, match in [
        (np.array([1e39]), "`priorities` holds a finite value too large for float32"),
        (jnp.array([-1.0]), "priorities must be finite and non-negative"),
    ]:
        with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(f"{call}: {match}")):
            buffer.set_priorities(state, jnp.array([0]), priorities)


def test_sizes_are_checked_by_the_function_given_them():
    # sample_batch_size = 0 returned an empty batch, -1 an MLIRError, 2.5 a shape error;
    # period = 0 a ZeroDivisionError (or named `Window(sequence_length=...)`); so did a
    # queue of 0 rows.
    positive = "must be positive, got"
    for make, name in [
        (_trajectory, "make_trajectory_buffer"),
        (_prioritised, "make_prioritised_trajectory_buffer"),
    ]:
        for value in [0, -1]:
            with pytest.raises(ValueError, match=re.escape(f"`{name}(sample_batch_size=...)`")):
                make(sample_batch_size=value)
        msg = re.escape(f"`{name}(sample_batch_size=...)` must be a Python int")
        with pytest.raises(TypeError, match=msg + "|parameter 'sample_batch_size'"):
            make(sample_batch_size=2.5)
        for arg in ["period", "add_batch_size", "sample_sequence_length"]:
            with pytest.raises(ValueError, match=re.escape(f"`{name}({arg}=...)` {positive} 0")):
                make(**{arg: 0})
    for make, name in [
        (fbx.make_flat_buffer, "make_flat_buffer"),
        (fbx.make_item_buffer, "make_item_buffer"),
        (fbx.make_prioritised_flat_buffer, "make_prioritised_flat_buffer"),
        (fbx.make_prioritised_item_buffer, "make_prioritised_item_buffer"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"`{name}(sample_batch_size=...)`")):
            make(max_length=8, min_length=2, sample_batch_size=0)
    with pytest.raises(ValueError, match=re.escape("`make_trajectory_queue(add_batch_size=...)`")):
        fbx.make_trajectory_queue(
            max_length_time_axis=8,
            add_batch_size=0,
            add_sequence_length=2,
            sample_sequence_length=2,
            max_size=16,
        )
    module = fbx.prioritised_trajectory_buffer
    call = "prioritised_trajectory_buffer.prioritised_init"
    with pytest.raises(ValueError, match=re.escape(f"`{call}(period=...)` {positive} 0")):
        module.prioritised_init(STEP, 1, 8, 0)
    # The module-level functions check what they are given too.
    buffer = _trajectory()
    state = buffer.add(buffer.init(STEP), _rollout(1, 0, 4))
    call = "trajectory_buffer.sample"
    with pytest.raises(ValueError, match=re.escape(f"`{call}(batch_size=...)` {positive} 0")):
        fbx.trajectory_buffer.sample(state, jax.random.key(0), 0, 2, 1)
    state = module.prioritised_add(
        module.prioritised_init(STEP, 1, 8, 1), _rollout(1, 0, 4), 2, 1, "cpu"
    )
    call = "prioritised_trajectory_buffer.prioritised_sample"
    with pytest.raises(ValueError, match=re.escape(f"`{call}(batch_size=...)` {positive} 0")):
        module.prioritised_sample(state, jax.random.key(0), 0, 2, 1)


def test_sum_tree_reads_refuse_what_is_not_a_leaf():
    # `get` past the last leaf returned 0; `get_probability` of an empty tree 0 / 0 = NaN.
    sum_tree = fbx.buffers.sum_tree
    buffer = _prioritised()
    empty = buffer.init(STEP)
    with pytest.raises(eqx.EquinoxRuntimeError, match="`sum_tree.get_probability`: every leaf"):
        sum_tree.get_probability(empty.sum_tree_state, jnp.array([0]))
    state = buffer.add(empty, _rollout(1, 0, 4))
    tree = state.sum_tree_state
    assert sum_tree.get(tree, jnp.array([0, 2])).tolist() == [1.0, 1.0]
    np.testing.assert_allclose(sum_tree.get_probability(tree, jnp.array([0])), [1 / 3])
    for read in ["get", "get_batch", "get_probability"]:
        for index in [jnp.array([8]), jnp.array([-1]), np.array([2**32], np.int64)]:
            with pytest.raises(
                eqx.EquinoxRuntimeError,
                match=re.escape(f"`sum_tree.{read}`: index out of range; every index must"),
            ):
                getattr(sum_tree, read)(tree, index)


def test_mixer_refuses_buffers_of_two_kinds_in_either_order():
    plain, prioritised = _trajectory(), _prioritised()
    for buffers in [[plain, prioritised], [prioritised, plain]]:
        with pytest.raises(TypeError, match="all buffers must be of one type"):
            fbx.make_mixer(buffers, 4, [1, 1])
    # A proportion too large for a float (an OverflowError that named nothing).
    with pytest.raises(ValueError, match=re.escape("`make_mixer`: proportions[1] is a Python")):
        fbx.make_mixer([plain, plain], 4, [1, 10**400])
    with pytest.raises(ValueError, match="sum past the largest float"):
        fbx.make_mixer([plain, plain], 4, [1e308, 1e308])
