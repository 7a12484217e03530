"""Faults as results (`throw=False`): nothing compiled but the faults' conditions."""

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import registry
from .helpers import SLOW
from .hlo import copies as hlo_copies


_BUFFERS = [t for t in registry.BUFFER_TYPES if issubclass(t.cls, dx.AbstractBuffer)]
# `importance_weights` is a free function over a sample: it has its own `throw` (tested below).
_METHODS = [(t, name) for t in _BUFFERS for name in t.methods if name != "importance_weights"]
# What a conditional or a host callback lowers to.
_FORBIDDEN = re.compile(r"stablehlo\.(case|if)\b|callback")


# Every method is lowered in the slow tier; the README's command lowers every eighth.
_LOWERED = [
    pair if i % 8 == 0 else pytest.param(pair, marks=SLOW) for i, pair in enumerate(_METHODS)
]


@pytest.mark.parametrize("pair", _LOWERED, ids=registry.method_id)
def test_no_conditional_and_no_callback_is_compiled(pair):
    t, name = pair
    method = t.methods[name]
    buf = registry.filled(t).with_throw(False)
    args = method.args(0)
    text = jax.jit(lambda b, a: method.call(b, a)).lower(buf, args).as_text()
    found = sorted(set(m.group(0) for m in _FORBIDDEN.finditer(text)))
    assert not found, f"{t.name}.{name} compiles {found}"


# ---------------------------------------------------------------------------------------------
# Every kind of fault a buffer reports, in both modes: `throw=True` raises the message at the
# faulty call; `throw=False` records the same message as the buffer's result (or beside a
# read's value), changes nothing that a correct buffer would not have changed, and `check()`
# raises it.

STEP = {"obs": jnp.zeros(2), "reward": jnp.zeros(()), "done": jnp.zeros((), bool)}


def _steps(n: int, value: float = 1.0) -> dict:
    return {
        "obs": jnp.full((n, 2), value),
        "reward": jnp.full((n,), value),
        "done": jnp.zeros(n, bool),
    }


def _item_version(item):
    return item["reward"].astype(jnp.int32)


def _bad_cluster(item):
    return jnp.asarray(5, jnp.int32)  # of 2 clusters


def _uniform():
    return dx.UniformReplay(STEP, 4)


def _prioritised():
    return dx.PrioritisedReplay(STEP, 4).add_batch(_steps(2))


def _clustered():
    return dx.ClusteredReplay(dx.PrioritisedReplay(STEP, 4), 2, _bad_cluster)


def _trajectory():
    return dx.TrajectoryBuffer(STEP, 2, 4).add(_steps(2))


def _prioritised_windows():
    return dx.PrioritisedTrajectoryBuffer(STEP, 2, 4, dx.Window(2, strict=True)).extend(
        jax.tree.map(lambda x: jnp.stack([x, x], 1), _steps(2))
    )


def _queue():
    return dx.TrajectoryQueue(STEP, 2, 3).add(_steps(2)).add(_steps(2))


def _limited(adds: int = 1):
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 2, 2, insert_batch_size=2, sample_batch_size=2
    )
    buf = dx.RateLimited(dx.UniformReplay(STEP, 8), limiter)
    for _ in range(adds):
        buf = buf.add_batch(_steps(2))
    return buf  # inserts 2 · adds, samples 0: within max_diff = 4 after two adds


def _good_cluster(item):
    return jnp.asarray(0, jnp.int32)


def _clustered_ok():
    return dx.ClusteredReplay(dx.PrioritisedReplay(STEP, 4), 2, _good_cluster).add_batch(_steps(2))


def _one_env():
    return dx.TrajectoryBuffer(STEP, 2, 4).add(_steps(1), jnp.array([0]))


def _wrapped():
    buf = dx.TrajectoryBuffer(STEP, 2, 4)
    for t in range(5):  # env 0's step 0 is overwritten
        buf = buf.add(_steps(2, float(t)))
    return buf


