"""`write_back` (per-step values written into the stored steps of a trajectory buffer) and
`written_back` (the keys of the step that adds may leave out), against a NumPy model of each
env's steps: absolute step -> values, independent of the buffer's ring."""

import functools
import re
from typing import Any, cast

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, precondition, rule, RuleBasedStateMachine

from .helpers import assert_bits_equal, assert_tree_equal, random_batch, rotation, SLOW
from .hlo import aliased_parameters, copies


def _s(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


# A step as a recurrent learner stores it: what the actor gives (`obs`, `done`), and what the
# learner writes back (`h`, a recurrent state; `seen`, a boolean, zero-filled as False).
SPEC = {
    "obs": _s((2,), jnp.float32),
    "done": _s((), jnp.bool_),
    "h": _s((2,), jnp.float32),
    "seen": _s((), jnp.bool_),
}
WRITTEN_BACK = ("h", "seen")
GIVEN = ("obs", "done")  # the keys every add gives
NUM_ENVS = 3
KINDS = ("trajectory", "prioritised", "episodes")


def _make(kind: str, max_length: int, **kwargs) -> Any:
    """A buffer of `SPEC` steps of `kind`: a `TrajectoryBuffer`, a `PrioritisedTrajectoryBuffer`
    (strict windows of 2 steps) or a `TrajectoryBuffer` that keeps episodes."""
    common: dict[str, Any] = dict(written_back=WRITTEN_BACK, **kwargs)
    if kind == "trajectory":
        return dx.TrajectoryBuffer(SPEC, NUM_ENVS, max_length, **common)
    if kind == "prioritised":
        window = dx.Window(2, strict=True)
        return dx.PrioritisedTrajectoryBuffer(SPEC, NUM_ENVS, max_length, window, **common)
    assert kind == "episodes"
    episodes = dx.Episodes("done", autoreset="same-step")
    return dx.TrajectoryBuffer(SPEC, NUM_ENVS, max_length, episodes=episodes, **common)


def _spec(keys, *lead: int) -> dict[str, jax.ShapeDtypeStruct]:
    """`SPEC`'s `keys`, each leaf with the extra leading axes `lead` (after the batch axis)."""
    return {k: _s((*lead, *SPEC[k].shape), SPEC[k].dtype) for k in keys}


def _values(keys, n: int, length: int, rng) -> dict[str, np.ndarray]:
    """Random values of `keys`, leaves `[n, length, ...]` (NaNs, infinities and -0.0 among the
    floats: they must land bit for bit)."""
    return random_batch(_spec(keys, length), n, rng)


class StepsModel:
    """Per env, the values of each stored step by its absolute step number, and the number of
    steps it has taken. Step `s` is stored while `count - min(count, max_length) <= s < count`."""

    def __init__(self, num_envs: int, max_length: int):
        self.max_length = max_length
        self.count = [0] * num_envs
        self.steps: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in range(num_envs)]

    def stored(self, env: int, step: int) -> bool:
        count = self.count[env]
        return count - min(count, self.max_length) <= step < count

    def extend(self, env_ids, items) -> None:
        """Append steps (leaves `[n, T, ...]`) to envs `env_ids`; a written-back key that
        `items` leaves out is stored as zeros (False)."""
        length = np.shape(items["obs"])[1]
        for i, env in enumerate(env_ids):
            for t in range(length):
                self.steps[env][self.count[env]] = {
                    k: np.asarray(items[k][i, t]) if k in items else np.zeros(s.shape, s.dtype)
                    for k, s in SPEC.items()
                }
                self.count[env] += 1
            self.steps[env] = {s: v for s, v in self.steps[env].items() if self.stored(env, s)}

    def write_back(self, env_ids, starts, values, mask) -> tuple[np.ndarray, np.ndarray]:
        """Row `i`'s value `t` into step `starts[i] + t` of env `env_ids[i]` where `mask` holds
        and the step is stored, the last such row winning a step; `(written, dropped)`."""
        n, length = mask.shape
        written, dropped = np.zeros((n, length), bool), np.zeros((n, length), bool)
        last: dict[tuple[int, int], tuple[int, int]] = {}
        for i in range(n):
            for t in range(length):
                if not mask[i, t]:
                    continue
                env, step = int(env_ids[i]), int(starts[i]) + t
                if self.stored(env, step):
                    last[(env, step)] = (i, t)  # a later row replaces an earlier one
                else:
                    dropped[i, t] = True
        for (env, step), (i, t) in last.items():
            written[i, t] = True
            self.steps[env][step].update({k: np.asarray(v[i, t]) for k, v in values.items()})
        return written, dropped

    def storage(self) -> dict[str, np.ndarray]:
        """The storage as the buffer documents it: step `s` of env `e` in slot `s mod
        max_length` of row `e`; zeros in the slots no step has reached yet."""
        m = self.max_length
        data = {k: np.zeros((len(self.count), m, *s.shape), s.dtype) for k, s in SPEC.items()}
        for env, steps in enumerate(self.steps):
            for step, item in steps.items():
                for k, v in item.items():
                    data[k][env, step % m] = v
        return data


def _assert_same_as_model(buf, model: StepsModel) -> None:
    assert_tree_equal(buf.streams.data, model.storage(), "storage:")
    count = np.asarray(model.count, np.int32)
    np.testing.assert_array_equal(np.asarray(buf.streams.step_count), count)
    lengths = np.minimum(count, model.max_length)
    np.testing.assert_array_equal(np.asarray(buf.streams.lengths), lengths)


