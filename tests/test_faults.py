"""The silent faults of issue 12, each with the test that caught it.

Every test here failed before the shared index check, the exact conversion of Python scalars,
the type checks of a buffer's parts and the runtime-fault helper existed. Indices that could wrap
are tried with and without 64-bit mode, as NumPy values (checked in NumPy, before JAX sees them)
and as JAX arrays (checked in their own dtype, before any cast).
"""

import re
import subprocess
import sys
import traceback

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import enable_x64, SLOW


FAULT = eqx.EquinoxRuntimeError
ITEM = {"obs": jnp.zeros(2), "action": jnp.asarray(0, jnp.int32)}
BATCH = {"obs": jnp.ones((3, 2)), "action": jnp.arange(3, dtype=jnp.int32)}


def _cluster_of(item):
    return item["action"] % 2


# Values that wrap into range when cast to int32: 2**32 -> 0, 2**32 + 1 -> 1.
WRAPPING = [2**32, 2**32 + 1]


def _int64_values(x64: bool):
    """The wrapping values as the index kinds a user may pass."""
    values = [np.int64(v) for v in WRAPPING] + list(WRAPPING)  # NumPy scalars, Python ints
    if x64:
        values += [jnp.asarray(v, jnp.int64) for v in WRAPPING]
    return values


# In 64-bit mode: the slow tier, as the eager 64-bit edge cases (tests/helpers.py).
@pytest.fixture(params=[False, pytest.param(True, marks=SLOW)], ids=["x32", "x64"])
def x64(request):
    with enable_x64(request.param):
        yield request.param


# ---------------------------------------------------------------------------------------------
# Integer indices never wrap


def test_circular_buffer_get_does_not_wrap(x64):
    cb = dx.CircularBuffer(ITEM, 4).push_batch(BATCH)
    for index in _int64_values(x64):
        with pytest.raises(FAULT, match=re.escape("`CircularBuffer.get(index)`: index out of")):
            cb.get(index)
    assert int(cb.get(np.int64(2))["action"]) == 2  # in range: fine


def test_sum_tree_set_and_get_do_not_wrap(x64):
    tree = dx.SumTree(4)
    for index in _int64_values(x64):
        indices = np.asarray([index]) if isinstance(index, np.integer | int) else index[None]
        with pytest.raises(FAULT, match=re.escape("`SumTree.set`: index out of range")):
            tree.set(indices, jnp.ones(1))
        with pytest.raises(FAULT, match=re.escape("`SumTree.get(indices)`: index out of range")):
            tree.get(indices)
    assert float(tree.total) == 0.0  # nothing was written to leaf 0 or 1


def test_sum_tree_get_does_not_clip():
    tree = dx.SumTree(4).set(jnp.arange(4), jnp.arange(1.0, 5.0))
    with pytest.raises(FAULT, match="index out of range"):
        tree.get(jnp.array([4]))
    with pytest.raises(FAULT, match="index out of range"):
        tree.get(jnp.array([-1]))
    assert tree.get(jnp.array([[3, 0]])).tolist() == [[4.0, 1.0]]


def test_set_priorities_does_not_wrap(x64):
    replay = dx.PrioritisedReplay(ITEM, 4).add_batch(BATCH)
    for index in _int64_values(x64):
        indices = np.asarray([index]) if isinstance(index, np.integer | int) else index[None]
        with pytest.raises(FAULT, match="index out of range"):
            replay.set_priorities(indices, jnp.ones(1))


def test_cluster_ids_do_not_wrap(x64):
    replay = dx.ClusteredReplay(dx.PrioritisedReplay(ITEM, 4), 2, _cluster_of).add_batch(BATCH)
    for index in _int64_values(x64):
        ids = np.asarray([index]) if isinstance(index, np.integer | int) else index[None]
        with pytest.raises(FAULT, match="a cluster id is outside"):
            replay.set_priorities((ids, jnp.zeros(1, jnp.int32)), jnp.ones(1))