def _zero_priorities():
    return dx.PrioritisedReplay(STEP, 4).add_batch(_steps(2), jnp.zeros(2))


KEY = jax.random.key(0)
NSTEP = dx.NStep(1, reward="reward", terminated="done")


class Case(NamedTuple):
    name: str
    make: Callable[[], Any]
    call: Callable[[Any], Any]  # jitted in the test
    kind: str  # the item of `dx.RESULTS`
    message: str  # the start of the message, after the call


CASES = [
    Case("empty sample", _uniform, lambda b: b.sample(KEY, 2), "empty", "cannot sample from"),
    Case(
        "bad priority",
        _prioritised,
        lambda b: b.add_batch(_steps(2), jnp.array([1.0, -1.0])),
        "bad_priority",
        "priorities must be finite",
    ),
    Case(
        "bad index",
        _prioritised,
        lambda b: b.set_priorities(jnp.array([0, 3]), jnp.ones(2)),
        "index_out_of_range",
        "index out of range",
    ),
    Case(
        "bad cluster",
        _clustered,
        lambda b: b.add_batch(_steps(2)),
        "cluster_fn_out_of_range",
        "`cluster_fn` returned",
    ),
    Case(
        "env id out of range",
        _trajectory,
        lambda b: b.add(_steps(2), jnp.array([0, 2])),
        "env_id_out_of_range",
        "an env id is out of range",
    ),
    Case(
        "env id repeated",
        _trajectory,
        lambda b: b.add(_steps(2), jnp.array([1, 1])),
        "env_id_repeated",
        "an env id occurs more than once",
    ),
    Case(
        "no window",
        _trajectory,
        lambda b: b.sample(KEY, 2, dx.Window(3, strict=True)),
        "no_window",
        "no env's",
    ),
    Case(
        "bad discount",
        _trajectory,
        lambda b: b.sample(KEY, 2, NSTEP, discount=jnp.asarray(2.0)),
        "bad_discount",
        "`discount` must be in",
    ),
    Case(
        "start not taken",
        _trajectory,
        lambda b: b.stale(jnp.array([0]), jnp.array([5])),
        "start_not_taken",
        "a start is not a step",
    ),
    Case(
        "bad policy version",
        _trajectory,
        lambda b: b.sample(
            KEY, 2, dx.Window(1), age=dx.PolicyAge(_item_version, jnp.asarray(-3), 1)
        ),
        "bad_policy_count",
        "must be in [0, 2**31 - 1]",
    ),
    Case(
        "bad stamp",
        _prioritised_windows,
        lambda b: b.set_priorities(jnp.array([0]), jnp.array([1]), jnp.ones(1)),
        "stamp_not_given",
        "a stamp this buffer cannot have given",
    ),
    Case(
        "queue full",
        _queue,
        lambda b: b.extend(jax.tree.map(lambda x: jnp.stack([x, x], 1), _steps(2, 7.0))),
        "queue_full",
        "an env's queue has no room",
    ),
    Case("queue short", _queue, lambda b: b.pop(3), "queue_short", "an env holds fewer"),
    Case(
        "nothing to peek",
        _one_env,
        lambda b: b.peek(jnp.array([0, 1])),
        "nothing_to_peek",
        "an env has no stored step yet",
    ),
    Case(
        "stale window",
        _wrapped,
        lambda b: b.read(jnp.array([0]), jnp.array([0]), dx.Window(2)),
        "stale_window",
        "a window is stale",
    ),
    Case(
        "bad beta",
        _prioritised_windows,
        lambda b: b.sample(KEY, 2, beta=jnp.asarray(-1.0)),
        "bad_beta",
        "`beta` must be finite",
    ),
    Case(
        "zero priority",
        _zero_priorities,
        lambda b: b.sample(KEY, 2),
        "zero_priority",
        "every stored item has priority 0",
    ),
    Case(
        "cluster id out of range",
        _clustered_ok,
        lambda b: b.set_priorities((jnp.array([0, 5]), jnp.array([0, 0])), jnp.ones(2)),
        "cluster_id_out_of_range",
        "a cluster id is outside",
    ),
    Case(
        "version ahead",
        _trajectory,
        lambda b: b.sample(KEY, 2, dx.Window(1), age=dx.PolicyAge(_item_version, 0)),
        "version_ahead",
        "a stored step has a policy version greater",
    ),
    Case(
        "too old",
        _trajectory,
        lambda b: b.sample(KEY, 2, dx.Window(1), age=dx.PolicyAge(_item_version, 9, 2)),
        "too_old",
        "older than `max_age`",
    ),
    Case(
        "bad distribution power",
        _trajectory,
        lambda b: b.sample(KEY, 2, dx.Window(1), distribution_power=jnp.asarray(jnp.inf)),
        "bad_distribution_power",
        "`distribution_power` must be finite",
    ),
    Case(
        "insert too large",
        _limited,
        lambda b: b.add_batch(_steps(4), mask=jnp.ones(4, bool)),
        "insert_too_large",
        "`n` must be in [0, insert_batch_size",
    ),
    Case(
        "insert refused",
        lambda: _limited(2),
        lambda b: b.add_batch(_steps(2, 5.0)),
        "insert_not_allowed",
        "the rate limit does not allow this insert",
    ),
    Case(
        "sample refused",
        lambda: _limited().sample(KEY, 2)[0],  # balance 0 = min_diff
        lambda b: b.sample(KEY, 2),
        "sample_not_allowed",
        "the rate limit does not allow this sample",
    ),
]