def _assert_only_keys_changed(old, new, keys) -> None:
    """`new` is `old` bit for bit but for the storage of `keys`: the other keys' storage, the
    counters, the online queue, priorities, episodes, result."""
    assert jax.tree.structure(old) == jax.tree.structure(new)
    written = [f"streams.data['{k}']" for k in keys]
    skipped = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)):
        name = jax.tree_util.keystr(path)
        if any(w in name for w in written):
            skipped += 1
            continue
        assert_bits_equal(a, b)
    assert skipped == len(keys)  # every written key was found (and only those were skipped)


_add = eqx.filter_jit(lambda b, x, e: b.add(x, env_ids=e))
_extend = eqx.filter_jit(lambda b, x, e: b.extend(x, env_ids=e))
_write_back = eqx.filter_jit(lambda b, e, s, v, m: b.write_back(e, s, v, mask=m))
_set_priorities = eqx.filter_jit(lambda b, e, s, p: b.set_priorities(e, s, p))


# ---------------------------------------------------------------------------------------------
# Random histories: adds and extends to random envs (the rings wrap), with the written-back
# keys, without, or with some, interleaved with write-backs of random stamps (stale
# ones, ones that reach past the newest step, rows sharing steps, masks), held to the model
# after every operation.


class WriteBackMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(KINDS),
        # Rings of 3 and 5 steps, where the write-back finds the last row of a step in a
        # table of the storage's cells, and of 64 steps, where it sorts fewer entries (n T < 6).
        max_length=st.sampled_from([3, 5, 64]),
        seed=st.integers(0, 2**32 - 1),
    )
    def init(self, kind, max_length, seed):
        self.kind, self.max_length = kind, max_length
        self.buf = _make(kind, max_length)
        self.model = StepsModel(NUM_ENVS, max_length)
        self.rng = np.random.default_rng(seed)

    def _env_ids(self, data) -> list[int]:
        ids = st.lists(st.integers(0, NUM_ENVS - 1), unique=True, min_size=1, max_size=NUM_ENVS)
        return data.draw(ids, label="env_ids")

    @rule(data=st.data(), written_back=st.sampled_from([(), ("h",), WRITTEN_BACK]))
    def add(self, data, written_back):
        env_ids = self._env_ids(data)
        keys = (*GIVEN, *written_back)  # the written-back keys left out are zero-filled
        items = random_batch(_spec(keys), len(env_ids), self.rng)
        self.buf = _add(self.buf, items, np.asarray(env_ids, np.int32))
        self.model.extend(env_ids, {k: v[:, None] for k, v in items.items()})

    @rule(data=st.data(), written_back=st.sampled_from([(), ("h",), WRITTEN_BACK]))
    def extend(self, data, written_back):
        env_ids = self._env_ids(data)
        length = data.draw(st.sampled_from([2, self.max_length + 1]), label="length")  # wraps
        keys = (*GIVEN, *written_back)
        items = random_batch(_spec(keys, length), len(env_ids), self.rng)
        self.buf = _extend(self.buf, items, np.asarray(env_ids, np.int32))
        self.model.extend(env_ids, items)

    @precondition(lambda self: any(self.model.count))
    @rule(data=st.data())
    def write_back(self, data):
        m = self.max_length
        n = data.draw(st.sampled_from([1, 4]), label="n")
        length = data.draw(st.integers(1, min(m, 5)) | st.just(m), label="T")
        # The written-back keys, or keys adds give (`done` among them: the episodes kept
        # stay as the adds made them).
        keys = data.draw(st.sampled_from([("h",), ("h", "seen"), ("obs", "done")]), label="keys")
        taken = [e for e in range(NUM_ENVS) if self.model.count[e] > 0]
        env_ids: list[int] = []
        starts: list[int] = []
        for i in range(n):
            if i and data.draw(st.booleans(), label="near an earlier row"):
                # An earlier row's stamp, or one a step either side: rows that share steps.
                j = data.draw(st.integers(0, i - 1), label="row")
                env = env_ids[j]
                shift = data.draw(st.integers(-1, 1), label="shift")
                start = min(max(starts[j] + shift, 0), self.model.count[env] - 1)
            else:
                env = data.draw(st.sampled_from(taken), label="env")
                count = self.model.count[env]
                # From two steps before the oldest stored one (stale) to the newest.
                start = data.draw(st.integers(max(0, count - m - 2), count - 1), label="start")
            env_ids.append(env)
            starts.append(start)
        masked = data.draw(st.booleans(), label="masked")
        if masked:
            flags = st.lists(st.booleans(), min_size=n * length, max_size=n * length)
            mask = np.asarray(data.draw(flags, label="mask"), bool).reshape(n, length)
            for i in np.flatnonzero(~mask.any(axis=1)):
                # A row with nothing to write is not checked: its stamp may be anything.
                bad = [(NUM_ENVS, 0), (-1, 0), (env_ids[i], -1), (env_ids[i], 2**31 - 1)]
                env_ids[i], starts[i] = data.draw(st.sampled_from(bad), label="padding")
        else:
            mask = np.ones((n, length), bool)
        values = _values(keys, n, length, self.rng)
        e, s = np.asarray(env_ids, np.int32), np.asarray(starts, np.int32)
        old = self.buf
        self.buf, report = _write_back(old, e, s, values, mask if masked else None)
        written, dropped = self.model.write_back(env_ids, starts, values, mask)
        np.testing.assert_array_equal(np.asarray(report.written), written)
        np.testing.assert_array_equal(np.asarray(report.dropped), dropped)
        assert int(report.num_dropped) == int(dropped.sum())
        _assert_only_keys_changed(old, self.buf, keys)
        if self.kind == "prioritised":
            assert_bits_equal(self.buf.priorities, old.priorities)
        if self.kind == "episodes":
            assert_bits_equal(self.buf.streams.book, old.streams.book)

    @precondition(
        lambda self: self.kind == "prioritised" and max(self.model.count) >= 2  # a window of 2
    )
    @rule(data=st.data())
    def set_priorities(self, data):
        # Unequal priorities, so that a write-back that touched them would show.
        env = data.draw(st.sampled_from([e for e in range(NUM_ENVS) if self.model.count[e] >= 2]))
        count = self.model.count[env]
        starts = [
            data.draw(st.integers(max(0, count - self.max_length), count - 2), label="start")
            for _ in range(3)
        ]
        priorities = self.rng.choice([0.0, 0.5, 2.0, 3.0], size=3).astype(np.float32)
        envs = np.full(3, env, np.int32)
        self.buf = _set_priorities(self.buf, envs, np.asarray(starts, np.int32), priorities)

    @invariant()
    def same_as_model(self):
        if hasattr(self, "buf"):
            _assert_same_as_model(self.buf, self.model)


