"""Lock-step use of `TrajectoryBuffer` against flashbax 0.1.3's trajectory buffer, run side by
side on the same data (docs/sequences.md, "From flashbax's trajectory buffer")."""

import contextlib
import importlib.util

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import assert_frequencies


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashbax") is None, reason="needs flashbax (the benchmarks extra)"
)

# 3 envs (flashbax's rows) of 12 steps, adds of 2 steps, windows of 4 on a period of 2: the
# period divides both the add length and the time axis, where the docs say the two agree
# after the ring wraps too.
E, N, T, L, P = 3, 12, 2, 4, 2
DRAWS = 2**14


@contextlib.contextmanager
def _flashbax_config():
    # flashbax's own code broadcasts ranks and promotes dtypes implicitly, which the test
    # configuration (conftest.py) refuses for ours.
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


def _batch(i):
    """Add `i`: steps `i*T .. i*T + T - 1` of every env, labelled `(env, step)`."""
    env = np.repeat(np.arange(E, dtype=np.int32)[:, None], T, axis=1)
    pos = np.broadcast_to(np.arange(i * T, (i + 1) * T, dtype=np.int32), (E, T))
    return {"env": env, "pos": pos.copy()}


def _windows(experience):
    """The `(env, start)` of each sampled window, after checking it is consecutive steps."""
    env, pos = np.asarray(experience["env"]), np.asarray(experience["pos"])
    assert (env == env[:, :1]).all() and (pos == pos[:, :1] + np.arange(L)).all()
    return list(zip(env[:, 0].tolist(), pos[:, 0].tolist()))


def test_lock_step_matches_flashbax():
    import flashbax as fbx

    step = {"env": jnp.zeros((), jnp.int32), "pos": jnp.zeros((), jnp.int32)}
    fb = fbx.make_trajectory_buffer(
        add_batch_size=E,
        sample_batch_size=DRAWS,
        sample_sequence_length=L,
        period=P,
        min_length_time_axis=L,
        max_length_time_axis=N,
    )
    with _flashbax_config():
        state = fb.init(step)
    buf = dx.TrajectoryBuffer(step, num_envs=E, max_length=N)
    add = jax.jit(lambda b, x: jax.lax.scan(lambda b, s: (b.add(s), None), b, x)[0])
    window = dx.Window(L, period=P, strict=True)
    sample = jax.jit(lambda b, k: b.sample(k, DRAWS, window))
    # Checked twice: after 4 adds (8 steps in 12 slots) and after 11 (every ring wrapped).
    for adds in range(1, 12):
        batch = _batch(adds - 1)
        with _flashbax_config():
            state = fb.add(state, batch)
        buf = add(buf, jax.tree.map(lambda x: np.swapaxes(x, 0, 1), batch))
        if adds in (4, 11):
            _check_the_same(fb, state, buf, sample, adds)


def _check_the_same(fb, state, buf, sample, adds):
    # The same storage: step s of each row at slot s mod N.
    for name in ("env", "pos"):
        assert (np.asarray(state.experience[name]) == np.asarray(buf.data[name])).all(), name
    assert int(state.current_index) == int(buf.head[0])
    assert bool(state.is_full) == bool(buf.lengths()[0] == N)
    ours = sample(buf, jax.random.key(adds))
    with _flashbax_config():
        theirs = fb.sample(state, jax.random.key(100 + adds)).experience
    got, want = _windows(ours.items), _windows(theirs)
    assert list(zip(ours.env.tolist(), ours.start.tolist())) == got
    # The same support: every admissible start, as both buffers draw them...
    support = sorted(set(want))
    assert sorted(set(got)) == support
    count = adds * T
    assert support == [
        (e, s) for e in range(E) for s in range(max(0, count - N), count - L + 1) if s % P == 0
    ]
    # ... and the same law, uniform over it (false-failure rate 1e-6 for each buffer).
    index = {cell: i for i, cell in enumerate(support)}
    uniform = np.full(len(support), 1 / len(support))
    for draws in (got, want):
        counts = np.bincount([index[c] for c in draws], minlength=len(support))
        assert_frequencies(counts, uniform)