def _arrays(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _buffer_of(out) -> Any:
    """The buffer a call returned (alone, or in a tuple), or `None` for a read."""
    if isinstance(out, dx.AbstractBuffer):
        return out
    if isinstance(out, tuple):
        return next((x for x in out if isinstance(x, dx.AbstractBuffer)), None)
    return None


# An eighth of the kinds in the README's command, every one in the slow tier.
@pytest.mark.parametrize(
    "case",
    [c if i % 8 == 0 else pytest.param(c, marks=SLOW) for i, c in enumerate(CASES)],
    ids=lambda c: c.name,
)
def test_a_fault_raises_or_is_recorded(case):
    call = eqx.filter_jit(case.call)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(case.message)):
        call(case.make())
    buf = case.make().with_throw(False)
    out = call(buf)
    new = _buffer_of(out)
    result = out[1] if new is None else new.result
    assert isinstance(result, dx.Result)
    assert result.kind == getattr(dx.RESULTS, case.kind)
    message = result.message
    assert message is not None and case.message in message
    assert "(called at test_results.py:" in message
    assert message.count("(called at ") == 1  # once, however many layers recorded it
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(case.message)):
        (new if new is not None else result).check()
    if new is not None and new.result is not None:
        # Nothing changed that a correct buffer would not have changed: the call is dropped
        # (a read that also writes, `pop` and a rate-limited `sample`, keeps its counts).
        assert all(
            (a == b).all()
            for a, b in zip(_arrays(buf.with_throw(True)), _arrays(new.with_throw(True)))
        ), case.name
        # The first fault wins: a later faulty call leaves it as it is.
        again = call(new)
        again = _buffer_of(again)
        assert again is not None and int(again.result.code) == int(result.code)


def test_a_vetoed_add_of_every_env_writes_nothing_in_place():
    """An add without `env_ids` that would pass an env's step count past 2**31 - 1: recorded,
    and dropped by its slots (each becomes `max_length`, out of range), in place."""
    buf = dx.TrajectoryBuffer(STEP, 2, 4).add(_steps(2))
    near = eqx.tree_at(lambda b: b.streams.step_count, buf, jnp.array([5, 2**31 - 1], jnp.int32))
    add = jax.jit(lambda b: b.add(_steps(2, 9.0)), donate_argnums=0)
    hlo = add.lower(near.with_throw(False)).compile().as_text()
    assert hlo is not None
    assert hlo_copies(hlo, 4 * 2) == []  # no copy of the storage
    before = _arrays(near)  # host copies: the call donates the arrays it is given
    new = add(near.with_throw(False))
    assert new.result is not None and new.result.kind == dx.RESULTS.step_count_overflow
    assert all((a == b).all() for a, b in zip(_arrays(new.with_throw(True)), before))
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape("would pass 2**31 - 1 steps")):
        new.check()


