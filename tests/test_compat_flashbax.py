"""`dejax_eqx.compat.flashbax` on its own (flashbax's own tests run against it in
`.ci/run`, see tests/flashbax_upstream.py): where it is stricter than flashbax, where it differs
on purpose (the mixer's exact shares), and that it runs under `jit` with donation, `vmap` and
`scan`. None of these needs flashbax installed."""

import dejax_eqx.compat.flashbax as fbx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import assert_frequencies


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
