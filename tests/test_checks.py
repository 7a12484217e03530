"""Bad input is refused with an error that names the problem."""

import re
from collections.abc import Callable
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from .helpers import enable_x64, Transition


ITEM = {"obs": jnp.zeros((3,), jnp.float32), "info": (jnp.zeros((), jnp.int8),)}


def _good(n=None):
    if n is None:
        return {"obs": jnp.ones(3), "info": (jnp.asarray(1, jnp.int8),)}
    return {"obs": jnp.ones((n, 3)), "info": (jnp.ones(n, jnp.int8),)}


@pytest.fixture(params=["CircularBuffer", "UniformReplay"])
def buf_and_names(request):
    if request.param == "CircularBuffer":
        return dx.CircularBuffer(ITEM, 4), "push", "push_batch"
    return dx.UniformReplay(ITEM, 4), "add", "add_batch"


@pytest.mark.parametrize("jit", [False, True])
def test_wrong_structure(buf_and_names, jit):
    buf, one, many = buf_and_names
    call: Callable[..., Any] = (
        eqx.filter_jit(lambda b, x: getattr(b, one)(x)) if jit else getattr(buf, one)
    )
    args = (buf,) if jit else ()
    with pytest.raises(ValueError, match=re.escape("missing leaves [\"['info'][0]\"]")):
        call(*args, {"obs": jnp.ones(3), "info": ()})
    with pytest.raises(ValueError, match=re.escape("unexpected leaves [\"['extra']\"]")):
        call(*args, {**_good(), "extra": jnp.ones(2)})
    with pytest.raises(ValueError, match=f"{type(buf).__name__}.{one}"):
        call(*args, [jnp.ones(3), jnp.ones((), jnp.int8)])


def test_structure_with_same_paths_but_other_containers():
    buf = dx.UniformReplay(Transition(obs=jnp.zeros(2), done=jnp.zeros((), bool)), 3)
    # A plain tuple flattens to the same leaf positions as the NamedTuple, but is not it.
    with pytest.raises(ValueError, match="does not have the prototype's structure"):
        buf.add((jnp.ones(2), jnp.ones((), bool)))


def test_wrong_shape_names_leaf_and_shapes(buf_and_names):
    buf, one, many = buf_and_names
    bad = {"obs": jnp.ones(4), "info": (jnp.asarray(1, jnp.int8),)}
    msg = re.escape("item leaf `['obs']` has shape (4,), expected (3,)")
    with pytest.raises(ValueError, match=msg):
        getattr(buf, one)(bad)
    bad = {"obs": jnp.ones((2, 4)), "info": (jnp.ones(2, jnp.int8),)}
    msg = re.escape("leaf `['obs']` has shape (2, 4); expected (n, *(3,))")
    with pytest.raises(ValueError, match=msg):
        getattr(buf, many)(bad)
    # An unbatched item passed to the batched method is a shape error too.
    with pytest.raises(ValueError, match="leading batch axis"):
        getattr(buf, many)(_good())


def test_inconsistent_batch_lengths(buf_and_names):
    buf, one, many = buf_and_names
    bad = {"obs": jnp.ones((5, 3)), "info": (jnp.ones(2, jnp.int8),)}
    msg = re.escape("`['info'][0]` has 2 entries but `['obs']` has 5")
    with pytest.raises(ValueError, match=msg):
        getattr(buf, many)(bad)


def test_wrong_dtype_names_leaf_and_dtypes(buf_and_names):
    buf, one, many = buf_and_names
    bad = {"obs": jnp.ones(3, jnp.float16), "info": (jnp.asarray(1, jnp.int8),)}
    with pytest.raises(TypeError, match=re.escape("`['obs']` has dtype float16, expected float32")):
        getattr(buf, one)(bad)
    bad = {"obs": np.ones((2, 3)), "info": (np.ones(2, np.int8),)}  # NumPy's float64
    with pytest.raises(TypeError, match=re.escape("`['obs']` has dtype float64, expected float32")):
        getattr(buf, many)(bad)


def test_python_scalar_that_does_not_fit():
    buf = dx.UniformReplay({"a": jnp.zeros((), jnp.int8)}, 2)
    with pytest.raises(ValueError, match="the stored dtype int8 cannot hold exactly"):
        buf.add({"a": 300})


def test_non_array_leaves_are_refused():
    # Under the tests' import hook the annotation check fires before ours; either way the
    # error is a TypeError that names the argument.
    msg = re.escape("prototype leaf `['name']` is a str") + "|parameter 'prototype'"
    with pytest.raises(TypeError, match=msg):
        dx.UniformReplay({"name": "cartpole", "x": jnp.zeros(2)}, 3)
    buf = dx.UniformReplay({"x": jnp.zeros(2)}, 3)
    msg = re.escape("item leaf `['x']` is a str") + "|parameter 'item'"
    with pytest.raises(TypeError, match=msg):
        buf.add({"x": "1.0"})
    with pytest.raises(ValueError, match="does not have the prototype's structure"):
        buf.add({"x": [1.0, 2.0]})  # a list is a pytree node, not a leaf


