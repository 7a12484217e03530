"""Mixtures: one batch drawn from several sources, with exactly the stated number of rows from
each (`Mixture`, `Part`, `MixedSample`).

A source is a part: a trajectory buffer (or a layer over one: a global buffer, a rate-limited
buffer) and what to draw from it, as its `sample` would (a `Window` or an `NStep`, the online
queue or the replay window, priorities, policy age, relabelling). Each part draws by its
buffer's own law, through the buffer's own `sample_by`, so that every layer draws and counts
as it does for `sample`; the mixture only decides how many rows each part gives and puts the
rows together.

With static fractions each part draws exactly its rows. With traced fractions (a schedule
inside `jit`) the counts are data, and shapes are not: each part draws a static number of rows
(the batch, or what its `max_fraction` allows), of which the first `count` are kept
(`KeptRows`), and the batch is gathered from the kept rows.
"""

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer, Source
from ._checks import check_positive_int
from ._episode_laws import WholeEpisode
from ._faults import check_faults, Fault, recording
from ._laws import KeptRows, mixture_rows
from ._nstep import NStep
from ._policy_age import PolicyAge
from ._relabel import Relabel
from ._results import Result, result_of
from ._windows import Window


# How far the fractions' sum may be from 1 (float32 arithmetic of a schedule such as
# `(f, 1 - f)` is well within it; a sum off by more is a mistake, not rounding).
_TOLERANCE = 1e-5


class MixedSample(NamedTuple):
    """What `Mixture.sample` returns.

    **Fields:**

    - `sample`: the rows, `batch` of them, as the parts' laws give them: a `SequenceSample`
        (windows) or `Transitions` (n-step transitions), the rows of part 0 first, then part
        1's, and so on (in the order the mixture's parts were given). A prioritised, aged or
        relabelled part gives the rows of its sample (`PrioritisedSequenceSample.sample`,
        ...); its importance weights are in `weights`.
    - `source`: int32 `(batch,)`, the part each row comes from (its place in `Mixture.names`).
    - `weights`: `(batch,)`, each row's importance weight within its part, exactly as a sample
        of that part's rows alone gives them (normalised over the part's own rows); 1 for a
        part whose law has none. In the widest float dtype of the parts' weights.
    - `counts`: int32 `(parts,)`, the rows each part gave (traced when the fractions are).
    - `result`: with buffers made with `throw=False`, the `Result` of the call (the faults of
        every part's draw, the rate law's refusals included, and of the fractions); `None`
        otherwise. `result.check()` raises its message on the host.
    """

    sample: Any
    source: Int[Array, " batch"]
    weights: Float[Array, " batch"]
    counts: Int[Array, " parts"]
    result: Result | None = None


class Part(eqx.Module):
    """One source of a `Mixture`: the buffer it draws from (by its name in the mapping of
    buffers given to `Mixture.sample`) and what it draws, with the options of that buffer's
    `sample` (see `AbstractTrajectoryBuffer.sample`).

    Two parts may name one buffer (its replay window and its online queue, say): they draw
    from it one after the other, and a rate-limited buffer counts both.
    """

    buffer: str = eqx.field(static=True)
    what: Window | NStep | WholeEpisode | None
    source: Source | None = eqx.field(static=True)
    distribution_power: Real[ArrayLike, ""] | None
    discount: Real[ArrayLike, ""] | None
    beta: Real[ArrayLike, ""] | None
    age: PolicyAge | None
    relabel: Relabel | None
    max_fraction: float | None = eqx.field(static=True)

    def __init__(
        self,
        buffer: str,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        source: Source | None = None,
        distribution_power: Real[ArrayLike, ""] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
        max_fraction: float | None = None,
    ):
        """**Arguments:**

        - `buffer`: the name of the buffer this part draws from, a key of the mapping given
            to `Mixture.sample`.
        - `what`, `source`, `distribution_power`, `discount`, `beta`, `age`, `relabel`: as for
            that buffer's `sample` (`source` one of `"replay"` and `"online"`: for several
            sources of one buffer, give one part each).
        - `max_fraction`: with traced fractions, the largest fraction this part is ever
            given (static, in `(0, 1]`; default 1): it draws `ceil(max_fraction · batch)`
            rows a call instead of `batch`. A fraction whose rows pass it is a fault. No
            effect with static fractions, where every part draws exactly its rows.

        **Raises:** `TypeError`/`ValueError` at once for a `buffer` that is not a string, a
        `source` mapping, or a `max_fraction` out of range. The other options are checked
        by the buffer, when the mixture draws.
        """
        if not isinstance(buffer, str):
            raise TypeError(f"`Part(buffer=...)` must be a buffer's name (a str), got {buffer!r}.")
        if isinstance(source, Mapping):
            raise TypeError(
                "`Part(source=...)` is one source (`'replay'` or `'online'`); for both, give "
                "the mixture one part for each."
            )
        if max_fraction is not None:
            if isinstance(max_fraction, bool) or not isinstance(max_fraction, int | float):
                raise TypeError(
                    f"`Part(max_fraction=...)` must be a Python float, got {max_fraction!r}."
                )
            if not 0 < max_fraction <= 1:
                raise ValueError(f"`Part(max_fraction=...)` must be in (0, 1], got {max_fraction}.")
            max_fraction = float(max_fraction)
        self.buffer, self.what, self.source = buffer, what, source
        self.distribution_power, self.discount, self.beta = distribution_power, discount, beta
        self.age, self.relabel, self.max_fraction = age, relabel, max_fraction