# Each run compiles its buffer's adds and write-backs for the shapes it draws: even the
# quarter share of runs that `machine_tests` gives the default tier takes 2.5 s, so the machine
# runs in the slow tier (every run of the profile). The default tier holds the model to a
# write-back by hand and to a scan of random write-backs (below).
TestWriteBackMachine = SLOW(WriteBackMachine.TestCase)


# ---------------------------------------------------------------------------------------------
# `written_back`: adds may leave those keys out (zeros, False), or give them (stored as given).


def _given(n: int, *lead: int, **extra) -> dict[str, jax.Array]:
    """Steps of the given keys (ones, so that zero fill shows), with `extra` keys beside."""
    steps = {k: jnp.ones((n, *lead, *SPEC[k].shape), SPEC[k].dtype) for k in GIVEN}
    return {**steps, **extra}


H = np.arange(4, dtype=np.float32).reshape(2, 2) + 1  # the states of step 0 of envs 0, 1
G = np.arange(6, dtype=np.float32).reshape(1, 3, 2) + 10  # env 0's states of steps 2-4


@functools.cache
def _history(kind: str = "trajectory", throw: bool = True) -> Any:
    """Rings of 4 steps: env 0 has taken 5 steps (stores steps 1-4), env 1 two, env 2 none.
    Step 0 of envs 0 and 1 was added with the written-back keys, step 1 without, env 0's steps
    2-4 with `h` only. (Made once, compiled: the buffers are immutable, and no test donates
    them.)"""

    @eqx.filter_jit
    def history(buf):
        ids = jnp.array([0, 1])
        buf = buf.add(_given(2, h=jnp.asarray(H), seen=jnp.ones(2, bool)), env_ids=ids)
        buf = buf.add(_given(2), env_ids=ids)
        return buf.extend(_given(1, 3, h=jnp.asarray(G)), env_ids=jnp.array([0]))

    return history(_make(kind, 4, throw=throw))


@pytest.mark.parametrize("kind", ["trajectory", pytest.param("prioritised", marks=SLOW)])
def test_adds_without_the_written_back_keys_store_zeros_and_adds_with_them_their_values(kind):
    buf = _history(kind)
    np.testing.assert_array_equal(buf.streams.step_count, [5, 2, 0])
    h, seen = buf.streams.data["h"], buf.streams.data["seen"]
    # Env 1: step 0 (slot 0) as given, step 1 (slot 1) zeros and False.
    np.testing.assert_array_equal(h[1, :2], [H[1], [0, 0]])
    np.testing.assert_array_equal(seen[1, :2], [True, False])
    # Env 0: steps 2-4 (slots 2, 3, 0) extended with `h` only: `h` as given, `seen` False,
    # written over what slot 0 held (step 0's True).
    np.testing.assert_array_equal(h[0], [G[0, 2], [0, 0], G[0, 0], G[0, 1]])
    np.testing.assert_array_equal(seen[0], [False] * 4)
    # Env 2 took no step: its row is as made.
    np.testing.assert_array_equal(h[2], np.zeros((4, 2), np.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda step=SPEC, **kw: dx.TrajectoryBuffer(step, 2, 4, **kw),
        pytest.param(
            lambda step=SPEC, **kw: dx.PrioritisedTrajectoryBuffer(
                step, 2, 4, dx.Window(2, strict=True), **kw
            ),
            marks=SLOW,
        ),
    ],
    ids=["TrajectoryBuffer", "PrioritisedTrajectoryBuffer"],
)
def test_written_back_errors(make):
    name = type(make()).__name__
    with pytest.raises(ValueError, match=r"'x' is not a key of the step; its keys are \['done'"):
        make(written_back=("x",))
    with pytest.raises(TypeError, match=re.escape(f"`{name}(written_back=...)` must be a tuple")):
        make(written_back="h")  # a string, not a tuple of keys
    with pytest.raises(ValueError, match="at least one key of the step must be left"):
        make(written_back=tuple(SPEC))
    with pytest.raises(ValueError, match="the keys must be distinct"):
        make(written_back=("h", "h"))
    with pytest.raises(TypeError, match="names keys of a dict step, but the step is a tuple"):
        make((jnp.zeros(2), jnp.zeros(())), written_back=("h",))
    # Only the written-back keys may be left out of an add...
    buf = make(written_back=("h",))
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['done'\]\"\]"):
        buf.add({"obs": jnp.ones((2, 2)), "seen": jnp.ones(2, bool)})
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['seen'\]\"\]"):
        buf.add({"obs": jnp.ones((2, 2)), "done": jnp.ones(2, bool)})
    # ... and none without `written_back`; when given, a written-back key is checked as any.
    with pytest.raises(ValueError, match=r"missing leaves \[\"\['h'\]\", \"\['seen'\]\"\]"):
        make().add(_given(2))
    with pytest.raises(TypeError, match=r"leaf `\['h'\]` has dtype float16, expected float32"):
        buf.add(_given(2, h=jnp.ones((2, 2), jnp.float16), seen=jnp.ones(2, bool)))