def test_cluster_fn_ids_do_not_wrap():
    with enable_x64(True):

        def wrapping(item):
            return jnp.asarray(2**32, jnp.int64) + item["action"].astype(jnp.int64)

        replay = dx.ClusteredReplay(dx.UniformReplay(ITEM, 4), 2, wrapping)
        with pytest.raises(FAULT, match="returned a cluster id outside"):
            replay.add_batch(BATCH)


def test_env_ids_and_peek_do_not_wrap(x64):
    buf = dx.TrajectoryBuffer(ITEM, 2, 4)
    buf = buf.add(jax.tree.map(lambda x: x[:2], BATCH))
    for index in _int64_values(x64):
        ids = np.asarray([index]) if isinstance(index, np.integer | int) else index[None]
        with pytest.raises(FAULT, match="an env id is out of range"):
            buf.add(jax.tree.map(lambda x: x[:1], BATCH), env_ids=ids)
        with pytest.raises(FAULT, match="an env id is out of range"):
            buf.peek(ids)


def test_uint32_index_is_checked_in_its_own_dtype():
    cb = dx.CircularBuffer(ITEM, 4).push_batch(BATCH)
    with pytest.raises(FAULT, match="index out of range"):
        cb.get(jnp.asarray(2**32 - 1, jnp.uint32))  # -1 if cast to int32
    assert int(cb.get(jnp.asarray(1, jnp.uint8))["action"]) == 1


def test_numpy_int64_under_jit_is_converted_by_jax_first():
    # Documented in docs/errors.md: without 64-bit mode `jax.jit` turns a NumPy int64 argument
    # into int32 before the library sees it, wrapping 2**32 + 1 to 1. Only an argument passed
    # from outside a jitted function is affected; this test pins the behaviour the docs describe.
    cb = dx.CircularBuffer(ITEM, 4).push_batch(BATCH)
    got = jax.jit(lambda c, i: c.get(i))(cb, np.int64(2**32 + 1))
    assert int(got["action"]) == 1


# ---------------------------------------------------------------------------------------------
# Python scalars are converted only where the stored dtype holds them


@pytest.mark.parametrize(
    "dtype, value",
    [
        (jnp.int32, 1.5),
        (jnp.int32, -0.7),
        (jnp.int8, 2.5),
        (jnp.int8, 300),
        (jnp.uint8, -1),
        (jnp.int32, 2.0),  # a float, even an integral one, is not an int
        (jnp.bool_, 2),
        (jnp.bool_, 1),
        (jnp.int32, True),
        (jnp.float32, True),
        (jnp.float16, 1e6),  # overflows to inf
        (jnp.float32, 1e39),
        (jnp.float32, 2**24 + 1),  # an int that float32 cannot hold exactly
        (jnp.float32, 1j),
    ],
)
def test_lossy_python_scalars_are_refused(dtype, value):
    buf = dx.UniformReplay({"a": jnp.zeros((), dtype)}, 2)
    message = f"item leaf `['a']` is the Python scalar {value!r}, which the stored dtype"
    with pytest.raises(ValueError, match=re.escape(message)):
        buf.add({"a": value})
    assert int(buf.size) == 0


@pytest.mark.parametrize(
    "dtype, value, stored",
    [
        (jnp.int32, 7, 7),
        (jnp.int8, -128, -128),
        (jnp.bool_, True, True),
        (jnp.float32, 3, 3.0),
        (jnp.float32, 2**24, 2.0**24),
        (jnp.float32, 0.1, np.float32(0.1)),  # rounded, as JAX rounds every Python float
        (jnp.float32, float("nan"), np.nan),
        (jnp.float16, float("-inf"), -np.inf),
        (jnp.complex64, 1 + 2j, 1 + 2j),
    ],
)
def test_exact_python_scalars_are_stored(dtype, value, stored):
    buf = dx.UniformReplay({"a": jnp.zeros((), dtype)}, 2).add({"a": value})
    got = np.asarray(buf.storage.data["a"][0])
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, np.asarray(stored, dtype))


