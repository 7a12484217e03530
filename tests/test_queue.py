"""`TrajectoryQueue` against a model of per-env FIFO queues, and `extend` against `add`."""

from collections import deque

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule, RuleBasedStateMachine

from .helpers import machine_tests


PROTOTYPE = {"env": jnp.zeros((), jnp.int32), "pos": jnp.zeros((), jnp.int32)}
NUM_ENVS, MAX_LENGTH = 3, 5

_add = eqx.filter_jit(lambda q, x, i: q.add(x, env_ids=i))
_extend = eqx.filter_jit(lambda q, x: q.extend(x))
_pop = eqx.filter_jit(lambda q, n: q.pop(n))


class QueueMachine(RuleBasedStateMachine):
    """Each env's queue is a deque of its unread steps; a step is `(env, number)`."""

    @initialize()
    def init(self):
        self.queue = dx.TrajectoryQueue(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
        self.model = [deque() for _ in range(NUM_ENVS)]
        self.count = [0] * NUM_ENVS

    def _steps(self, env_ids, length):
        pos = np.asarray([[self.count[e] + t for t in range(length)] for e in env_ids], np.int32)
        env = np.repeat(np.asarray(env_ids, np.int32)[:, None], length, axis=1)
        return {"env": env, "pos": pos}

    def _append(self, env_ids, length):
        for e in env_ids:
            self.model[e].extend((e, self.count[e] + t) for t in range(length))
            self.count[e] += length

    @rule(data=st.data())
    def add(self, data):
        env_ids = data.draw(st.lists(st.integers(0, NUM_ENVS - 1), unique=True, min_size=1))
        steps = jax.tree.map(lambda x: x[:, 0], self._steps(env_ids, 1))
        if any(len(self.model[e]) == MAX_LENGTH for e in env_ids):
            with pytest.raises(RuntimeError, match="no room for 1 more step"):
                _add(self.queue, steps, np.asarray(env_ids, np.int32))
            return
        self.queue = _add(self.queue, steps, np.asarray(env_ids, np.int32))
        self._append(env_ids, 1)

    @rule(length=st.sampled_from([2, 4]))
    def extend(self, length):
        everyone = list(range(NUM_ENVS))
        steps = self._steps(everyone, length)
        fits = all(len(q) + length <= MAX_LENGTH for q in self.model)
        assert bool(self.queue.can_add(length)) == fits
        if not fits:
            with pytest.raises(RuntimeError, match=f"no room for {length} more steps"):
                _extend(self.queue, steps)
            return
        self.queue = _extend(self.queue, steps)
        self._append(everyone, length)

    @rule(length=st.sampled_from([1, 3]))
    def pop(self, length):
        ready = all(len(q) >= length for q in self.model)
        assert bool(self.queue.can_pop(length)) == ready
        if not ready:
            with pytest.raises(RuntimeError, match=f"fewer than {length} unread step"):
                _pop(self.queue, length)
            return
        items, self.queue = _pop(self.queue, length)
        want = [[self.model[e].popleft() for _ in range(length)] for e in range(NUM_ENVS)]
        assert items["env"].tolist() == [[e for e, _ in row] for row in want]
        assert items["pos"].tolist() == [[p for _, p in row] for row in want]

    @invariant()
    def same_unread(self):
        if hasattr(self, "queue"):
            assert self.queue.unread.tolist() == [len(q) for q in self.model]


TestQueueMachine, TestQueueMachineFull = machine_tests(QueueMachine)


def test_extend_longer_than_the_queue_is_refused_at_once():
    queue = dx.TrajectoryQueue(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    steps = jax.tree.map(lambda x: jnp.zeros((NUM_ENVS, MAX_LENGTH + 1), x.dtype), PROTOTYPE)
    with pytest.raises(ValueError, match="6 steps per env do not fit in a queue of max_length"):
        queue.extend(steps)
    with pytest.raises(ValueError, match="sequence_length"):
        queue.pop(MAX_LENGTH + 1)


@pytest.mark.parametrize(
    "env_ids, length",
    [(None, 3), (None, 11), ([2, 0], 4), ([1], 1)],
    ids=["all-3", "all-wrapping-twice", "some-4", "one-1"],
)
def test_extend_is_length_adds(env_ids, length):
    """`extend` of T steps leaves the same buffer as T calls of `add`, across the wrap."""
    rng = np.random.default_rng(0)
    a = b = dx.TrajectoryBuffer(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    ids = None if env_ids is None else np.asarray(env_ids, np.int32)
    n = NUM_ENVS if env_ids is None else len(env_ids)
    for _ in range(3):
        steps = {
            "env": rng.integers(0, 9, (n, length)).astype(np.int32),
            "pos": rng.integers(0, 9, (n, length)).astype(np.int32),
        }
        a = a.extend(steps, ids)
        for t in range(length):
            b = b.add(jax.tree.map(lambda x: x[:, t], steps), ids)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)


def test_extend_checks_its_ids_and_shapes():
    buf = dx.TrajectoryBuffer(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    steps = jax.tree.map(lambda x: jnp.zeros((2, 3), x.dtype), PROTOTYPE)
    with pytest.raises(RuntimeError, match="occurs more than once"):
        buf.extend(steps, np.asarray([1, 1], np.int32))
    with pytest.raises(ValueError, match="two leading axes"):
        buf.extend(jax.tree.map(lambda x: jnp.zeros(2, x.dtype), PROTOTYPE))
    with pytest.raises(ValueError, match="steps for every env"):
        buf.extend(steps)


def test_a_queue_is_popped_and_a_trajectory_buffer_sampled():
    # Every trajectory buffer has the same surface; the calls that do not apply to one refuse
    # at once, naming the call and the one to use.
    queue = dx.TrajectoryQueue(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    key, window = jax.random.key(0), dx.Window(2)
    with pytest.raises(TypeError, match=r"`TrajectoryQueue.sample`: .* read it with `pop`"):
        queue.sample(key, 4, window)
    with pytest.raises(TypeError, match=r"`TrajectoryQueue.read`: .* does not read windows"):
        queue.read(np.zeros(1, np.int32), np.zeros(1, np.int32), window)
    with pytest.raises(TypeError, match=r"`TrajectoryQueue.set_priorities`: .* no priorities"):
        queue.set_priorities(np.zeros(1, np.int32), np.zeros(1, np.int32), jnp.ones(1))
    buf = dx.TrajectoryBuffer(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    with pytest.raises(TypeError, match=r"`TrajectoryBuffer.pop`: .* sampled \(`sample`\)"):
        buf.pop(2)
    with pytest.raises(TypeError, match=r"`TrajectoryBuffer.can_pop`: .* sampled \(`sample`\)"):
        buf.can_pop(2)