# ---------------------------------------------------------------------------------------------
# One write-back worked by hand: a stale step, steps not yet taken, rows sharing steps (the
# later row wins), a mask.


def test_a_write_back_by_hand():
    buf = _history()  # rings of 4: env 0 stores steps 1-4, env 1 steps 0-1, env 2 none
    env_ids = jnp.array([0, 0, 1, 0], jnp.int32)
    starts = jnp.array([0, 2, 1, 1], jnp.int32)
    label = np.arange(4)[:, None] * 10 + np.arange(3)[None, :]  # row i, step t: 10 i + t
    h = jnp.asarray(np.stack([label, -label], -1), jnp.float32)
    mask = jnp.array([[True] * 3, [True] * 3, [True] * 3, [False, True, False]])
    new, report = _write_back(buf, env_ids, starts, {"h": h}, mask)
    # Row 0: step 0 is stale (dropped), step 2 goes to row 1; row 1: step 2 goes to row 3 (the
    # last row wins); row 2: env 1 has not taken steps 2 and 3 (dropped); row 3: masked but t=1.
    written = [
        [False, True, False],
        [False, True, True],
        [True, False, False],
        [False, True, False],
    ]
    dropped = [[True, False, False], [False] * 3, [False, True, True], [False] * 3]
    np.testing.assert_array_equal(report.written, np.asarray(written, bool))
    np.testing.assert_array_equal(report.dropped, np.asarray(dropped, bool))
    assert int(report.num_dropped) == 3
    # Slot s holds step s mod 4: env 0 steps 4, 1, 2, 3; env 1 steps 0, 1.
    want = np.array(buf.streams.data["h"])
    want[0] = [[12, -12], [1, -1], [31, -31], [11, -11]]
    want[1, 1] = [20, -20]
    np.testing.assert_array_equal(new.streams.data["h"], want)
    _assert_only_keys_changed(buf, new, ("h",))


# ---------------------------------------------------------------------------------------------
# Faults: stamps that this buffer cannot have given.


_OUT_OF_RANGE = "an env id is out of range; env ids must satisfy 0 <= env_id < num_envs = 3"
_NOT_TAKEN = "a start is not a step of its env (negative, or not yet taken)"
# (env id, start) of the second row (the first, (0, 2), is a stored step), and the fault.
FAULTS = {
    "env id 3": (3, 0, _OUT_OF_RANGE, dx.RESULTS.env_id_out_of_range),
    "env id -1": (-1, 0, _OUT_OF_RANGE, dx.RESULTS.env_id_out_of_range),
    "negative start": (1, -1, _NOT_TAKEN, dx.RESULTS.start_not_taken),
    "start not yet taken": (1, 2, _NOT_TAKEN, dx.RESULTS.start_not_taken),
    "env without steps": (2, 0, _NOT_TAKEN, dx.RESULTS.start_not_taken),
}


def _faulty_call(name: str):
    env, start, _, _ = FAULTS[name]
    values = {"h": jnp.full((2, 2, 2), 5.0)}
    return jnp.array([0, env], jnp.int32), jnp.array([2, start], jnp.int32), values


# Eagerly, a write-back compiles each of its operations on its own: the slow tier.
@pytest.mark.parametrize("how", ["jit", pytest.param("eager", marks=SLOW)])
@pytest.mark.parametrize("name", rotation(list(FAULTS), 0))
def test_bad_stamps_raise_eagerly_and_under_jit(name, how):
    buf = _history()
    env_ids, starts, values = _faulty_call(name)
    message = f"`TrajectoryBuffer.write_back`: {FAULTS[name][2]}"
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        if how == "eager":
            buf.write_back(env_ids, starts, values)
        else:
            _write_back(buf, env_ids, starts, values, None)


