"""flashbax 0.1.3's `mixer`: one batch drawn from several buffers in fixed proportions.

`make_mixer(buffers, sample_batch_size, proportions)` splits `sample_batch_size` into one share
per buffer, as flashbax does: `int(p * sample_batch_size)` for each normalised proportion `p`,
the rounding remainder going to the first buffer. Unlike flashbax, which draws a full batch
from every buffer and keeps its first rows, each buffer is sampled with exactly its share
(through the container's `sample_n`), so every row drawn is used and a share may exceed the
buffer's own `sample_batch_size`. The samples are concatenated along the batch axis, in the
order of the buffers.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import Array, ArrayLike, Bool, PRNGKeyArray, PyTree, Real

from .._states import TrajectoryBufferSample, TrajectoryBufferState, TransitionSample
from .prioritised_trajectory_buffer import (
    PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferSample,
    PrioritisedTrajectoryBufferState,
)
from .trajectory_buffer import TrajectoryBuffer


# flashbax's names for the kinds of samples, states and buffers the mixer is meant for (the
# functions below take any buffer whose samples concatenate).
sample_types = [TrajectoryBufferSample, PrioritisedTrajectoryBufferSample, TransitionSample]
SampleTypes = TypeVar(
    "SampleTypes", TrajectoryBufferSample, PrioritisedTrajectoryBufferSample, TransitionSample
)
state_types = [TrajectoryBufferState, PrioritisedTrajectoryBufferState]
StateTypes = TypeVar("StateTypes", TrajectoryBufferState, PrioritisedTrajectoryBufferState)
BufferTypes = TypeVar("BufferTypes", TrajectoryBuffer, PrioritisedTrajectoryBuffer)


@dataclasses.dataclass(frozen=True)
class Mixer:
    """flashbax's container of the mixer's pure functions: `sample(states, key)`, one batch
    from the buffers' states (a sequence, in the buffers' order), and `can_sample(states)`,
    whether every buffer can be sampled."""

    sample: Callable
    can_sample: Callable

    def replace(self, **changes) -> "Mixer":
        return dataclasses.replace(self, **changes)


def _first_rows(sample: PyTree[Array], rows: int, which: int) -> PyTree[Array]:
    """The first `rows` rows of every leaf of buffer `which`'s sample, checked."""
    for path, leaf in tree_flatten_with_path(sample)[0]:
        size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if size is None or size < rows:
            got = "no batch axis" if size is None else f"{size} rows"
            raise ValueError(
                f"`mixer.sample`: buffer {which}'s sample has {got} at leaf `{keystr(path)}`, "
                f"but its share of the batch is {rows} rows (a buffer whose `sample` was "
                "replaced without a `sample_n` supplies at most the rows its `sample` returns)."
            )
    return jax.tree.map(lambda x: x if x.shape[0] == rows else x[:rows], sample)


def _concatenate(samples: list[tuple[int, PyTree[Array]]]) -> PyTree[Array]:
    """Concatenate `(buffer index, sample)` pairs along the batch axis, checking that the
    samples match in everything but their batch sizes."""
    first, reference = samples[0]
    structure = jax.tree.structure(reference)
    shapes = [(jnp.shape(x)[1:], jnp.result_type(x)) for x in jax.tree.leaves(reference)]
    for which, sample in samples[1:]:
        if jax.tree.structure(sample) != structure:
            raise ValueError(
                f"`mixer.sample`: buffer {which}'s sample has the structure "
                f"{jax.tree.structure(sample)}, buffer {first}'s {structure}; the mixer "
                "concatenates samples of one structure only."
            )
        flat = tree_flatten_with_path(sample)[0]
        for (path, leaf), (shape, dtype) in zip(flat, shapes):
            if (jnp.shape(leaf)[1:], jnp.result_type(leaf)) != (shape, dtype):
                raise ValueError(
                    f"`mixer.sample`: at leaf `{keystr(path)}`, buffer {which}'s sample has "
                    f"shape {jnp.shape(leaf)[1:]} and dtype {jnp.result_type(leaf)} per row, "
                    f"buffer {first}'s {shape} and {dtype}; the mixer concatenates rows that "
                    "match (the same sequence lengths, among others)."
                )
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *(s for _, s in samples))


def sample_mixer_fn(
    states: Sequence[Any],
    key: PRNGKeyArray,
    prop_batch_sizes: Sequence[int],
    sample_fns: Sequence[Callable[[Any, PRNGKeyArray], PyTree[Array]]],
) -> PyTree[Array]:
    """One batch of `sum(prop_batch_sizes)` rows: buffer `i`'s `sample_fns[i](states[i], key_i)`
    supplies `prop_batch_sizes[i]` rows (its first rows, if it returns more), concatenated in
    buffer order. `make_mixer` passes functions that return exactly their share; a buffer
    whose share is 0 is not sampled. The keys are split from `key`, one per buffer."""
    if not len(states) == len(prop_batch_sizes) == len(sample_fns):
        raise ValueError(
            f"`mixer.sample`: {len(states)} states for {len(sample_fns)} buffers (with "
            f"{len(prop_batch_sizes)} shares); pass one state per buffer, in the buffers' order."
        )
    # flashbax sliced each sample with its share: a negative one dropped rows from the end, a
    # float failed in the slice, and all zeros left nothing to concatenate.
    for i, rows in enumerate(prop_batch_sizes):
        if isinstance(rows, bool) or not isinstance(rows, Integral):
            raise TypeError(
                f"`mixer.sample`: prop_batch_sizes[{i}] must be a Python int (the rows buffer "
                f"{i} supplies), got {rows!r} of type {type(rows).__name__}."
            )
        if rows < 0:
            raise ValueError(
                f"`mixer.sample`: prop_batch_sizes[{i}] must be non-negative (the rows buffer "
                f"{i} supplies), got {rows}."
            )
    if sum(prop_batch_sizes) == 0:
        raise ValueError("`mixer.sample`: prop_batch_sizes are all 0; no buffer supplies a row.")
    keys = jax.random.split(key, len(states))
    samples = [
        (i, _first_rows(sample_fn(state, keys[i]), rows, i))
        for i, (state, rows, sample_fn) in enumerate(zip(states, prop_batch_sizes, sample_fns))
        if rows > 0
    ]
    return _concatenate(samples)