def test_a_scan_keeps_the_first_fault():
    """10,000 steps carry one result: a fault at step 10 is there at the end, and the buffer
    holds what a correct buffer that skipped that call holds."""
    steps = 10_000
    priorities = jnp.ones((steps, 2)).at[10, 1].set(-1.0).at[20, 0].set(jnp.nan)

    def run(buf, skip):
        def body(buf, t):
            keep = jnp.broadcast_to((t != 10) & (t != 20) if skip else True, (2,))
            return buf.add_batch(_steps(2), priorities[t], mask=keep), None

        return jax.lax.scan(body, buf, jnp.arange(steps))[0]

    run = eqx.filter_jit(run)
    got = run(dx.PrioritisedReplay(STEP, 64, throw=False), False)
    want = run(dx.PrioritisedReplay(STEP, 64), True)
    assert got.result is not None and got.result.kind == dx.RESULTS.bad_priority
    assert "PrioritisedReplay.add_batch" in str(got.result.message)
    assert all((a == b).all() for a, b in zip(_arrays(got.with_throw(True)), _arrays(want)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="priorities must be finite"):
        got.check()


def test_each_lane_of_a_vmap_keeps_its_own_result():
    make = lambda _: dx.PrioritisedReplay(STEP, 4, throw=False).add_batch(_steps(2))  # noqa: E731
    bufs = eqx.filter_vmap(make)(jnp.arange(3))
    indices = jnp.array([[0, 1], [0, 3], [1, 0]])  # lane 1's 3 is not a stored slot
    new = eqx.filter_jit(eqx.filter_vmap(lambda b, i: b.set_priorities(i, jnp.full(2, 5.0))))(
        bufs, indices
    )
    assert (np.asarray(new.result.code) != 0).tolist() == [False, True, False]
    correct = eqx.filter_vmap(lambda b, i, m: b.set_priorities(i, jnp.full(2, 5.0), mask=m))(
        bufs.with_throw(True), indices, jnp.array([[True, True], [False, False], [True, True]])
    )
    assert all((a == b).all() for a, b in zip(_arrays(new.with_throw(True)), _arrays(correct)))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"index out of range(.|\n)*lane \(1,\)"):
        new.check()


def test_importance_weights_may_return_its_result():
    weights = eqx.filter_jit(lambda p: dx.importance_weights(p, 4, 0.5, throw=False))
    w, result = weights(jnp.array([0.5, 0.25]))
    assert bool(result.ok) and w.shape == (2,)
    _, result = weights(jnp.array([0.5, 0.0]))
    assert result.kind == dx.RESULTS.bad_probability
    with pytest.raises(eqx.EquinoxRuntimeError, match="probabilities must be positive"):
        result.check()


def test_host_boundaries_refuse_a_faulty_buffer(tmp_path):
    buf = dx.TrajectoryBuffer(STEP, 2, 4, throw=False)
    faulty = eqx.filter_jit(lambda b: b.add(_steps(2), jnp.array([0, 0])))(buf)
    assert not bool(faulty.result.ok)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"`dx.save`: refused(.|\n)*occurs more"):
        dx.save(tmp_path / "buf.eqx", faulty)
    dataset = dx.Dataset.create(tmp_path / "data", STEP, 2)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"`Dataset.write`: refused"):
        dataset.write(faulty)
    dx.save(tmp_path / "ok.eqx", buf)  # a healthy one passes