def test_a_row_with_nothing_to_write_is_not_checked():
    # As a read's mask leaves its rows out, a row whose mask holds nowhere may hold any stamp
    # (the padding of a batch): rows of an env id out of range, a negative start, an env
    # without steps. (The same shapes as the write-back by hand: the same program.)
    buf = _history()
    env_ids = jnp.array([0, NUM_ENVS, 1, 2], jnp.int32)
    starts = jnp.array([1, 0, -5, 0], jnp.int32)
    h = jnp.full((4, 3, 2), 9.0)
    mask = jnp.array([[True] * 3, [False] * 3, [False] * 3, [False] * 3])
    new, report = _write_back(buf, env_ids, starts, {"h": h}, mask)
    np.testing.assert_array_equal(report.written, mask)
    assert not np.asarray(report.dropped).any()
    np.testing.assert_array_equal(new.streams.data["h"][0, 1:], np.full((3, 2), 9.0))
    _assert_only_keys_changed(buf, new, ("h",))
    # One entry to write, and the row is checked.
    mask = mask.at[3, 1].set(True)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(_NOT_TAKEN)):
        _write_back(buf, env_ids, starts, {"h": h}, mask)


_recording_write_back = jax.jit(lambda b, e, s, v: b.write_back(e, s, v))


@pytest.mark.parametrize("name", [None, *rotation(list(FAULTS), 2)])
def test_a_faulty_write_back_of_a_recording_buffer_writes_nothing_and_records_it(name):
    buf = _history().with_throw(False)
    if name is None:  # the control: two stored steps' rows are written
        env_ids, starts, values = jnp.array([0, 1]), jnp.array([2, 0]), {"h": jnp.ones((2, 2, 2))}
    else:
        env_ids, starts, values = _faulty_call(name)
    new, report = _recording_write_back(buf, env_ids, starts, values)  # no exception
    if name is None:
        assert new.result.kind == dx.RESULTS.successful
        np.testing.assert_array_equal(report.written, [[True, True], [True, True]])
        assert not np.array_equal(new.streams.data["h"], buf.streams.data["h"])
        new.check()
        return
    _, _, message, kind = FAULTS[name]
    assert new.result.kind == kind
    assert buf.result.kind == dx.RESULTS.successful  # the input buffer's is its own
    # Nothing is written, the first row's stored steps included, and nothing is reported so.
    assert_bits_equal(new.streams, buf.streams)
    assert not np.asarray(report.written).any()
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        new.check()
    assert new.result.message is not None and message in new.result.message


def _hooked(message: str, parameter: str) -> str:
    """`message`, or the error of the tests' type-checking hook (tests/conftest.py), which
    checks the annotated shapes and dtypes of the arguments before the method runs."""
    return f"{message}|The problem arose whilst typechecking parameter '{parameter}'"


def _trace_errors() -> dict[str, tuple[Any, Any, str]]:
    e, s = jnp.array([0, 1]), jnp.array([2, 0])

    def h(n=2, length=2, dtype=jnp.float32, shape=(2,)):
        return {"h": jnp.zeros((n, length, *shape), dtype)}

    return {
        "wrong dtype (no cast)": (
            lambda b: b.write_back(e, s, h(dtype=jnp.float16)),
            TypeError,
            r"leaf `\['h'\]` has dtype float16, expected float32",
        ),
        "float64 NumPy values (no cast)": (
            lambda b: b.write_back(e, s, {"h": np.zeros((2, 2, 2))}),
            TypeError,
            r"leaf `\['h'\]` has dtype float64, expected float32",
        ),
        "int for bool (no cast)": (
            lambda b: b.write_back(e, s, {"seen": jnp.zeros((2, 2), jnp.int32)}),
            TypeError,
            r"leaf `\['seen'\]` has dtype int32, expected bool",
        ),
        "wrong shape": (
            lambda b: b.write_back(e, s, h(shape=(3,))),
            ValueError,
            r"leaf `\['h'\]` has shape \(2, 2, 3\)",
        ),
        "no step axis": (
            lambda b: b.write_back(e, s, {"h": jnp.zeros((2, 2))}),
            ValueError,
            r"has a leaf of shape \(2, 2\); every leaf needs two leading axes \(n, T\)",
        ),
        "unknown key": (
            lambda b: b.write_back(e, s, {"c": jnp.zeros((2, 2, 2))}),
            ValueError,
            r"`values` has keys \['c'\] that the step does not have",
        ),
        "T > max_length": (
            lambda b: b.write_back(e, s, h(length=5)),
            ValueError,
            "hold 5 steps per row, more than max_length = 4",
        ),
        "more rows than stamps": (
            lambda b: b.write_back(e, s, h(n=3)),
            ValueError,
            "`values` hold 3 rows, but there are 2 stamps",
        ),
        "rows of several lengths": (
            lambda b: b.write_back(e, s, {**h(), "seen": jnp.zeros((2, 3), bool)}),
            ValueError,
            r"leaf `\['seen'\]` has shape \(2, 3\)",
        ),
        "stamps of two shapes": (
            lambda b: b.write_back(e, s[:1], h()),
            (ValueError, TypeError),
            _hooked(r"`env_ids` has shape \(2,\) and `starts` \(1,\); they must match", "starts"),
        ),
        "stamps of two axes": (
            lambda b: b.write_back(e[None], s[None], h()),
            (ValueError, TypeError),
            _hooked("must have 1 axis", "env_ids"),
        ),
        "float starts": (
            lambda b: b.write_back(e, s.astype(jnp.float32), h()),
            TypeError,
            _hooked("must be an integer array", "starts"),
        ),
        "mask of the wrong shape": (
            lambda b: b.write_back(e, s, h(), mask=jnp.ones((2, 3), bool)),
            ValueError,
            r"`mask` has shape \(2, 3\), expected \(2, 2\)",
        ),
        "mask of one flag per row": (
            lambda b: b.write_back(e, s, h(), mask=jnp.ones(2, bool)),
            (ValueError, TypeError),
            _hooked(r"`mask` has shape \(2,\), expected \(2, 2\)", "mask"),
        ),
        "mask of the wrong dtype": (
            lambda b: b.write_back(e, s, h(), mask=jnp.ones((2, 2), jnp.int32)),
            TypeError,
            _hooked("`mask` has dtype int32, expected bool", "mask"),
        ),
        "values not a dict": (
            lambda b: b.write_back(e, s, jnp.zeros((2, 2, 2))),
            TypeError,
            _hooked("`values` must be a non-empty dict of keys of the step", "values"),
        ),
        "no values": (
            lambda b: b.write_back(e, s, {}),
            TypeError,
            "`values` must be a non-empty dict of keys of the step",
        ),
        "a step that is not a dict": (
            lambda b: dx.TrajectoryBuffer(jnp.zeros(2), 3, 4).write_back(e, s, h()),
            TypeError,
            "`values` name keys of a dict step",
        ),
    }