class Mixture(eqx.Module):
    """Batches drawn from several sources at once, with exactly the stated number of rows from
    each: offline data beside online data, the online queue beside the replay window, a
    prioritised replay beside recent data.

    For fractions `f_0, ..., f_{k-1}` (summing to 1) and a batch of `B` rows, part `i` gives
    `n_i = c_{i+1} - c_i` rows, where `c_i = floor(B · (f_0 + ... + f_{i-1}) + 1/2)` and
    `c_k = B`: with two parts, exactly `round(f_0 · B)` rows (halves up) from the first and
    the rest from the second; in general each `n_i` is `floor(f_i · B)` or `ceil(f_i · B)`,
    and they add up to `B`. The rows of each part are drawn by its buffer's law as that
    buffer's `sample` draws `n_i` rows (a part of 0 rows is not drawn from, and may be
    empty), each part from its own key (split from the call's).

    Fractions may be Python floats (the counts are then static and each part draws exactly
    its rows: a mixture costs what its parts' samples cost) or JAX scalars (an annealing
    schedule inside `jit`; each part then draws a static number of rows, the batch or what its
    `max_fraction` allows, and keeps its first `n_i`, which needs a law whose rows are
    independent: not a stratified one, not `relabel`).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(3), "done": jnp.zeros((), bool)}
        steps = {"obs": jnp.ones((2, 10, 3)), "done": jnp.zeros((2, 10), bool)}
        offline = dx.TrajectoryBuffer(step, 2, 10).extend(steps)
        online = dx.TrajectoryBuffer(step, 2, 10).extend(steps)
        window = dx.Window(4, strict=True)
        mixture = dx.Mixture({
            "offline": dx.Part("offline", window),
            "online": dx.Part("online", window),
        })
        update = jnp.asarray(2_500.0)  # a step counter, traced inside `jit`
        fraction = 0.5 * jnp.maximum(1.0 - update / 10_000, 0.0)  # annealed to 0
        buffers, batch = mixture.sample(
            jax.random.key(0), 16, {"offline": offline, "online": online},
            {"offline": fraction, "online": 1.0 - fraction},
        )
        assert batch.counts.tolist() == [6, 10]  # round(0.375 * 16) offline rows
        assert batch.source.tolist() == [0] * 6 + [1] * 10
        ```
    """

    parts: dict[str, Part]

    def __init__(self, parts: Mapping[str, Part]):
        """**Arguments:**

        - `parts`: a mapping of part names to `Part`s, in the order the batch takes them.

        **Raises:** `TypeError`/`ValueError` at once for an empty mapping, a name that is not
        a string, or a value that is not a `Part`.
        """
        call = "Mixture"
        if not isinstance(parts, Mapping) or not parts:
            raise ValueError(
                f"`{call}(parts=...)` must be a non-empty mapping of names to `dx.Part`s, "
                f"got {parts!r}."
            )
        for name, part in parts.items():
            if not isinstance(name, str):
                raise TypeError(f"`{call}(parts=...)`: part names must be strings, got {name!r}.")
            if not isinstance(part, Part):
                raise TypeError(
                    f"`{call}(parts=...)`: part {name!r} must be a `dx.Part`, got "
                    f"{type(part).__name__}."
                )
        self.parts = dict(parts)

    @property
    def names(self) -> tuple[str, ...]:
        """The parts' names, in the batch's order (`MixedSample.source` indexes them)."""
        return tuple(self.parts)

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        buffers: Mapping[str, Any],
        fractions: (
            Mapping[str, Real[ArrayLike, ""]]
            | Sequence[Real[ArrayLike, ""]]
            | Real[ArrayLike, " parts"]
        ),
    ) -> tuple[dict[str, Any], MixedSample]:
        """Draw `batch_size` rows: `n_i` from part `i` (see `Mixture`), with replacement.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: the number of rows, a positive Python int (static).
        - `buffers`: a mapping of names to trajectory buffers (or layers over them: a
            `GlobalTrajectoryBuffer`, a `RateLimited` buffer); every part's `buffer` must
            be one of them, and each of them the buffer of some part. All made with one
            `throw`.
        - `fractions`: each part's fraction of the batch: a mapping of every part's name to a
            real scalar, or a sequence or array of one per part, in the parts' order.
            Non-negative and finite, summing to 1 (within 1e-5). Python numbers are static
            (exact counts, no waste); JAX scalars are traced (counts computed in float32).

        **Returns:** `(buffers, sample)`: the buffers after the draw (a rate-limited one has
        counted its parts' rows; the others are as given), under the same names, and a
        `MixedSample`.

        **Raises:** `TypeError`/`ValueError` at once for bad static arguments (a missing or
        unused buffer, a buffer that is not a trajectory buffer, buffers made with different
        `throw`, fractions for other parts, static fractions out of range, parts whose rows
        differ in structure or shape, a traced fraction for a part whose law's rows are not
        independent); an `eqx.error_if` error (or, with `throw=False`, a fault in
        `sample.result`) for traced fractions out of range or past a part's `max_fraction`,
        and for what each part's draw raises (nothing to draw in a part that gives rows,
        the rate law's refusal).
        """
        call = "Mixture.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        buffers = self._checked_buffers(buffers, call)
        throws = {getattr(b, "result", None) is None for b in buffers.values()}
        if len(throws) > 1:
            raise TypeError(
                f"`{call}`: the buffers were made with different `throw`; a mixture reports "
                "its faults one way: make them all with `throw=True` or all with `throw=False`."
            )
        (throw,) = throws
        values = self._fraction_values(fractions, call)
        out, faults = recording(
            lambda: self._sample(key, batch_size, buffers, values, call), record=not throw
        )
        new, sample = out
        if faults is not None:
            sample = sample._replace(result=result_of(faults))
        return new, sample

    # --- the pieces -------------------------------------------------------------------------

    def _checked_buffers(self, buffers: Any, call: str) -> dict[str, Any]:
        if not isinstance(buffers, Mapping):
            raise TypeError(
                f"`{call}(buffers=...)` must be a mapping of names to buffers, got "
                f"{type(buffers).__name__}."
            )
        named = {part.buffer for part in self.parts.values()}
        missing = [n for n in named if n not in buffers]
        if missing:
            raise ValueError(
                f"`{call}(buffers=...)`: no buffer named {missing[0]!r}, which a part draws "
                f"from; the mapping has {sorted(map(str, buffers))}."
            )
        unused = [n for n in buffers if n not in named]
        if unused:
            raise ValueError(
                f"`{call}(buffers=...)`: no part draws from the buffer named {unused[0]!r}; "
                "give only the buffers the parts name."
            )
        for name, buffer in buffers.items():
            if not isinstance(buffer, AbstractTrajectoryBuffer):
                raise TypeError(
                    f"`{call}(buffers=...)`: {name!r} is a {type(buffer).__name__}; a "
                    "mixture draws windows or transitions of trajectory buffers (a "
                    "TrajectoryBuffer, a PrioritisedTrajectoryBuffer, or a global or "
                    "rate-limited layer over one)."
                )
        return dict(buffers)

    def _fraction_values(self, fractions: Any, call: str) -> list[Any]:
        """One fraction per part, in the parts' order (Python numbers or arrays)."""
        names = self.names
        where = f"{call}(fractions=...)"
        if isinstance(fractions, Mapping):
            if set(fractions) != set(names):
                raise ValueError(
                    f"`{where}` must give a fraction for each part, {list(names)}; got "
                    f"{list(fractions)}."
                )
            values = [fractions[n] for n in names]
        elif isinstance(fractions, list | tuple):
            values = list(fractions)
        else:
            array = jnp.asarray(fractions)
            if array.ndim != 1:
                raise ValueError(
                    f"`{where}`: an array of fractions must have one axis (one per part), "
                    f"got shape {array.shape}."
                )
            values = list(array)
        if len(values) != len(names):
            raise ValueError(
                f"`{where}`: {len(values)} fractions for {len(names)} parts {list(names)}."
            )
        for name, value in zip(names, values):
            if isinstance(value, bool) or not isinstance(
                value, int | float | jax.Array | np.ndarray
            ):
                raise TypeError(
                    f"`{where}`: the fraction of part {name!r} must be a real scalar, got "
                    f"{value!r}."
                )
            if isinstance(value, jax.Array | np.ndarray) and (
                value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating)
            ):
                raise TypeError(
                    f"`{where}`: the fraction of part {name!r} must be a float scalar, got an "
                    f"array of shape {value.shape} and dtype {value.dtype}."
                )
        return values

    def _sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        buffers: dict[str, Any],
        values: list[Any],
        call: str,
    ) -> tuple[dict[str, Any], MixedSample]:
        names, parts = self.names, list(self.parts.values())
        static = all(isinstance(v, int | float) for v in values)
        if static:
            counts: Any = static_counts(values, batch_size, names, call)
            sizes, faults = list(counts), []
        else:
            counts, faults = traced_counts(values, batch_size, call)
            sizes = [self._capacity(part, batch_size) for part in parts]
            faults += [
                (
                    counts[i] > sizes[i],
                    f"`{call}`: part {name!r} was given more rows than its max_fraction = "
                    f"{part.max_fraction} allows ({sizes[i]} of {batch_size})",
                )
                for i, (name, part) in enumerate(zip(names, parts))
                if sizes[i] < batch_size
            ]
        keys = jax.random.split(key, len(parts))
        drawn: list[tuple[int, Any, Any]] = []  # (part, rows, weights)
        for i, (name, part) in enumerate(zip(names, parts)):
            buffer = buffers[part.buffer]
            where = f"{call} (part {name!r})"
            law, law_faults = buffer.law(
                part.what,
                distribution_power=part.distribution_power,
                source=part.source,
                discount=part.discount,
                beta=part.beta,
                age=part.age,
                relabel=part.relabel,
                call=where,
            )
            if sizes[i] == 0:
                continue  # static: a part of no rows is not drawn from
            rows = None
            if not static:
                if not law.independent_rows:
                    raise TypeError(
                        f"`{call}`: part {name!r} draws by a law whose rows depend on the "
                        "batch (a stratified draw, or relabelling, which relabels the last "
                        "rows): it cannot keep a traced number of them. Give static "
                        "fractions, or draw that part without stratification or relabelling."
                    )
                rows = counts[i]
                law = KeptRows(law, rows)
            buffer, out = buffer.sample_by(law, keys[i], sizes[i], law_faults, where, rows=rows)
            buffers[part.buffer] = buffer
            try:
                got = mixture_rows(out)
            except TypeError as error:
                raise TypeError(f"`{call}`: part {name!r}: {error}") from None
            drawn.append((i, got.rows, got.weights))
        rows, weights = _together(drawn, names, call)
        sizes_drawn = [sizes[i] for i, _, _ in drawn]
        if static:
            source = jnp.asarray(np.repeat(np.arange(len(parts), dtype=np.int32), counts))
            out_rows, out_weights = rows, weights
        else:
            # Row r of the batch is the (r - ends[s])-th kept row of the part s whose rows
            # hold it; the parts drawn are laid end to end in `rows`.
            ends = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)])
            r = jnp.arange(batch_size, dtype=jnp.int32)
            source = (jnp.searchsorted(ends[1:], r, side="right")).astype(jnp.int32)
            offsets = np.zeros(len(parts), np.int32)
            offsets[[i for i, _, _ in drawn]] = np.cumsum([0, *sizes_drawn[:-1]])
            at = jnp.asarray(offsets)[source] + r - ends[source]
            out_rows = jax.tree.map(lambda x: x[at], rows)
            out_weights = weights[at]
        sample = MixedSample(out_rows, source, out_weights, jnp.asarray(counts, jnp.int32))
        return buffers, check_faults(sample, faults, order_reads=False)

    def _capacity(self, part: Part, batch_size: int) -> int:
        """The rows a part draws when the fractions are traced."""
        if part.max_fraction is None:
            return batch_size
        return min(batch_size, math.ceil(Fraction(part.max_fraction) * batch_size))


