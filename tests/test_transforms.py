"""Every buffer type under the transformations a training loop uses: `jax.jit`, donation
(`eqx.filter_jit(donate=...)`), a `lax.scan` carry, `eqx.filter_vmap` over a batch of buffers,
and jit caching. Parametrised over `tests/registry.py`; `shard_map` is in `test_sharding.py`,
save/load in `test_io.py`.

The reference for each method is `eqx.filter_jit(call)` without donation: the other forms
must give exactly its results (bit for bit, NaN payloads included).
"""

import functools
import inspect
import warnings
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from .helpers import assert_bits_equal, rotation
from .registry import (
    BUFFER_TYPES,
    BufferType,
    BY_NAME,
    CAPACITY,
    empty,
    filled,
    filled_batch,
    ITEM,
    make_batch,
    row,
    stack,
)


_type_id = lambda t: t.name  # noqa: E731


def test_registry_covers_the_public_api():
    # A new public method or property fails here until the registry (and so every
    # cross-cutting test) covers it.
    for t in BUFFER_TYPES:
        public = set()
        for klass in t.cls.__mro__:
            if klass.__module__.startswith("dejax_eqx"):
                public |= {
                    name
                    for name, member in vars(klass).items()
                    if not name.startswith("_")
                    and (inspect.isfunction(member) or isinstance(member, property))
                }
        covered = {name.split("(")[0] for name in t.methods} | set(t.others)
        assert public <= covered, (t.name, sorted(public - covered))
        assert not set(t.others) & {name.split("(")[0] for name in t.methods}, t.name


@pytest.mark.parametrize("t", BUFFER_TYPES, ids=_type_id)
def test_every_buffer_is_a_pytree_of_arrays(t):
    # The dispatch fast path of docs/jit-patterns.md: no `eqx.partition` needed for a buffer,
    # so plain `jax.jit` takes it as an argument.
    for buf in [empty(t), filled(t)]:
        assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(buf)), t.name
        # Counters keep their dtype: no weak types, which would cost a retrace.
        assert not any(leaf.weak_type for leaf in jax.tree.leaves(buf)), t.name


def _assert_donated(old, new):
    """Every array of `old` was donated: deleted, or passed through unchanged (JAX forwards an
    unchanged input to the output without a copy: the same memory)."""
    new_pointers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(new)}
    for leaf in jax.tree.leaves(old):
        assert leaf.is_deleted() or leaf.unsafe_buffer_pointer() in new_pointers


def _pointers(buf) -> list:
    """Where each array of `buf` with more than one element lives: equal before and after a
    donated step when XLA updated the contents in place. (Scalar counters are left out: XLA:CPU
    may write a donated scalar's new value to fresh memory, which costs nothing.)"""
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(buf) if x.size > 1]


def _training_step(t: BufferType):
    """Every method of `t`, in turn, on the buffer the previous one made: one step of a
    training loop that uses the whole surface. Returns the buffer and every output, keyed by
    method (so a failing comparison names the method in the leaf path)."""
    names = list(t.methods)

    def step(buf, args):
        outputs = {}
        for name in names:
            new, out = t.methods[name].call(buf, args[name])
            buf = buf if new is None else new
            outputs[name] = out
        return buf, outputs

    def make_args(seed: int):
        return {name: t.methods[name].args(seed) for name in names}

    return step, make_args


# One step per type, and its reference: plain `jax.jit` (no `eqx.partition`: a buffer is a
# pytree of arrays), without donation, compiled once and shared by every test below.
_STEPS = {t.name: _training_step(t) for t in BUFFER_TYPES}
_REFERENCE = {name: jax.jit(step) for name, (step, _) in _STEPS.items()}
NUM_STEPS = 3


@functools.cache
def _reference_run(name: str) -> list:
    """The reference buffers and outputs of `NUM_STEPS` steps from `filled(t)`."""
    t = BY_NAME[name]
    buf, runs = filled(t), []
    for i in range(NUM_STEPS):
        buf, out = _REFERENCE[t.name](buf, _STEPS[t.name][1](i))
        runs.append((buf, out))
    return runs


@pytest.mark.parametrize("t", rotation(BUFFER_TYPES, 0, keep=1), ids=_type_id)
def test_donate_all_updates_in_place_and_compiles_once(t):
    # As in the README: `eqx.filter_jit(donate="all")`. The buffer is updated where it is, and
    # the results are those of the plain `jax.jit` reference, bit for bit.
    step, make_args = _STEPS[t.name]
    traces = []

    @eqx.filter_jit(donate="all")
    def counted(buf, args):
        traces.append(None)
        return step(buf, args)

    expected = _reference_run(t.name)
    for _ in range(2):
        buf = filled(t)  # a fresh buffer each time: the same static configuration
        pointers = _pointers(buf)
        for i in range(NUM_STEPS):
            old = buf
            buf, out = counted(buf, make_args(i))
            _assert_donated(old, buf)
            assert _pointers(buf) == pointers
            assert_bits_equal((buf, out), expected[i])
    # One trace in all: the counters keep their dtype (no weak types) across steps, and fresh
    # buffers of the same configuration hash equal.
    assert len(traces) == 1
    # Another configuration is traced anew (lowered only: the count is what matters; lowering
    # warns that the donated arguments could not be reused, which only running would decide).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        # (`eqx.filter_jit` is typed as giving back the function it wraps, without `.lower`.)
        cast(Any, counted).lower(t.make(ITEM, CAPACITY + 1), make_args(0))
    assert len(traces) == 2


@pytest.mark.parametrize("t", rotation(BUFFER_TYPES, 6, keep=1), ids=_type_id)
def test_scan_carry_equals_python_loop(t):
    step, make_args = _STEPS[t.name]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[make_args(i) for i in range(NUM_STEPS)])
    scanned, outputs = eqx.filter_jit(lambda b, a: jax.lax.scan(step, b, a))(filled(t), stacked)
    expected = _reference_run(t.name)
    for i in range(NUM_STEPS):
        assert_bits_equal(row(outputs, i), expected[i][1])
    assert_bits_equal(scanned, expected[-1][0])


COPIES = 3


@pytest.mark.parametrize("t", rotation(BUFFER_TYPES, 5, keep=1), ids=_type_id)
def test_vmap_batch_of_buffers(t):
    # `eqx.filter_vmap` makes a batch of empty buffers: a leading axis on every array, the
    # static fields of one buffer.
    bufs = make_batch(t.make, ITEM, CAPACITY, COPIES)
    single = empty(t)
    assert jax.tree.structure(bufs) == jax.tree.structure(single)
    for i in range(COPIES):
        assert_bits_equal(row(bufs, i), single)
    # Independently filled buffers, each with its own arguments, through one vmapped step:
    # row i is what buffer i gives alone.
    step, make_args = _STEPS[t.name]
    bufs = filled_batch(t, COPIES)
    args = stack([make_args(i) for i in range(COPIES)])
    new, out = eqx.filter_jit(eqx.filter_vmap(step))(bufs, args)
    for i in range(COPIES):
        expected = _REFERENCE[t.name](filled(t, i), make_args(i))
        assert_bits_equal(row((new, out), i), expected)