@pytest.mark.parametrize("cls", [dx.CircularBuffer, dx.UniformReplay])
def test_bad_constructor_arguments(cls):
    name = cls.__name__
    with pytest.raises(
        ValueError, match=re.escape(f"`{name}(max_size=...)` must be positive, got 0")
    ):
        cls(ITEM, 0)
    with pytest.raises(ValueError, match="must be at most 2147483647"):
        cls(ITEM, 2**31)
    msg = re.escape(f"`{name}(max_size=...)` must be a Python int") + "|parameter 'max_size'"
    with pytest.raises(TypeError, match=msg):
        cls(ITEM, 3.0)
    with pytest.raises(ValueError, match="the prototype has no array leaves"):
        cls({}, 3)


def test_bad_batch_size():
    buf = dx.UniformReplay(ITEM, 4).add(_good())
    key = jax.random.key(0)
    with pytest.raises(
        ValueError, match=re.escape("`UniformReplay.sample(batch_size=...)` must be positive")
    ):
        buf.sample(key, 0)
    with pytest.raises(TypeError, match="must be a Python int|parameter 'batch_size'"):
        buf.sample(key, jnp.asarray(3))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("jit", [False, True])
def test_empty_buffer_errors(jit):
    wrap = eqx.filter_jit if jit else (lambda f: f)
    buf = dx.UniformReplay(ITEM, 4)
    with pytest.raises(RuntimeError, match="cannot sample from an empty UniformReplay"):
        wrap(lambda b, k: b.sample(k, 2))(buf, jax.random.key(0))
    cb = dx.CircularBuffer(ITEM, 1)
    with pytest.raises(RuntimeError, match="cannot pop from an empty CircularBuffer"):
        wrap(lambda b: b.pop())(cb)
    # Popping the last item empties the buffer again.
    _, cb = wrap(lambda b: b.pop())(cb.push(_good()))
    with pytest.raises(RuntimeError, match="cannot pop from an empty CircularBuffer"):
        wrap(lambda b: b.pop())(cb)


def test_empty_buffer_error_under_plain_jax_jit():
    buf = dx.UniformReplay(ITEM, 4)
    params, static = eqx.partition(buf, eqx.is_array)
    sample = jax.jit(lambda p, k: eqx.combine(p, static).sample(k, 2))
    with pytest.raises(Exception, match="cannot sample from an empty UniformReplay"):
        jax.block_until_ready(sample(params, jax.random.key(0)))


def test_get_index_errors():
    cb = dx.CircularBuffer(ITEM, 3).push(_good())
    for bad in [-1, 1, 3]:
        with pytest.raises(RuntimeError, match="index out of range"):
            cb.get(bad)
    with pytest.raises(TypeError):
        cb.get(jnp.zeros((2,), jnp.int32))


def test_update_fn_must_keep_item_shape_and_dtype():
    buf = dx.UniformReplay(ITEM, 3).add(_good())
    with pytest.raises(TypeError, match=re.escape("`fn` returned dtype float16 at leaf `['obs']`")):
        buf.update(lambda it: {**it, "obs": it["obs"].astype(jnp.float16)})
    with pytest.raises(ValueError, match=re.escape("`fn` returned shape (6,) at leaf `['obs']`")):
        buf.update(lambda it: {**it, "obs": jnp.concatenate([it["obs"], it["obs"]])})
    with pytest.raises(ValueError, match="output of `fn` does not have the prototype's structure"):
        buf.update(lambda it: it["obs"])


def test_annotations_are_checked_during_tests():
    # conftest.py installs jaxtyping's import hook with beartype: a call that violates an
    # annotation fails in the type checker before the function body runs.
    cb = dx.CircularBuffer(ITEM, 3).push(_good())
    with pytest.raises(jaxtyping.TypeCheckError):
        cb.get(jnp.zeros((2,), jnp.int32))


def test_bad_mask(buf_and_names):
    buf, one, many = buf_and_names
    with pytest.raises(ValueError, match=re.escape("`mask` has shape (3,), expected (2,)")):
        getattr(buf, many)(_good(2), mask=jnp.ones(3, bool))
    with pytest.raises(TypeError, match="`mask` has dtype int32, expected bool|parameter 'mask'"):
        getattr(buf, many)(_good(2), mask=jnp.ones(2, jnp.int32))