def test_the_service_raises_a_fault_to_its_caller_and_serves_on():
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 2, 64, insert_batch_size=64, sample_batch_size=64
    )
    buf = dx.RateLimited(dx.TrajectoryBuffer(STEP, 2, 4, throw=False), limiter)
    service = dx.ReplayService(buf)
    try:
        service.add(_steps(2))
        with pytest.raises(eqx.EquinoxRuntimeError, match="an env id occurs more than once"):
            service.add(_steps(2), np.array([1, 1]))
        service.add(_steps(2, 3.0))  # the fault was raised once; the buffer serves on
        with pytest.raises(eqx.EquinoxRuntimeError, match="no env's"):
            service.sample(KEY, 2, dx.Window(3, strict=True))
        batch = service.sample(KEY, 2, dx.Window(2))
        assert batch.items["obs"].shape == (2, 2, 2)
        assert service.counts()[0] == 4  # the refused add counted nothing
    finally:
        service.close()


GLOBAL = hasattr(jax, "shard_map")


@pytest.mark.skipif(not GLOBAL, reason="the global buffers need JAX 0.7+")
def test_global_buffers_record_the_same_fault_everywhere():
    mesh = jax.make_mesh((jax.device_count(),), ("shards",))
    shards = jax.device_count()
    buf = dx.GlobalReplay(mesh, lambda: dx.PrioritisedReplay(STEP, 4, throw=False))
    assert not buf.throw
    add = eqx.filter_jit(lambda b, x: b.add_batch(x))
    buf = add(buf, _steps(2 * shards))
    put = eqx.filter_jit(lambda b, i: b.set_priorities(i, jnp.full(2, 3.0)))
    for fn, args in [(add, _steps(2 * shards)), (put, jnp.array([0, 1]))]:
        text = jax.jit(fn).lower(buf, args).as_text()
        assert not _FORBIDDEN.search(text)
    new = put(buf, jnp.array([0, 4 * shards]))  # names no item of any shard
    assert new.result.kind == dx.RESULTS.index_names_no_item
    assert all(
        (a == b).all() for a, b in zip(_arrays(buf.with_throw(True)), _arrays(new.with_throw(True)))
    )
    trajectories = dx.GlobalTrajectoryBuffer(
        mesh, lambda: dx.TrajectoryBuffer(STEP, 2, 4), throw=False
    )
    wrong = jnp.arange(2 * shards)[::-1]  # rows of block s name envs of other shards
    new = eqx.filter_jit(lambda b, e: b.add(_steps(2 * shards), e))(trajectories, wrong)
    assert new.result.kind == dx.RESULTS.env_id_other_shard
    assert (np.asarray(new.step_count) == 0).all()  # nothing was added


# Faults are recorded in the default tier (test_a_fault_raises_or_is_recorded), a global
# buffer's too (above); a rate-limited global buffer refusing an insert, in the slow tier.
@SLOW
@pytest.mark.skipif(not GLOBAL, reason="the global buffers need JAX 0.7+")
def test_a_rate_limited_global_buffer_refuses_an_insert_and_counts_nothing():
    mesh = jax.make_mesh((jax.device_count(),), ("shards",))
    shards = jax.device_count()
    # max_diff = 4 · shards - 1: the first insert fills to min_size_to_sample, the second
    # would pass max_diff.
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 2 * shards, 2 * shards - 1, insert_batch_size=2 * shards, sample_batch_size=2
    )
    inner = dx.GlobalReplay(mesh, lambda: dx.UniformReplay(STEP, 4))
    buf = dx.RateLimited(inner, limiter, throw=False)
    add = eqx.filter_jit(lambda b, x: b.add_batch(x))
    text = jax.jit(add).lower(buf, _steps(2 * shards)).as_text()
    assert not _FORBIDDEN.search(text)
    for _ in range(3):
        buf = add(buf, _steps(2 * shards))
    assert buf.result is not None and buf.result.kind == dx.RESULTS.insert_not_allowed
    message = buf.result.message
    assert message is not None and message.count("(called at ") == 1
    assert int(buf.size) == 2 * shards and buf.counts() == (2 * shards, 0)