TRACE_ERRORS = _trace_errors()


@pytest.mark.parametrize("name", list(TRACE_ERRORS))
def test_bad_values_are_refused_at_trace_time(name):
    call, error, pattern = TRACE_ERRORS[name]
    with pytest.raises(error, match=pattern) as raised:
        eqx.filter_eval_shape(call, _history())  # while tracing: nothing runs
    assert "write_back" in str(raised.value)  # the library's message, or the hook's


@SLOW
def test_only_trajectory_buffers_that_hold_their_streams_take_write_backs():
    values = {"h": jnp.ones((1, 1, 2))}
    queue = dx.TrajectoryQueue(SPEC, 2, 4).add(
        _given(2, h=jnp.zeros((2, 2)), seen=jnp.zeros(2, bool))
    )
    with pytest.raises(TypeError, match="a TrajectoryQueue takes no write-back"):
        queue.write_back(jnp.array([0]), jnp.array([0]), values)
    if not hasattr(jax, "shard_map"):  # the global buffers need JAX 0.7+
        return
    mesh = jax.make_mesh((1,), ("replay",))
    glob = dx.GlobalTrajectoryBuffer(mesh, lambda: dx.TrajectoryBuffer(SPEC, 2, 4))
    with pytest.raises(TypeError, match="a GlobalTrajectoryBuffer takes no write-back"):
        glob.write_back(jnp.array([0]), jnp.array([0]), values)


@SLOW
@pytest.mark.skipif(
    not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
)
def test_a_global_buffer_of_written_back_shards_takes_adds_without_those_keys():
    # The global layer checks a step against the shards' steps at its door: the keys its
    # shards let adds leave out are filled there too (zeros), as each shard would fill them.
    mesh = jax.make_mesh((4,), ("shards",))
    glob = dx.GlobalTrajectoryBuffer(
        mesh, lambda: dx.TrajectoryBuffer(SPEC, 2, 4, written_back=WRITTEN_BACK)
    )
    single = dx.TrajectoryBuffer(SPEC, 8, 4, written_back=WRITTEN_BACK)
    rng = np.random.default_rng(0)
    given = random_batch({k: SPEC[k] for k in GIVEN}, 8, rng)
    seqs = random_batch(_spec(GIVEN, 3), 8, rng)
    glob = glob.add(glob.rows(given)).extend(glob.rows(seqs))
    single = single.add(given).extend(seqs)
    assert_tree_equal(glob.streams.data, single.streams.data)
    assert not np.asarray(glob.streams.data["h"]).any()


@SLOW
@pytest.mark.parametrize("kind", ["trajectory", "prioritised"])
def test_rate_limited_forwards_write_back_and_counts_nothing(kind):
    inner = _history(kind)
    limited = dx.RateLimited(inner, dx.RateLimiter(1, 1, None, None, insert_batch_size=8))
    env_ids, starts = jnp.array([0, 1, 0]), jnp.array([0, 1, 3])
    values = {"h": jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 2, 2))}
    new, report = limited.write_back(env_ids, starts, values)
    want, want_report = inner.write_back(env_ids, starts, values)
    assert isinstance(new, dx.RateLimited)
    assert_bits_equal(new.buffer, want)
    assert_bits_equal(report, want_report)
    assert_bits_equal(new.limiter, limited.limiter)  # a write-back inserts nothing
    assert_bits_equal(new.pending, limited.pending)
    # Env 0 stores steps 1-4, env 1 steps 0-1.
    np.testing.assert_array_equal(report.written, [[False, True], [True, False], [True, True]])
    np.testing.assert_array_equal(report.dropped, [[True, False], [False, True], [False, False]])


# ---------------------------------------------------------------------------------------------
# In place: inside a donated `jit` the write-back updates the storage where it lies.

# The tests' XLA flags (conftest.py) favour compile time; these programs are compiled as users
# compile them (as tests/test_vmapped_writes.py does). jax 0.11 has no emitter flag.
USERS_XLA: dict[str, Any] = (
    {"xla_cpu_use_fusion_emitters": True} if jax.__version_info__ < (0, 11) else {}
)
M = 1000  # steps per env: the storage is far larger than anything else in the program