# ---------------------------------------------------------------------------------------------
# Numeric arguments: converted from their own dtype (`as_float`), never wrapped or overflowed


def test_as_float_converts_numpy_and_python_values_from_their_own_dtype():
    from dejax_eqx.internal import as_float

    # `jnp.asarray` without 64-bit mode would wrap the int64 2**32 to the int32 0 first.
    for value, want in [
        (np.int64(2**32), [2.0**32]),
        (np.array([2**32, -(2**33) - 1], np.int64), [2.0**32, -(2.0**33)]),
        (np.array([2**64 - 1], np.uint64), [2.0**64]),
        (2**40, [2.0**40]),  # a Python int past int32 (JAX refuses it with an OverflowError)
        (np.float64(0.5), [0.5]),
        (jnp.asarray([7], jnp.int32), [7.0]),
    ]:
        out, faults = as_float(value, jnp.float32, "f", "x")
        assert out.dtype == jnp.float32 and not any(np.any(c) for c, _ in faults)
        assert np.asarray(out).reshape(-1).tolist() == want


def test_as_float_reports_what_the_dtype_cannot_hold():
    from dejax_eqx.internal import as_float

    message = re.escape("`f(x=...)`: `x` holds a finite value too large for float32")
    for value in [10**400, 2**200, 1e39, np.float64(-1e39), np.array([1.0, 1e39])]:
        out, faults = as_float(value, jnp.float32, "f(x=...)", "x")
        assert [m for _, m in faults] and re.match(message, faults[0][1])
        assert bool(np.any(faults[0][0])) and not bool(np.all(np.isfinite(out)))
    # A non-finite value is not an overflow: the caller's own check reports it.
    ((bad, _),) = as_float(np.array([np.inf, np.nan]), jnp.float32, "f", "x")[1]
    assert not np.any(bad)
    # Values no float32 can fail to hold carry no check at all: the hot paths stay as they were.
    for value in [np.int64(2**62), np.uint64(2**64 - 1), jnp.ones(2), jnp.ones(2, jnp.int32)]:
        assert as_float(value, jnp.float32, "f", "x")[1] == []
    # Masked-out entries are not checked.
    (bad, _), *_ = as_float(
        np.array([1e39, 1e39]), jnp.float32, "f", "x", mask=np.array([True, False])
    )[1]
    assert np.asarray(bad).tolist() == [True, False]
    with enable_x64(True):  # a JAX float64 array, converted by JAX, checked by JAX
        out, faults = as_float(jnp.asarray([1e39, 1.0]), jnp.float32, "f", "x")
        assert np.asarray(faults[0][0]).tolist() == [True, False]
        assert as_float(jnp.asarray([2**40], jnp.int64), jnp.float32, "f", "x")[1] == []


def test_a_python_int_too_large_for_any_float_names_the_argument():
    # float(10**400) raises a bare OverflowError; the checks say which argument it was.
    from dejax_eqx.internal import check_finite_float

    with pytest.raises(ValueError, match=re.escape("`f(y=...)` must be finite, got a number too")):
        check_finite_float(10**400, "f(y=...)")
    # (Under the tests' import hook, an int where the annotation says float fails first.)
    msg = re.escape("`ClusteredReplay(distribution_power=...)` must be finite")
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=msg + "|parameter"):
        dx.ClusteredReplay(dx.UniformReplay(ITEM, 4), 2, lambda it: it["info"][0], 10**400)
    msg = re.escape("`PrioritisedReplay(priority_exponent=...)` must be finite")
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match=msg + "|parameter"):
        dx.PrioritisedReplay(ITEM, 4, priority_exponent=10**400)
    msg = re.escape("`importance_weights(beta=...)` must be finite, got a number too large for")
    msg += r" any float \(an int of 1329 bits\)"
    with pytest.raises(ValueError, match=msg):
        dx.importance_weights(jnp.ones(2), 2, 10**400)


def test_a_numpy_float64_scalar_in_an_item_is_not_a_python_float():
    # np.float64 subclasses float, but has a dtype of its own: it must match, as an array does
    # (before, it was rounded into the float32 leaf as a Python float would be).
    buf = dx.UniformReplay(ITEM, 4)
    item = {"obs": jnp.ones(3), "info": (np.int8(1),)}
    buf.add(item)  # a NumPy scalar of the stored dtype
    with pytest.raises(TypeError, match=re.escape("`['x']` has dtype float64, expected float32")):
        dx.UniformReplay({"x": jnp.zeros(())}, 2).add({"x": np.float64(0.1)})
    assert float(
        dx.UniformReplay({"x": jnp.zeros(())}, 2)
        .add({"x": 0.1})
        .sample(jax.random.key(0), 1)["x"][0]
    ) == np.float32(0.1)