# ---------------------------------------------------------------------------------------------
# Wrong parts are refused at once, naming the call


# Under the tests' jaxtyping import hook, beartype refuses some of these at the boundary, naming
# the method and the parameter, before the library's own check (which users without the hook
# get, and which names the call the same way): either is a TypeError naming both.


def test_clustered_replay_refuses_a_non_replay():
    with pytest.raises(TypeError, match=r"(?s)ClusteredReplay.*inner"):
        dx.ClusteredReplay(dx.CircularBuffer(ITEM, 4), 2, _cluster_of)  # type: ignore


@pytest.mark.parametrize("env_ids", [[0, 1], (0, 1)])
def test_env_ids_must_be_an_array(env_ids):
    buf = dx.TrajectoryBuffer(ITEM, 2, 4)
    steps = jax.tree.map(lambda x: x[:2], BATCH)
    with pytest.raises(TypeError, match=r"(?s)TrajectoryBuffer.add.*env_ids"):
        buf.add(steps, env_ids=env_ids)


_UNHOOKED = """
import jax.numpy as jnp, numpy as np, dejax_eqx as dx
item = {"obs": jnp.zeros(2)}
for make in (
    lambda: dx.ClusteredReplay(dx.CircularBuffer(item, 4), 2, lambda i: jnp.asarray(0)),
    lambda: dx.TrajectoryBuffer(item, 2, 4).add({"obs": np.ones((2, 2), np.float32)}, [0, 1]),
):
    try:
        make()
    except TypeError as e:
        print(e)
"""