def _big(kind: str):
    """A buffer of `kind` (or a rate-limited `TrajectoryBuffer`) of `M` steps per env, 6 taken."""
    if kind == "rate-limited":
        limiter = dx.RateLimiter(1, 1, None, None, insert_batch_size=8)
        return dx.RateLimited(_big("trajectory"), limiter)
    return eqx.filter_jit(lambda b: b.extend(_given(NUM_ENVS, 6)))(_make(kind, M))


def _write_back_args():
    """Row i writes i + 1: env 0 steps 0-2 and (the later row, which wins) 1-3, env 1 steps
    2-4, env 2 steps 4-6 (6 not yet taken)."""
    h = jnp.broadcast_to(jnp.arange(1.0, 5.0)[:, None, None], (4, 3, 2))
    values = {"h": h, "seen": jnp.ones((4, 3), bool)}
    return jnp.array([0, 1, 2, 0]), jnp.array([0, 2, 4, 1]), values


def _assert_big_write_back(new, report) -> None:
    """The result of `_write_back_args` on `_big`: with `M` steps per env (many more than the
    entries), the write-back finds the last row of each step by a sort, not a table."""
    written = [[True, False, False], [True] * 3, [True, True, False], [True] * 3]
    np.testing.assert_array_equal(report.written, written)
    np.testing.assert_array_equal(
        report.dropped, [[False] * 3] * 2 + [[False, False, True]] + [[False] * 3]
    )
    h = np.asarray(new.streams.data["h"][..., 0])
    np.testing.assert_array_equal(
        h[:, :7], [[1, 4, 4, 4, 0, 0, 0], [0, 0, 2, 2, 2, 0, 0], [0, 0, 0, 0, 3, 3, 0]]
    )
    assert not h[:, 7:].any()


@pytest.mark.parametrize(
    "kind",
    ["trajectory", pytest.param("prioritised", marks=SLOW), pytest.param("episodes", marks=SLOW)],
)
def test_write_back_in_a_donated_jit_updates_the_storage_in_place(kind):
    buf = _big(kind)
    args = _write_back_args()
    step = jax.jit(lambda b, e, s, v: b.write_back(e, s, v), donate_argnums=0)
    hlo = step.lower(buf, *args).compile(USERS_XLA).as_text()
    assert hlo is not None
    # Every leaf of the buffer (the first parameters) is aliased to an output...
    leaves = jax.tree.leaves(buf)
    assert set(range(len(leaves))) <= aliased_parameters(hlo)
    # ...and nothing copies or transposes an array of storage size.
    assert copies(hlo, M * NUM_ENVS) == [], copies(hlo, M * NUM_ENVS)[:3]
    # Run: the storage keeps its addresses and the old buffer is consumed.
    pointers = [leaf.unsafe_buffer_pointer() for leaf in leaves]
    new, report = step(buf, *args)
    assert all(leaf.is_deleted() for leaf in leaves)
    after = jax.tree.leaves(new)
    # Every array of storage size (the steps; the episodes' ids, a sum tree) stays where it was.
    big = [i for i, leaf in enumerate(after) if leaf.size >= M * NUM_ENVS]
    assert len(big) >= len(SPEC)
    assert all(after[i].unsafe_buffer_pointer() == pointers[i] for i in big)
    _assert_big_write_back(new, report)


@SLOW
@pytest.mark.parametrize("kind", ["trajectory", "rate-limited"])
def test_write_back_in_an_equinox_jit_that_donates_all_updates_the_storage_in_place(kind):
    buf = _big(kind)
    args = _write_back_args()
    # The stamps and values are closed over: every argument is the buffer, all donated.
    step = eqx.filter_jit(lambda b: b.write_back(*args), donate="all")
    # `eqx.filter_jit` is typed as giving back the function it wraps, without its `.lower`.
    hlo = cast(Any, step).lower(buf).lowered.compile(USERS_XLA).as_text()
    assert hlo is not None
    assert copies(hlo, M * NUM_ENVS) == [], copies(hlo, M * NUM_ENVS)[:3]
    leaves = jax.tree.leaves(buf)
    assert set(range(len(leaves))) <= aliased_parameters(hlo)
    pointers = {i: x.unsafe_buffer_pointer() for i, x in enumerate(leaves) if x.size >= M * 3}
    assert len(pointers) >= len(SPEC)
    new, report = step(buf)
    after = jax.tree.leaves(new)
    assert all(leaves[i].is_deleted() for i in pointers)
    assert all(after[i].unsafe_buffer_pointer() == p for i, p in pointers.items())
    _assert_big_write_back(new, report)


# ---------------------------------------------------------------------------------------------
# Transformations: a `vmap` over buffers and a `scan` of adds and write-backs.


def _lane_history(rng, max_length: int, throw: bool = True):
    """A buffer fed a random history (the same configuration for every lane): two steps of
    every env, then three extends of random envs."""
    buf = _make("trajectory", max_length, throw=throw).extend(_given(NUM_ENVS, 2))
    for _ in range(3):
        env_ids = [int(e) for e in rng.permutation(NUM_ENVS)[: rng.integers(1, NUM_ENVS + 1)]]
        items = random_batch(_spec(GIVEN, 2), len(env_ids), rng)
        buf = buf.extend(items, env_ids=jnp.asarray(env_ids, jnp.int32))
    return buf