def test_every_message_of_the_catalogue_has_one_kind():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "docs" / "_ext"))
    import messages  # pyright: ignore[reportMissingImports]
    from dejax_eqx._results import _TEXTS, kind_of

    found = set()
    for message in messages.messages():
        if message.kind != "runtime":
            continue
        example = message.text.replace("…", "7")
        found.add(kind_of(example))  # raises for a message of no kind
    assert found == set(range(1, len(dx.RESULTS))), "an item of RESULTS no message has"
    # The codes' kinds are the items' values: the class is written in the table's order.
    for index, (name, text) in enumerate(_TEXTS.items()):
        item = getattr(dx.RESULTS, name)
        assert dx.RESULTS[item] == text and (item == dx.Result(jnp.asarray(index << 24)).kind)


# The flashbax layer's builders take `throw` too.

TIMESTEP = {"obs": jnp.zeros(2), "reward": jnp.zeros(())}


def _builders():
    from dejax_eqx.compat import flashbax as fbx

    return {
        "flat": lambda t: fbx.make_flat_buffer(16, 4, 2, add_batch_size=2, throw=t),
        "item": lambda t: fbx.make_item_buffer(16, 4, 2, add_batches=True, throw=t),
        "trajectory": lambda t: fbx.make_trajectory_buffer(
            2, 2, 2, 1, 2, max_length_time_axis=8, throw=t
        ),
        "prioritised flat": lambda t: fbx.make_prioritised_flat_buffer(
            16, 4, 2, add_batch_size=2, throw=t
        ),
        "prioritised item": lambda t: fbx.make_prioritised_item_buffer(
            16, 4, 2, add_batches=True, throw=t
        ),
        "prioritised trajectory": lambda t: fbx.make_prioritised_trajectory_buffer(
            2, 2, 2, 1, 2, max_length_time_axis=8, throw=t
        ),
        "queue": lambda t: fbx.make_trajectory_queue(8, 2, 1, 2, throw=t),
    }


def _batch(name: str):
    rows = {"flat": 2, "prioritised flat": 2, "item": 3, "prioritised item": 3}.get(name, 2)
    batch = jax.tree.map(lambda x: jnp.ones((rows, *x.shape), x.dtype), TIMESTEP)
    if name in ("trajectory", "prioritised trajectory", "queue"):
        batch = jax.tree.map(lambda x: x[:, None], batch)  # a time axis of 1
    return batch


# Faults are recorded by every buffer in the default tier (above); through the flashbax
# layer, in the slow tier.
@SLOW
@pytest.mark.parametrize("name", list(_builders()))
def test_the_flashbax_layer_records_faults(name):
    make = _builders()[name]
    raising, buffer = make(True), make(False)
    add = eqx.filter_jit(buffer.add)
    if name == "queue":
        sample = eqx.filter_jit(lambda s, k: buffer.sample(s))
    else:
        sample = eqx.filter_jit(buffer.sample)
    state = buffer.init(TIMESTEP)
    for fn, args in [(add, (state, _batch(name))), (sample, (state, KEY))]:
        text = jax.jit(fn).lower(*args).as_text()
        assert not _FORBIDDEN.search(text), name
    # A sample of an empty buffer: raised by the raising builder, recorded by the other.
    with pytest.raises(eqx.EquinoxRuntimeError):
        empty = raising.init(TIMESTEP)
        out = raising.sample(empty) if name == "queue" else raising.sample(empty, KEY)
        jax.block_until_ready(out)
    out = sample(state, KEY)
    drawn = out[1] if name == "queue" else out
    assert drawn.result is not None and not bool(drawn.result.ok)
    with pytest.raises(eqx.EquinoxRuntimeError):
        drawn.result.check()
    if name == "queue":
        assert bool(out[0].module.result.ok) is False  # the pop is on the state too
        assert int(out[0].module.unread.sum()) == 0
    state = add(state, _batch(name))
    assert bool(state.module.result.ok)