def test_wrong_parts_are_refused_by_the_library_itself():
    # Without the tests' jaxtyping import hook, as users run it: the library's own checks
    # (before them, a CircularBuffer inner failed later with an AttributeError, and a list of
    # env ids deep inside JAX).
    result = subprocess.run(
        [sys.executable, "-c", _UNHOOKED], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [
        "`ClusteredReplay(inner=...)` must be a replay (an `AbstractReplay` such as "
        "`UniformReplay` or `PrioritisedReplay`), got a CircularBuffer.",
        "`TrajectoryBuffer.add(env_ids=...)` must be an integer array (a JAX or NumPy array) "
        "or a Python int, got a list.",
    ], result.stdout


def test_importance_weights_refuses_bad_size_and_beta():
    p = jnp.array([0.1, 0.4])
    with pytest.raises(ValueError, match=re.escape("`importance_weights(size=...)` must be")):
        dx.importance_weights(p, 0, 1.0)
    with pytest.raises(ValueError, match=re.escape("`importance_weights(beta=...)` must be")):
        dx.importance_weights(p, 10, float("nan"))
    with pytest.raises(ValueError, match=re.escape("`importance_weights(beta=...)` must be")):
        dx.importance_weights(p, 10, -0.5)
    # As arrays (traced data), at run time.
    with pytest.raises(FAULT, match="`size` must be positive"):
        dx.importance_weights(p, jnp.asarray(0), 1.0)
    with pytest.raises(FAULT, match="`beta` must be finite and non-negative"):
        dx.importance_weights(p, 10, jnp.asarray(jnp.nan))
    with pytest.raises(FAULT, match="`beta` must be finite and non-negative"):
        eqx.filter_jit(dx.importance_weights)(p, 10, jnp.asarray(-1.0))
    assert np.allclose(dx.importance_weights(p, jnp.asarray(10), jnp.asarray(1.0)), [1.0, 0.25])


def test_priority_must_be_a_real_number():
    replay = dx.PrioritisedReplay(ITEM, 4)
    one = jax.tree.map(lambda x: x[0], BATCH)
    with pytest.raises(TypeError, match="`priority` has dtype bool"):
        replay.add(one, priority=True)
    with pytest.raises(TypeError, match=r"(?s)add_batch.*priorities"):
        replay.add_batch(BATCH, jnp.ones(3, jnp.bool_))
    assert float(replay.add(one, priority=2).max_priority) == 2.0


def test_dtype_none_is_not_blamed_on_64_bit_mode():
    for make in (lambda: dx.SumTree(4, None), lambda: dx.PrioritisedReplay(ITEM, 4, dtype=None)):
        with pytest.raises(TypeError, match="must be jnp.float32 or jnp.float64, got None"):
            make()


def test_messages_agree_in_number():
    from dejax_eqx._checks import check_index

    with pytest.raises(ValueError, match=r"`f\(ids\)` must have 1 axis, got shape \(\)"):
        check_index(jnp.asarray(0), 4, "f(ids)", ndim=1)
    with pytest.raises(ValueError, match=r"must have 2 axes, got shape \(3,\)"):
        check_index(jnp.arange(3), 4, "f(ids)", ndim=2)
    full = dx.UniformReplay(ITEM, 4).add(jax.tree.map(lambda x: x[0], BATCH))
    with pytest.raises(ValueError, match="but it holds 1 item[.]"):
        dx.ClusteredReplay(full, 2, _cluster_of)


def test_load_names_the_real_mismatch(tmp_path):
    # A file whose checksummed header agrees with `like` but whose payload does not: the error
    # says what the payload holds and where, not Equinox's wrapper text.
    import tests.test_io as io_tests

    replay = dx.UniformReplay({"c": jnp.zeros(2)}, 3)
    path = tmp_path / "replay.dx"
    dx.save(path, replay)

    def claim_bigger(header):
        for leaf in header["leaves"]:
            if leaf["path"] == ".storage.data['c']":
                leaf["shape"] = [3, 3]
        return header

    path.write_bytes(io_tests._rewrite(path.read_bytes(), header=claim_bigger))
    with pytest.raises(ValueError) as info:
        dx.load(path, like=dx.UniformReplay({"c": jnp.zeros(3)}, 3))
    message = str(info.value)
    assert "inconsistent payload at leaf `.storage.data['c']`" in message
    assert "holds a float32[3, 2] array where the header promised float32[3, 3]" in message
    assert "Error at leaf" not in message


# ---------------------------------------------------------------------------------------------
# Runtime errors point at the user's own call


def test_eager_fault_is_raised_from_the_callers_line():
    buf = dx.UniformReplay(ITEM, 4)
    with pytest.raises(FAULT) as info:
        buf.sample(jax.random.key(0), 2)  # the line the traceback must show
    assert str(info.value) == "`UniformReplay.sample`: cannot sample from an empty UniformReplay"
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[0].name == "test_eager_fault_is_raised_from_the_callers_line"
    assert frames[0].line == "buf.sample(jax.random.key(0), 2)  # the line the traceback must show"


def test_fault_under_filter_jit_shows_this_call_not_an_earlier_one():
    # Before, the clustered replay's internal jit kept the stack of the first trace: a later
    # fault from another call site showed the first call's lines.
    buf = dx.ClusteredReplay(dx.UniformReplay(ITEM, 4), 2, _cluster_of)
    ok = BATCH

    @eqx.filter_jit
    def first(b, x):
        return b.add_batch(x)

    @eqx.filter_jit
    def second(b, x):
        return b.add_batch(x)  # second's own line

    first(buf, ok)
    bad = dx.ClusteredReplay(dx.UniformReplay(ITEM, 4), 2, _bad_cluster)
    with pytest.raises(FAULT) as info:
        second(bad, ok)
    message = str(info.value)
    assert "returned a cluster id outside" in message
    assert "second's own line" in message and "first(" not in message


def _bad_cluster(item):
    return item["action"] + 5


def test_fault_under_plain_jit_carries_the_message_and_the_calling_line():
    buf = dx.UniformReplay(ITEM, 4)

    def train_step(b, k):
        return b.sample(k, 2)

    line = train_step.__code__.co_firstlineno + 1
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(train_step)(buf, jax.random.key(0))
    message = str(info.value)
    assert "`UniformReplay.sample`: cannot sample from an empty UniformReplay" in message
    assert f"(called at test_faults.py:{line} in train_step)" in message