def static_counts(
    fractions: Sequence[float], batch_size: int, names: Sequence[str], call: str
) -> list[int]:
    """The rows of each part for Python fractions (see `Mixture`), in exact arithmetic.

    **Raises:** `ValueError` for a fraction that is negative or not finite, or fractions that
    do not sum to 1 (within 1e-5), naming the part."""
    for name, value in zip(names, fractions):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"`{call}(fractions=...)`: the fraction of part {name!r} must be finite "
                f"and non-negative, got {value}."
            )
    exact = [Fraction(v) for v in fractions]
    total = sum(exact, Fraction(0))
    if abs(total - 1) > Fraction(_TOLERANCE):
        raise ValueError(
            f"`{call}(fractions=...)`: the fractions sum to {float(total)}; they must sum "
            f"to 1 (within {_TOLERANCE})."
        )
    ends, running = [0], Fraction(0)
    for value in exact[:-1]:
        running += value
        ends.append(math.floor(batch_size * running / total + Fraction(1, 2)))
    ends.append(batch_size)
    return [ends[i + 1] - ends[i] for i in range(len(exact))]


def traced_counts(
    fractions: Sequence[Real[ArrayLike, ""]], batch_size: int, call: str
) -> tuple[Int[Array, " parts"], list[Fault]]:
    """The rows of each part for traced fractions (see `Mixture`), in float32, and the
    fractions' faults (each message quoting `call`)."""
    f = jnp.stack([jnp.asarray(v, jnp.float32) for v in fractions])
    total = jnp.sum(f)
    ok_total = jnp.isfinite(total) & (total > 0)
    share = jnp.cumsum(f) / jnp.where(ok_total, total, 1)
    ends = jnp.floor(batch_size * share[:-1] + 0.5)
    ends = jnp.clip(jnp.where(jnp.isfinite(ends), ends, 0), 0, batch_size).astype(jnp.int32)
    ends = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, jnp.full(1, batch_size, jnp.int32)])
    faults: list[Fault] = [
        (
            ~jnp.all(jnp.isfinite(f) & (f >= 0)),
            f"`{call}`: every fraction must be finite and non-negative",
        ),
        (
            ~(jnp.abs(total - 1) <= _TOLERANCE),
            f"`{call}`: the fractions must sum to 1 (within {_TOLERANCE})",
        ),
    ]
    return jnp.diff(ends), faults


