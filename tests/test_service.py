"""ReplayService: actor and learner threads around one buffer, under the rate law.

Every wait in these tests is bounded: threads are joined with a timeout and checked dead, and
a thread that must be blocked before the test goes on is seen entering
`threading.Condition.wait` (a profile hook), not given time to get there.
"""

import sys
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx import (
    PolicyAge,
    RateLimited,
    RateLimiter,
    RateLimitTimeout,
    ReplayService,
    ServiceClosed,
    WaitCannotEnd,
)
from dejax_eqx._abstract import Source
from dejax_eqx._rates import Rate
from dejax_eqx._service import inserts_needed, samples_needed

from .helpers import SLOW


JOIN = 60.0  # seconds: a thread still alive after this is a hang, and fails the test
PREFIX = "test-service-"
ITEM = {"actor": jnp.zeros((), jnp.int32), "seq": jnp.zeros((), jnp.int32)}
STEP = {"env": jnp.zeros((), jnp.int32), "t": jnp.zeros((), jnp.int32)}


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith(PREFIX)]
    assert not left, f"threads left behind: {left}"


class Threads:
    """Threads that record what they raise, joined with a timeout."""

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self.errors: dict[str, BaseException] = {}

    def start(self, name: str, target: Callable[[], Any]) -> threading.Thread:
        def run():
            try:
                target()
            except BaseException as error:
                self.errors[name] = error

        thread = threading.Thread(target=run, name=PREFIX + name, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def join(self) -> dict[str, BaseException]:
        for thread in self.threads:
            thread.join(JOIN)
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"threads still running after {JOIN} s: {alive}"
        return self.errors


def start_blocked(threads: Threads, name: str, target: Callable[[], Any]) -> None:
    """Start `target` in a thread and return once it waits on a condition (the service's)."""
    waiting = threading.Event()
    wait_code = threading.Condition.wait.__code__

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is wait_code:
            waiting.set()

    def run():
        sys.setprofile(hook)
        try:
            target()
        finally:
            sys.setprofile(None)

    threads.start(name, run)
    assert waiting.wait(JOIN), f"{name} never waited"


def uniform_service(limiter: RateLimiter, max_size: int = 512, **kwargs) -> ReplayService:
    return ReplayService(RateLimited(dx.UniformReplay(ITEM, max_size), limiter), **kwargs)


def items(actor: int, start: int, n: int) -> dict[str, np.ndarray]:
    return {
        "actor": np.full(n, actor, np.int32),
        "seq": np.arange(start, start + n, dtype=np.int32),
    }


def stored(buffer: dx.UniformReplay) -> list[tuple[int, int]]:
    size = int(buffer.size)
    data = jax.tree.map(np.asarray, buffer.storage.data)
    return sorted(zip(data["actor"][:size].tolist(), data["seq"][:size].tolist()))


# ---------------------------------------------------------------------------------------------
# Actors and a learner


def test_actors_and_learner():
    """8 actors insert 12 batches each while a learner samples: every item is counted once
    and stored once, the balance stays in the window at every learner step, the learner
    drains what the law allows and stops on `WaitCannotEnd`, and no thread is left."""
    actors, batches, per_batch, rows = 8, 12, 4, 8
    limiter = RateLimiter.sample_to_insert_ratio(
        1, 16, 24, insert_batch_size=per_batch, sample_batch_size=rows
    )
    service = uniform_service(limiter)
    rate = service.rate
    steps: list[tuple[int, int]] = []
    sampled: list[np.ndarray] = []

    def actor(membership, a):
        with membership:
            for b in range(batches):
                service.add_batch(items(a, b * per_batch, per_batch), timeout=JOIN)

    def learner():
        key = jax.random.key(0)
        with service.learner():
            while True:
                key, sub = jax.random.split(key)
                try:
                    batch = service.sample(sub, rows, timeout=JOIN)
                except WaitCannotEnd:
                    return
                steps.append(service.counts())
                sampled.append(np.stack([batch["actor"], batch["seq"]], axis=1))

    threads = Threads()
    members = [service.actor() for _ in range(actors)]  # before any actor can finish
    for a, membership in enumerate(members):
        threads.start(f"actor-{a}", lambda m=membership, a=a: actor(m, a))
    threads.start("learner", learner)
    assert threads.join() == {}

    total = actors * batches * per_batch
    inserts, samples = service.counts()
    assert inserts == total and samples == rows * len(steps)
    expected = sorted((a, s) for a in range(actors) for s in range(batches * per_batch))
    snapshot = service.snapshot()
    assert stored(snapshot.buffer) == expected  # each item exactly once
    assert snapshot.limiter.counts() == (inserts, samples)
    assert not rate.can_sample(inserts, samples, rows)  # drained
    assert rate.scaled_min is not None and rate.scaled_max is not None
    for i, s in steps:
        assert i >= rate.min_size_to_sample
        assert rate.scaled_min <= rate.balance(i, s) <= rate.scaled_max, (i, s)
    assert {tuple(row) for row in np.concatenate(sampled).tolist()} <= set(expected)
    service.close()


# A service over a trajectory buffer fed env subsets: the slow tier.
@SLOW
def test_trajectory_buffer_from_envpool_like_subsets():
    """Two actors step 4 envs each in envpool's async mode (each `recv()` returns 2 of them,
    a random pair): the steps are counted, each env's stream holds its steps in order, and the
    learner's windows and mixed batches come from them."""
    num_envs, per_recv, recvs, rows = 8, 2, 20, 4
    limiter = RateLimiter.sample_to_insert_ratio(
        Fraction(1, 2), 8, 16, insert_batch_size=per_recv, sample_batch_size=rows
    )
    buffer = dx.TrajectoryBuffer(STEP, num_envs=num_envs, max_length=64)
    service = ReplayService(RateLimited(buffer, limiter))
    listed = np.zeros(num_envs, np.int64)
    windows: list[Any] = []

    def actor(membership, envs, seed):
        rng = np.random.default_rng(seed)
        with membership:
            for _ in range(recvs):
                env_ids = rng.choice(envs, per_recv, replace=False).astype(np.int32)
                steps = {"env": env_ids, "t": listed[env_ids].astype(np.int32)}
                service.add(steps, env_ids, timeout=JOIN)
                listed[env_ids] += 1  # each env belongs to one actor

    def learner():
        key = jax.random.key(1)
        with service.learner():
            while True:
                key, sub = jax.random.split(key)
                try:
                    if len(windows) % 2:
                        out = service.sample(sub, rows, dx.Window(4), timeout=JOIN)
                    else:
                        mixed: dict[Source, int] = {"replay": 2, "online": 2}
                        out = service.sample(sub, 4, dx.Window(4), source=mixed, timeout=JOIN)
                except WaitCannotEnd:
                    return
                windows.append(out)

    threads = Threads()
    members = [service.actor() for _ in range(2)]
    threads.start("actor-0", lambda: actor(members[0], np.arange(4), 0))
    threads.start("actor-1", lambda: actor(members[1], np.arange(4, 8), 1))
    threads.start("learner", learner)
    assert threads.join() == {}

    inserts, samples = service.counts()
    assert inserts == 2 * recvs * per_recv == listed.sum()
    assert samples == rows * len(windows) and windows
    assert not service.rate.can_sample(inserts, samples, rows)
    out = service.snapshot().buffer
    assert out.step_count.tolist() == listed.tolist()
    for env in range(num_envs):
        assert out.data["env"][env, : listed[env]].tolist() == [env] * listed[env]
        assert out.data["t"][env, : listed[env]].tolist() == list(range(listed[env]))
    for w in windows:
        env = np.asarray(w.env)[:, None] * np.ones_like(np.asarray(w.mask))
        assert np.array_equal(np.asarray(w.items["env"])[w.mask], env[w.mask])
    service.close()


# ---------------------------------------------------------------------------------------------
# Waiting: timeouts, close, WaitCannotEnd


def small_limiter() -> RateLimiter:
    """Sampling from 4 items; the balance `inserts - samples` within [0, 8]."""
    return RateLimiter.sample_to_insert_ratio(1, 4, 4, insert_batch_size=2, sample_batch_size=2)


def test_timeouts_say_who_waits_for_what():
    service = uniform_service(small_limiter())
    key = jax.random.key(0)
    with pytest.raises(RateLimitTimeout) as caught:
        service.sample(key, 2, timeout=0.01)
    message = str(caught.value)
    assert message.startswith(
        "`ReplayService.sample`: timed out after 0.01 s: the learner waits for 4 more"
    )
    assert "to sample 2 rows (inserts = 0, samples = 0; samples_per_insert = 1" in message
    for k in range(4):  # 8 items, a balance of 8: the most
        service.add_batch(items(0, 2 * k, 2), timeout=0.0)
    with pytest.raises(RateLimitTimeout, match="the actor waits for 2 more samples to insert 2"):
        service.add_batch(items(0, 8, 2), timeout=0.01)
    with pytest.raises(RateLimitTimeout, match=r"waits for 1 more sample to insert 1 item \("):
        service.add({"actor": np.int32(0), "seq": np.int32(8)}, timeout=0.0)
    assert service.counts() == (8, 0)  # the timeouts counted nothing
    service.sample(key, 2, timeout=0.0)
    service.add_batch(items(0, 8, 2), timeout=0.0)
    assert service.counts() == (10, 2)
    with pytest.raises(ValueError, match="timeout"):
        service.sample(key, 2, timeout=-1.0)
    service.close()


def test_close_wakes_a_blocked_sampler_and_a_blocked_inserter():
    starved = uniform_service(small_limiter())
    full = uniform_service(small_limiter())
    for k in range(4):
        full.add_batch(items(0, 2 * k, 2))
    threads, key = Threads(), jax.random.key(0)
    start_blocked(threads, "sampler", lambda: starved.sample(key, 2, timeout=JOIN))
    start_blocked(threads, "inserter", lambda: full.add_batch(items(0, 8, 2), timeout=JOIN))
    starved.close()
    full.close()
    errors = threads.join()
    assert isinstance(errors["sampler"], ServiceClosed)
    assert isinstance(errors["inserter"], ServiceClosed)
    assert "`ReplayService.sample`: the service is closed." == str(errors["sampler"])
    with pytest.raises(ServiceClosed):
        full.add_batch(items(0, 8, 2))
    with pytest.raises(ServiceClosed):
        full.actor()
    with pytest.raises(ServiceClosed):
        full.update(lambda b: b)
    assert full.counts() == (8, 0)
    assert len(stored(full.snapshot().buffer)) == 8  # still answers
    full.close()  # twice is fine


def test_learner_waiting_when_every_actor_has_stopped():
    service = uniform_service(small_limiter())
    key = jax.random.key(0)
    with service.actor():
        service.add_batch(items(0, 0, 2))
    with pytest.raises(WaitCannotEnd) as caught:  # at once: no timeout needed
        service.sample(key, 2)
    assert str(caught.value) == (
        "`ReplayService.sample`: the learner waits for 2 more inserts to sample 2 rows, but "
        "every actor has stopped (inserts = 2, samples = 0; samples_per_insert = 1, "
        "min_size_to_sample = 4, min_diff = 0, max_diff = 8)."
    )
    # A blocked learner is woken when the last actor leaves.
    membership = service.actor()
    threads = Threads()
    start_blocked(threads, "learner", lambda: service.sample(key, 2, timeout=JOIN))
    with membership:
        service.add_batch(items(0, 2, 1))
    assert isinstance(threads.join()["learner"], WaitCannotEnd)
    assert service.counts() == (3, 0)
    # While an actor is in, and after it has added enough, the learner proceeds.
    with service.actor():
        service.add_batch(items(1, 0, 2))
        service.sample(key, 2)
    service.close()


def test_close_inserts():
    service = uniform_service(small_limiter())
    service.add_batch(items(0, 0, 2))  # no participant ever joins
    threads, key = Threads(), jax.random.key(0)
    start_blocked(threads, "learner", lambda: service.sample(key, 2, timeout=JOIN))
    service.close_inserts()
    error = threads.join()["learner"]
    assert isinstance(error, WaitCannotEnd) and "inserts were closed" in str(error)
    with pytest.raises(ServiceClosed, match="inserts were closed"):
        service.add_batch(items(0, 2, 2))
    with pytest.raises(ServiceClosed, match="inserts were closed"):
        service.actor()
    service.close()


def test_actor_waiting_when_every_learner_has_stopped():
    service = uniform_service(small_limiter())
    with service.learner():
        for k in range(4):
            service.add_batch(items(0, 2 * k, 2))
        threads = Threads()
        start_blocked(threads, "actor", lambda: service.add_batch(items(0, 8, 2), timeout=JOIN))
    error = threads.join()["actor"]
    assert isinstance(error, WaitCannotEnd)
    assert "the actor waits for 2 more samples to insert 2 items, but every learner" in str(error)
    with pytest.raises(WaitCannotEnd):
        service.add_batch(items(0, 8, 2))
    service.add_batch(items(0, 8, 1), mask=np.zeros(1, bool))
    assert service.counts() == (8, 0)  # an insert of nothing needs no sample
    service.close()


# ---------------------------------------------------------------------------------------------
# Faults roll back


def test_faults_roll_back():
    limiter = RateLimiter.min_size(1)
    for donate in (False, True):
        buffer = dx.TrajectoryBuffer(STEP, num_envs=4, max_length=8)
        service = ReplayService(RateLimited(buffer, limiter), donate=donate)
        steps = {"env": np.array([0], np.int32), "t": np.array([0], np.int32)}
        service.add(steps, np.array([0], np.int32))
        # Trace time: nothing has run, nothing is lost.
        with pytest.raises((TypeError, ValueError), match="TrajectoryBuffer.add"):
            service.add({"env": np.zeros((1, 2), np.int32), "t": steps["t"]}, np.array([1]))
        longer = "`ReplayService.sample`: a window of .* is longer than max_length"
        with pytest.raises(ValueError, match=longer):
            service.sample(jax.random.key(0), 1, dx.Window(9))  # longer than max_length
        assert service.counts() == (1, 0)
        service.sample(jax.random.key(0), 1, dx.Window(1))
        assert service.counts() == (1, 1)
        # Run time: an env id out of range.
        with pytest.raises(eqx.EquinoxRuntimeError, match="an env id is out of range"):
            service.add(steps, np.array([7], np.int32))
        assert service.counts() == (1, 1)
        if donate:  # the fault consumed the buffer: the service has closed
            with pytest.raises(ServiceClosed, match="buffer was lost") as caught:
                service.snapshot()
            assert caught.value.__cause__ is not None
            with pytest.raises(ServiceClosed):
                service.add(steps, np.array([1], np.int32))
        else:
            service.add(steps, np.array([1], np.int32))
            out = service.snapshot()
            assert out.buffer.step_count.tolist() == [1, 1, 0, 0]
            assert out.limiter.counts() == (2, 1) == service.counts()
        service.close()


def test_update_sets_priorities_uncounted():
    buffer = dx.PrioritisedReplay(ITEM, max_size=16)
    service = ReplayService(RateLimited(buffer, RateLimiter.min_size(1)))
    service.add({"actor": np.int32(0), "seq": np.int32(0)})
    indices, priorities = np.array([0], np.int32), np.array([5.0], np.float32)
    service.update(dx.PrioritisedReplay.set_priorities, indices, priorities)
    out = service.snapshot().buffer
    assert float(out.priorities.max_priority) == 5.0
    assert service.counts() == (1, 0)
    with pytest.raises(TypeError, match="must return the buffer it was given"):
        service.update(lambda b: b.size)
    with pytest.raises(TypeError, match="fn"):  # the import hook or the service says so
        service.update(3)  # pyright: ignore[reportArgumentType]
    service.sample(jax.random.key(0), 1)  # still there
    service.close()


def test_sizes_and_kinds_checked_at_the_door():
    service = uniform_service(small_limiter())
    with pytest.raises(ValueError, match="4 items in one call, more than the limiter's"):
        service.add_batch(items(0, 0, 4))
    with pytest.raises(ValueError, match="3 rows in one call"):
        service.sample(jax.random.key(0), 3)
    with pytest.raises(TypeError, match="a replay takes `add` and `add_batch`"):
        service.extend(items(0, 0, 2))
    with pytest.raises(ValueError, match="leading batch axis"):
        service.add_batch({"actor": np.int32(0), "seq": np.int32(0)})
    assert service.counts() == (0, 0)
    service.close()
    queue = dx.TrajectoryQueue(STEP, num_envs=2, max_length=4)
    service = ReplayService(RateLimited(queue, RateLimiter.min_size(1)))
    with pytest.raises(TypeError, match="a TrajectoryQueue is not sampled; read it with `pop`"):
        service.sample(jax.random.key(0), 1)
    with pytest.raises(TypeError, match="a trajectory buffer takes `add` and `extend`"):
        service.add_batch(items(0, 0, 1))
    with pytest.raises(TypeError, match="RateLimited"):
        ReplayService(queue)  # type: ignore[arg-type]
    service.close()


def test_snapshot_is_a_copy_and_resumes():
    service = uniform_service(small_limiter())
    for k in range(2):
        service.add_batch(items(0, 2 * k, 2))
    service.sample(jax.random.key(0), 2)
    saved = service.snapshot()
    service.add_batch(items(0, 4, 2))  # donates the service's value, not the snapshot's
    assert stored(saved.buffer) == [(0, s) for s in range(4)]
    assert saved.limiter.counts() == (4, 2)
    resumed = ReplayService(saved)
    assert resumed.counts() == (4, 2)
    resumed.add_batch(items(1, 0, 2))
    assert resumed.counts() == (6, 2)
    service.close()
    resumed.close()


def test_extend_counts_envs_times_steps():
    limiter = RateLimiter.sample_to_insert_ratio(1, 4, 8, insert_batch_size=6, sample_batch_size=1)
    buffer = dx.TrajectoryBuffer(STEP, num_envs=4, max_length=8)
    service = ReplayService(RateLimited(buffer, limiter))
    steps = {"env": np.zeros((2, 3), np.int32), "t": np.zeros((2, 3), np.int32)}
    service.extend(steps, env_ids=np.array([0, 2], np.int32))
    assert service.counts() == (6, 0)
    every = {"env": np.zeros((4, 1), np.int32), "t": np.zeros((4, 1), np.int32)}
    service.extend(every)  # every env, one step
    assert service.counts() == (10, 0)
    with pytest.raises(ValueError, match="8 steps in one call"):
        service.extend({"env": np.zeros((4, 2), np.int32), "t": np.zeros((4, 2), np.int32)})
    service.close()


# ---------------------------------------------------------------------------------------------
# The numbers in the messages


@pytest.mark.parametrize(
    "rate",
    [
        Rate.make(1, 4, 0, 8, 2, 2, "test"),
        Rate.make(Fraction(3, 2), 10, Fraction(-7, 3), 20, 3, 2, "test"),
        Rate.make(4, 5, None, 40, 2, 3, "test"),
        Rate.make(1, 3, None, None, 1, 1, "test"),
    ],
)
def test_needed_counts_are_the_fewest(rate: Rate):
    for inserts in range(0, 30, 3):
        for samples in range(0, 40, 5):
            for n in (1, 2, 3):
                k = inserts_needed(rate, inserts, samples, n)
                assert rate.can_sample(inserts + k, samples, n)
                assert k == 0 or not rate.can_sample(inserts + k - 1, samples, n)
                k = samples_needed(rate, inserts, samples, n)
                assert rate.can_insert(inserts, samples + k, n)
                assert k == 0 or not rate.can_insert(inserts, samples + k - 1, n)


def _seq(item):
    return item["seq"]


def test_sample_methods():
    service = uniform_service(small_limiter())
    for k in range(2):
        service.add_batch(items(0, 2 * k, 2))
    age = PolicyAge(_seq, current=3, max_age=1)
    out = service.sample(jax.random.key(0), 2, age=age)
    assert (np.asarray(out.items["seq"]) >= 2).all() and (np.asarray(out.ages) <= 1).all()
    assert service.counts() == (4, 2)
    # A replay's `sample` takes `age` and `beta` only: refused before anything is counted.
    with pytest.raises(TypeError, match="`ReplayService.sample`: a replay's `sample` takes"):
        service.sample(jax.random.key(0), 2, dx.Window(2))
    assert service.counts() == (4, 2)
    service.close()
    limiter = RateLimiter(1, 1, None, None, insert_batch_size=2)  # no bound
    buffer = dx.TrajectoryBuffer(STEP | {"r": jnp.zeros(()), "d": jnp.zeros((), bool)}, 2, 8)
    service = ReplayService(RateLimited(buffer, limiter))
    for t in range(3):
        steps = {"env": np.arange(2, dtype=np.int32), "t": np.full(2, t, np.int32)}
        service.add(steps | {"r": np.ones(2, np.float32), "d": np.zeros(2, bool)})
    nstep = dx.NStep(1, reward="r", terminated="d")
    out = service.sample(jax.random.key(1), 1, nstep, discount=0.9)
    assert np.asarray(out.returns).tolist() == [1.0]
    assert service.counts() == (6, 1)
    service.close()