def can_sample_mixer_fn(
    states: Sequence[Any], can_sample_fns: Sequence[Callable[[Any], Array]]
) -> Bool[Array, "..."]:
    """Whether every buffer can be sampled: `can_sample_fns[i](states[i])` for all `i`."""
    if len(states) != len(can_sample_fns):
        raise ValueError(
            f"`mixer.can_sample`: {len(states)} states for {len(can_sample_fns)} buffers; pass "
            "one state per buffer, in the buffers' order."
        )
    each = [can_sample(state) for state, can_sample in zip(states, can_sample_fns)]
    return jnp.all(jnp.asarray(each))


def _shares(sample_batch_size: int, proportions: Sequence[Any]) -> list[int]:
    """flashbax's split of the batch: `int(p * sample_batch_size)` for each normalised
    proportion `p`, the remainder to the first buffer."""
    for i, p in enumerate(proportions):
        try:
            value = float(p)
        except (TypeError, ValueError):
            raise TypeError(
                f"`make_mixer`: proportions[{i}] = {p!r} is not a real number."
            ) from None
        except OverflowError:  # a Python int past the largest float
            raise ValueError(
                f"`make_mixer`: proportions[{i}] is a Python int of {int(p).bit_length()} "
                "bits, too large for a float; rescale the proportions."
            ) from None
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"`make_mixer`: proportions[{i}] = {value} must be finite and non-negative."
            )
    total = sum(proportions)  # in the proportions' own arithmetic, as flashbax sums them
    try:
        total_value = float(total)
    except OverflowError:
        total_value = math.inf
    if not total_value > 0:
        raise ValueError("`make_mixer`: the proportions sum to 0; give at least one a weight.")
    if not math.isfinite(total_value):  # every share would be 0, the batch the first buffer's
        raise ValueError("`make_mixer`: the proportions sum past the largest float; rescale them.")
    shares = [int(p / total * sample_batch_size) for p in proportions]
    shares[0] += sample_batch_size - sum(shares)
    if shares[0] < 0:  # only if normalising rounded the proportions up past 1
        raise ValueError(
            f"`make_mixer`: the proportions {list(proportions)} give the shares {shares}; "
            "rescale them (for example so that they sum to 1)."
        )
    return shares


def _resized(buffer: Any, rows: int) -> Callable:
    """`buffer`'s sample of `rows` rows, through its `sample_n` (made by this layer's
    `make_*` functions); without one (a custom `sample`), flashbax's way: its own batch, of
    which the mixer keeps the first `rows`."""
    sample_n = getattr(buffer, "sample_n", None)
    if sample_n is None:
        return buffer.sample
    return functools.partial(sample_n, batch_size=rows)


def make_mixer(
    buffers: Sequence[Any], sample_batch_size: int, proportions: Sequence[Real[ArrayLike, ""]]
) -> Mixer:
    """flashbax's `make_mixer`: sample several buffers of one kind together.

    **Arguments** (flashbax's):

    - `buffers`: the buffers' containers, all of one type (trajectory, flat and item buffers
        share one; the prioritised ones another), whose samples differ at most in their batch
        sizes.
    - `sample_batch_size`: the rows of each mixed batch, a positive int.
    - `proportions`: one non-negative weight per buffer; buffer `i` supplies
        `int(proportions[i] / sum(proportions) * sample_batch_size)` rows, and the first
        buffer also the rows that rounding leaves over.

    **Returns:** a `Mixer`: `sample(states, key)` and `can_sample(states)`, where `states` is
    the sequence of the buffers' states.
    """
    if len(buffers) != len(proportions):
        raise ValueError(
            f"`make_mixer`: {len(buffers)} buffers but {len(proportions)} proportions; give one "
            "proportion per buffer."
        )
    if not buffers:
        raise ValueError("`make_mixer`: no buffers; give at least one.")
    # The exact type: a prioritised container is also a `TrajectoryBuffer` (a subclass, as in
    # flashbax), so `isinstance` would take a prioritised buffer after a plain one.
    kind = type(buffers[0])
    for i, buffer in enumerate(buffers):
        if type(buffer) is not kind:
            raise TypeError(
                f"`make_mixer`: buffer {i} is a {type(buffer).__name__} and buffer 0 a "
                f"{kind.__name__}; all buffers must be of one type."
            )
    if isinstance(sample_batch_size, bool) or not isinstance(sample_batch_size, Integral):
        raise TypeError(
            f"`make_mixer`: sample_batch_size must be an int, got {sample_batch_size!r}."
        )
    if sample_batch_size <= 0:
        raise ValueError(
            f"`make_mixer`: sample_batch_size must be positive, got {sample_batch_size}."
        )
    shares = _shares(int(sample_batch_size), proportions)
    return Mixer(
        sample=functools.partial(
            sample_mixer_fn,
            prop_batch_sizes=shares,
            sample_fns=[_resized(b, rows) for b, rows in zip(buffers, shares)],
        ),
        can_sample=functools.partial(
            can_sample_mixer_fn, can_sample_fns=[b.can_sample for b in buffers]
        ),
    )