def _stack(*trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _lane(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


@SLOW
def test_vmapped_write_back_gives_each_lane_its_own_result():
    rng = np.random.default_rng(7)
    lanes = [_lane_history(rng, 4), _lane_history(rng, 4)]
    n, length = 5, 3
    env_ids, starts = [], []
    for buf in lanes:  # each lane its own stamps: stale, past the newest, shared steps
        count = np.asarray(buf.streams.step_count)
        env = rng.choice(np.flatnonzero(count), size=n)
        env_ids.append(env.astype(np.int32))
        starts.append(rng.integers(np.maximum(count[env] - 6, 0), count[env]).astype(np.int32))
    values = [_values(("h", "seen"), n, length, rng) for _ in lanes]
    masks = [rng.random((n, length)) < 0.8 for _ in lanes]
    write = jax.jit(jax.vmap(lambda b, e, s, v, m: b.write_back(e, s, v, mask=m)))
    new, report = write(
        _stack(*lanes), _stack(*env_ids), _stack(*starts), _stack(*values), _stack(*masks)
    )
    for i, buf in enumerate(lanes):
        want, want_report = _write_back(buf, env_ids[i], starts[i], values[i], masks[i])
        assert_bits_equal(_lane(new, i), want)
        assert_bits_equal(_lane(report, i), want_report)
    # The lanes differ: a write-back that mixed them up would not pass.
    assert not np.array_equal(report.written[0], report.written[1])


@SLOW
def test_vmapped_recording_write_back_vetoes_only_the_faulty_lane():
    rng = np.random.default_rng(8)
    lanes = [_lane_history(rng, 4, throw=False) for _ in range(2)]
    env_ids = np.array([[0], [NUM_ENVS]], np.int32)  # lane 1: an env id out of range
    starts = np.zeros((2, 1), np.int32)
    values = {"h": jnp.full((2, 1, 1, 2), 3.0)}
    write = jax.jit(jax.vmap(lambda b, e, s, v: b.write_back(e, s, v)))
    new, report = write(_stack(*lanes), env_ids, starts, values)
    ok = np.asarray(new.result.ok)
    np.testing.assert_array_equal(ok, [True, False])
    want, _ = _write_back(lanes[0].with_throw(True), env_ids[0], starts[0], _lane(values, 0), None)
    assert_bits_equal(_lane(new, 0).streams, want.streams)
    assert_bits_equal(_lane(new, 1).streams, lanes[1].streams)
    np.testing.assert_array_equal(report.written, [[[True]], [[False]]])
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(_OUT_OF_RANGE)):
        new.check()


def _scan_inputs(rng, steps: int, n: int, length: int):
    """Per step: every env's new step, and `n` write-back rows whose stamps are steps taken
    by then (env `e` has taken `k + 1` steps at step `k`): stale ones among them, ones past
    the newest, and rows sharing steps."""
    items = random_batch(_spec(GIVEN, NUM_ENVS), steps, rng)
    env = rng.integers(0, NUM_ENVS, size=(steps, n)).astype(np.int32)
    start = np.stack([rng.integers(0, k + 1, size=n) for k in range(steps)]).astype(np.int32)
    values = random_batch(_spec(("h",), n, length), steps, rng)
    mask = rng.random((steps, n, length)) < 0.8
    return {"items": items, "env": env, "start": start, "values": values, "mask": mask}


def _scan_step(buf, x):
    buf = buf.add(x["items"])
    return buf.write_back(x["env"], x["start"], x["values"], mask=x["mask"])


# The default tier's case has the shapes of the write-back by hand: the calls one by one reuse
# its program.
@pytest.mark.parametrize("kind", rotation(KINDS, 0, keep=1))
def test_write_backs_in_a_scan_equal_the_same_calls_one_by_one(kind):
    rng = np.random.default_rng(3)
    steps, n, length, max_length = 10, 4, 3, 4  # the rings wrap twice
    xs = _scan_inputs(rng, steps, n, length)
    buf = adds_only = _make(kind, max_length)
    scanned, reports = jax.jit(lambda b, x: jax.lax.scan(_scan_step, b, x))(buf, xs)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    model = StepsModel(NUM_ENVS, max_length)
    for k in range(steps):
        x = _lane(xs, k)
        buf = add(buf, x["items"])
        buf, report = _write_back(buf, x["env"], x["start"], x["values"], x["mask"])
        adds_only = add(adds_only, x["items"])
        assert_bits_equal(_lane(reports, k), report)
        model.extend(range(NUM_ENVS), {key: v[:, None] for key, v in x["items"].items()})
        written, dropped = model.write_back(x["env"], x["start"], x["values"], x["mask"])
        np.testing.assert_array_equal(report.written, written)
        np.testing.assert_array_equal(report.dropped, dropped)
    assert_bits_equal(scanned, buf)
    _assert_same_as_model(buf, model)
    assert np.asarray(reports.dropped).any() and np.asarray(reports.written).any()
    # The write-backs changed `h` and nothing else: the counters, the online queue, the
    # priorities, the episodes are those of the adds alone.
    _assert_only_keys_changed(adds_only, buf, ("h",))