def _together(
    drawn: list[tuple[int, Any, Any]], names: tuple[str, ...], call: str
) -> tuple[PyTree[Array], Float[Array, " rows"]]:
    """The parts' rows laid end to end, after checking that they match, and their weights
    (1 where a part has none), in the widest of the parts' weight dtypes."""
    if not drawn:  # static fractions give the batch's rows to some part
        raise AssertionError("no part drew")
    first, first_rows, _ = drawn[0]
    like = jax.tree.structure(first_rows)
    shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(first_rows)]
    for i, rows, _ in drawn[1:]:
        if (
            jax.tree.structure(rows) != like
            or [(x.shape[1:], x.dtype) for x in jax.tree.leaves(rows)] != shapes
        ):
            raise TypeError(
                f"`{call}`: the rows of part {names[i]!r} differ from those of part "
                f"{names[first]!r} in structure, shape or dtype ({_describe(rows)} against "
                f"{_describe(first_rows)}); a batch mixes rows of one kind (windows of one "
                "length, or transitions of one `NStep`, with one item spec)."
            )
    dtypes = [w.dtype for _, _, w in drawn if w is not None]
    dtype = max(dtypes, key=lambda d: d.itemsize) if dtypes else jnp.dtype(jnp.float32)
    weights = [
        jnp.ones(jax.tree.leaves(rows)[0].shape[0], dtype) if w is None else w.astype(dtype)
        for _, rows, w in drawn
    ]
    rows = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[rows for _, rows, _ in drawn])
    return rows, jnp.concatenate(weights)


def _describe(rows: Any) -> str:
    leaves = jax.tree.leaves_with_path(rows)
    shown = ", ".join(f"{jax.tree_util.keystr(p)}: {x.dtype}{list(x.shape[1:])}" for p, x in leaves)
    return f"{type(rows).__name__}({shown})"
