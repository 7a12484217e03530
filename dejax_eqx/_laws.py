"""How a buffer's samples are drawn: each buffer states its laws (`AbstractLaw`), and every layer
that draws evaluates them the same way.

A law is evaluated over a *union*: one buffer, or several buffers of one configuration (the
shards of a global buffer, the clusters of a `ClusteredReplay`). Each buffer gives a few
numbers (`summary`: a size, a total mass, per-env lengths); with those of every buffer of the
union, stacked, `draw` decides every row (which buffer, and where in it) the same way wherever
it runs; the buffer that owns a row reads it (`read`); and `finish` names the rows in the
union (global indices, env ids) and gives their probabilities. A single buffer is the union of
one, so `sample` and a global buffer's draw run the same code, and the global draw *is* the
single buffer's draw of the buffers' contents laid end to end.
"""

import abc
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ._faults import check_faults, Fault


class Draw(NamedTuple):
    """The rows a law drew from a union of buffers.

    **Fields:**

    - `owner`: int32 `(batch,)`, the buffer of the union each row comes from (its place in
        the stack of summaries; 0 for a single buffer).
    - `at`: where in that buffer: a pytree of arrays with a leading `batch` axis, in the
        buffer's own coordinates, and in range for any buffer of the union's configuration (a
        buffer that does not own a row reads it anyway, and its read is discarded).
    """

    owner: Int[Array, " batch"]
    at: PyTree[Array]


class AbstractLaw(eqx.Module):
    """One way of drawing rows from a buffer, stated by the buffer's class: what can be drawn,
    with what weight, how a row is read, and how it is named.

    Laws are small modules (their options are static fields, a traced exponent an array
    field) made by a buffer's `law(...)`. The union they are evaluated over is given by the
    *summaries*: the `summary` of each of its buffers, stacked along a leading axis.
    """

    @abc.abstractmethod
    def summary(self, buffer: Any) -> PyTree[Array]:
        """The numbers of `buffer` that `draw` needs (small: they cross devices)."""

    @abc.abstractmethod
    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        """`batch_size` rows drawn from the union whose buffers' summaries are stacked in
        `summaries`. A pure function of its arguments: every device that holds a buffer of the
        union draws the same rows."""

    @abc.abstractmethod
    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        """The rows of `buffer` at `at` (from `draw`), each leaf with a leading `batch` axis."""

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> Any:
        """The sample, from the rows every buffer read for the rows it owns: named in the
        union (global indices and env ids), with probabilities and weights. By default the
        rows as they are."""
        return rows

    @abc.abstractmethod
    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        """Whether the union holds anything this law can draw (a cluster that holds nothing
        drawable is never chosen)."""

    @abc.abstractmethod
    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        """The faults of a draw from the union (nothing to draw, a total that is not
        finite), each message quoting `call`."""

    @property
    def independent_rows(self) -> bool:
        """Whether the first `n` rows of a draw of `m >= n` rows are a draw of `n` rows by
        this law (i.i.d. rows): what a part of a mixture needs when its number of rows is
        traced (`KeptRows`). Not so for a stratified law (its rows split the total into
        `m` slices) or one that treats rows by their place in the batch."""
        return True


def stacked(tree: PyTree[Array]) -> PyTree[Array]:
    """One buffer's summary as the stacked summaries of a union of one."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def draw_from(law: AbstractLaw, buffer: Any, key: PRNGKeyArray, batch_size: int) -> tuple[Any, Any]:
    """The law evaluated over `buffer` alone: `(sample, summaries)`, unchecked."""
    summaries = stacked(law.summary(buffer))
    drawn = law.draw(key, batch_size, summaries)
    return law.finish(law.read(buffer, drawn.at), drawn, summaries), summaries


def sample_with(
    law: AbstractLaw,
    buffer: Any,
    key: PRNGKeyArray,
    batch_size: int,
    faults: Sequence[Fault],
    call: str,
) -> Any:
    """A buffer's `sample`: the law over `buffer` alone, with the faults of its arguments
    (`faults`) and of the draw checked once."""
    out, summaries = draw_from(law, buffer, key, batch_size)
    return check_faults(out, [*faults, *law.faults(summaries, call)], order_reads=False)


def locate(targets: Array, masses: Array) -> tuple[Int[Array, " batch"], Array]:
    """For each target in `[0, Σ masses)`, the buffer of the union whose slice of the total
    holds it and the target's place in that slice. `masses` is `(buffers,)` or, one union per
    row, `(batch, buffers)`. A buffer of zero mass is never chosen; a target rounded up to the
    total goes to the last buffer of positive mass. For a union of one, the targets as they
    are."""
    if masses.shape[-1] == 1:
        return jnp.zeros(targets.shape, jnp.int32), targets
    ends = jnp.cumsum(masses, axis=-1)
    if masses.ndim == 1:
        owner = jnp.searchsorted(ends, targets, side="right", method="compare_all")
        owner = jnp.minimum(owner, jnp.argmax(ends)).astype(jnp.int32)
        begin = (ends - masses)[owner]
        return owner, jnp.minimum(targets - begin, masses[owner])
    owner = jnp.sum(ends <= targets[:, None], axis=-1)
    owner = jnp.minimum(owner, jnp.argmax(ends, axis=-1)).astype(jnp.int32)
    rows = jnp.arange(targets.shape[0])
    begin = (ends - masses)[rows, owner]
    return owner, jnp.minimum(targets - begin, masses[rows, owner])


def float_targets(
    key: PRNGKeyArray, batch_size: int, total: Float[Array, "*b"], stratified: bool
) -> Float[Array, " batch"]:
    """`batch_size` targets in `[0, total)`, in the dtype of `total` (a scalar, or one per
    row): i.i.d. uniform, or one from each of `batch_size` equal slices of the total when
    `stratified`. The target rule of every draw by mass (a sum tree's, an age-weighted one)."""
    dtype = total.dtype
    uniform = jax.random.uniform(key, (batch_size,), dtype)
    if stratified:
        return (jnp.arange(batch_size, dtype=dtype) + uniform) * (total / batch_size)
    return uniform * total


def probability(value: Float[Array, "*#b"], total: Float[Array, "*#b"]) -> Float[Array, "*#b"]:
    """`value / total`, and 0 (never NaN) where the total is not positive."""
    positive = total > 0
    return jnp.where(positive, value / jnp.where(positive, total, 1), 0)


def single(summaries: PyTree[Array]) -> bool:
    """Whether stacked `summaries` are those of one buffer (known at trace time)."""
    return jax.tree.leaves(summaries)[0].shape[0] == 1


def in_union(
    owner: Int[Array, " batch"], local: Int[Array, " batch"], size: int
) -> Int[Array, " batch"]:
    """A name in the union from a buffer's own: buffer `owner`'s name `local` is `owner ·
    size + local`, where `size` is how many names each buffer has (its capacity, its
    envs). `split_union` is the inverse."""
    return local + owner * size


def split_union(name: Int[Array, "*n"], size: int) -> tuple[Int[Array, "*n"], Int[Array, "*n"]]:
    """`(owner, local)` of names in the union (see `in_union`), for non-negative names."""
    return name // size, name % size


class Candidates(NamedTuple):
    """Every candidate of a law that can be enumerated, for a draw that reweighs them (policy
    age): one entry per candidate, flat.

    **Fields:**

    - `log_law`: the log of the part of each candidate's weight that the law chooses (not
        corrected by importance weights), `-inf` where it cannot be drawn.
    - `log_mass`: the log of the part that importance weights correct (priorities), or
        `None`.
    - `items`: the stored items that date the candidates, a pytree with a leading axis (a
        window is dated by its first step).
    - `stored`: whether each of `items` is stored (only those are read).
    - `dates`: the item that dates each candidate (an index into `items`), or `None` if
        candidate `i` is dated by item `i`.
    """

    log_law: Float[Array, " c"]
    log_mass: Float[Array, " c"] | None
    items: PyTree[Array]
    stored: Bool[Array, " s"]
    dates: Int[Array, " c"] | None = None


class AbstractEnumerableLaw(AbstractLaw):
    """A law whose candidates can be listed and weighed one by one (O(candidates) per draw),
    so that a draw can reweigh them: what `PolicyAge` needs."""

    @abc.abstractmethod
    def candidates(self, buffer: Any) -> Candidates:
        """Every candidate of `buffer`, flat."""

    @abc.abstractmethod
    def read_candidates(self, buffer: Any, index: Int[Array, " batch"]) -> PyTree[Array]:
        """The rows of candidates `index` of `buffer` (as `sample` gives its rows)."""

    def name_candidates(
        self, rows: PyTree[Array], owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> PyTree[Array]:
        """`rows` named in the union (global env ids); by default as they are."""
        return rows

    @abc.abstractmethod
    def num_candidates(self, buffer: Any) -> int:
        """How many candidates `buffer` has (static): a candidate's index in the union is
        `owner · num_candidates + index`."""

    def finish_drawn(
        self,
        rows: PyTree[Array],
        index: Int[Array, " batch"],
        probabilities: Float[Array, " batch"],
        log_mass: Float[Array, " batch"],
        owner: Int[Array, " batch"],
        summaries: PyTree[Array],
    ) -> Any:
        """The sample of candidates `index` drawn by a law that lists them (`CandidateLaw`:
        read as `rows`, with their probabilities and log masses), named in the union whose
        summaries (this law's) are `summaries`. By default the rows named
        (`name_candidates`); a law with masses gives its weights here."""
        return self.name_candidates(rows, owner, summaries)

    def generations(self, buffer: Any, index: Int[Array, " batch"]) -> Array | None:
        """The write generation of candidates `index`, for a later priority update that must
        not land on newer data; `None` where the buffer has none."""
        return None


def finite_top(top: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """A scale for weights whose largest log is `top`: 0 when none is finite."""
    return jnp.where(jnp.isfinite(top), top, 0)


def weights_summary(log_p: Float[Array, " c"]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """What a buffer of candidates of log weights `log_p` tells a draw over a union: the
    largest log weight (its scale) and the sum of the weights on that scale."""
    top = jnp.max(log_p)
    return top, jnp.sum(jnp.exp(log_p - finite_top(top)))


def union_scales(
    tops: Float[Array, " k"], totals: Float[Array, " k"]
) -> tuple[Float[Array, " k"], Float[Array, " k"]]:
    """Each buffer's factor from its own scale to the union's, and its mass on the union's
    scale (0 for a buffer with nothing to draw), from its `weights_summary`."""
    union = finite_top(jnp.max(tops))
    scale = jnp.where(jnp.isfinite(tops), jnp.exp(tops - union), 0)
    return scale, totals * scale


def draw_weighed(
    key: PRNGKeyArray,
    batch_size: int,
    tops: Float[Array, " k"],
    totals: Float[Array, " k"],
    stratified: bool,
) -> Draw:
    """Rows drawn over a union of buffers of listed candidates: the buffer whose slice of
    the total holds each target, and the target on that buffer's own scale (`at`), where
    `find_weighed` finds the candidate. A draw by inverse CDF over every candidate."""
    scale, masses = union_scales(tops, totals)
    targets = float_targets(key, batch_size, jnp.sum(masses), stratified)
    owner, residual = locate(targets, masses)
    at = jnp.where(scale[owner] > 0, residual / jnp.where(scale[owner] > 0, scale[owner], 1), 0)
    return Draw(owner, at)


def find_weighed(
    log_p: Float[Array, " c"], at: Float[Array, " batch"]
) -> tuple[Int[Array, " batch"], Float[Array, " c"]]:
    """The candidate of each target `at` (on this buffer's scale) among candidates of log
    weights `log_p`, and every candidate's weight on that scale. The first candidate whose
    cumulative weight exceeds the target: never one of weight 0, whose cumulative weight
    equals its predecessor's; a target rounded up to the total goes to the last candidate of
    positive weight."""
    weight = jnp.exp(log_p - finite_top(jnp.max(log_p)))
    cdf = jnp.cumsum(weight)
    index = jnp.searchsorted(cdf, at, side="right", method="scan_unrolled")
    last = weight.shape[0] - 1 - jnp.argmax(weight[::-1] > 0)
    return jnp.minimum(index, last).astype(jnp.int32), weight


class CandidateRows(NamedTuple):
    """What a `CandidateLaw` reads: the rows (`sample`, as `read_candidates` gives them; so
    named that a law over the law, relabelling, finds them where it finds a prioritised
    sample's windows), which candidates they are, their weights on the buffer's scale and
    their log masses."""

    sample: Any
    candidate: Int[Array, " batch"]
    weight: Float[Array, " batch"]
    log_mass: Float[Array, " batch"]


class CandidateLaw(AbstractEnumerableLaw):
    """A law drawn by listing its candidates (`candidates`), each with probability in
    proportion to its weight (`log_law` plus `log_mass`), by inverse CDF over their
    cumulative sum: O(candidates) per draw. Over a union, each buffer's weights are scaled by
    its own largest (so that none overflows) and summarised by that scale and their sum.

    For the laws whose candidates are not drawn in closed form: windows that start at an
    episode's first step, whole episodes. `finish` names the rows in the union and gives
    probabilities (and weights, where there are masses to correct) through `finish_drawn`.
    """

    stratified: eqx.AbstractVar[bool]
    """Whether a batch takes one row from each of its equal slices of the total (static)."""

    @property
    def independent_rows(self) -> bool:
        return not self.stratified

    @abc.abstractmethod
    def inner_summary(self, buffer: Any) -> PyTree[Array]:
        """The numbers of `buffer` that the faults need (the summary of a law this one is
        made over), beside the weights' own."""

    def summary(self, buffer: Any) -> PyTree[Array]:
        c = self.candidates(buffer)
        log_p = c.log_law if c.log_mass is None else c.log_law + c.log_mass
        return self.inner_summary(buffer), *weights_summary(log_p)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        _, tops, totals = summaries
        return draw_weighed(key, batch_size, tops, totals, self.stratified)

    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        c = self.candidates(buffer)
        log_p = c.log_law if c.log_mass is None else c.log_law + c.log_mass
        index, weight = find_weighed(log_p, at)
        mass = jnp.zeros_like(weight) if c.log_mass is None else c.log_mass
        return CandidateRows(self.read_candidates(buffer, index), index, weight[index], mass[index])

    def finish(self, rows: CandidateRows, draw: Draw, summaries: PyTree[Array]) -> Any:
        rows, index, weight, log_mass = rows
        _, tops, totals = summaries
        scale, masses = union_scales(tops, totals)
        probabilities = probability(weight * scale[draw.owner], jnp.sum(masses))
        return self.finish_drawn(rows, index, probabilities, log_mass, draw.owner, summaries)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        _, tops, totals = summaries
        return jnp.sum(union_scales(tops, totals)[1]) > 0


def in_range(x: Int[Array, "*n"], size: int) -> Int[Array, "*n"]:
    """`x` clipped to `[0, size)`: an index in range for any buffer of `size` entries."""
    return jnp.clip(x, 0, size - 1)


class MixedLaw(AbstractLaw):
    """Several laws of one buffer in one batch, with a fixed number of rows from each, in
    order: the rows of each part are drawn as that law alone draws them (each from its own key,
    split from the batch's), and a part of 0 rows is not drawn (its union may be empty). The
    parts' rows must have one structure (windows from two sources of one buffer)."""

    parts: tuple[AbstractLaw, ...]
    sizes: tuple[int, ...] = eqx.field(static=True)
    call: str = eqx.field(static=True)

    def _drawn(self) -> list[int]:
        return [i for i, size in enumerate(self.sizes) if size > 0]

    def summary(self, buffer: Any) -> PyTree[Array]:
        return tuple(part.summary(buffer) for part in self.parts)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        if batch_size != sum(self.sizes):
            raise ValueError(
                f"`{self.call}`: the batch has {batch_size} rows, but its sources give "
                f"{sum(self.sizes)} "
                f"({' + '.join(map(str, self.sizes))}); they must add up to the batch size."
            )
        keys = jax.random.split(key, len(self.parts))
        draws = {i: self.parts[i].draw(keys[i], self.sizes[i], summaries[i]) for i in self._drawn()}
        owner = jnp.concatenate([d.owner for d in draws.values()])
        return Draw(
            owner, tuple(draws[i].at if i in draws else None for i in range(len(self.parts)))
        )

    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        rows = [self.parts[i].read(buffer, at[i]) for i in self._drawn()]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> Any:
        out, first = [], 0
        for i in self._drawn():
            last = first + self.sizes[i]
            part = jax.tree.map(lambda x: x[first:last], rows)
            mine = Draw(draw.owner[first:last], draw.at[i])
            out.append(self.parts[i].finish(part, mine, summaries[i]))
            first = last
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *out)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        drawn = [self.parts[i].available(summaries[i]) for i in self._drawn()]
        return jnp.all(jnp.stack(drawn))

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return [f for i in self._drawn() for f in self.parts[i].faults(summaries[i], call)]

    @property
    def independent_rows(self) -> bool:
        return False  # each part has its rows, in order


class KeptRows(AbstractLaw):
    """`law`, of which a batch keeps only its first `count` rows (traced): a part of a mixture
    whose number of rows is traced, drawn at a static size. The rows past `count` repeat the
    first row, so that what a batch is normalised over (the largest importance weight) is
    the kept rows' alone, as in a draw of `count` rows; the faults of the draw (nothing to
    draw) hold only when `count > 0`, for a part of no rows may be empty.

    `law` must have `independent_rows` (checked by the caller, who names the part)."""

    law: AbstractLaw
    count: Int[Array, ""]

    def summary(self, buffer: Any) -> PyTree[Array]:
        return self.law.summary(buffer)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        drawn = self.law.draw(key, batch_size, summaries)
        kept = jnp.arange(batch_size) < self.count

        def first_past_count(x: Array) -> Array:
            return jnp.where(kept.reshape(-1, *(1,) * (x.ndim - 1)), x, x[:1])

        return jax.tree.map(first_past_count, drawn)

    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        return self.law.read(buffer, at)

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> Any:
        return self.law.finish(rows, draw, summaries)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return self.law.available(summaries) | (self.count == 0)

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return [(pred & (self.count > 0), m) for pred, m in self.law.faults(summaries, call)]


class MixtureRows(NamedTuple):
    """A sample as a part of a mixture sees it: its rows (windows or transitions), and the
    importance weight of each (`None` for a law without weights)."""

    rows: Any
    weights: Float[Array, " batch"] | None


@functools.singledispatch
def mixture_rows(sample: Any) -> MixtureRows:
    """What a part of a mixture gives: each kind of sample registers its own (beside its
    class), saying which of its fields are the rows and which the weights."""
    raise TypeError(
        f"a {type(sample).__name__} cannot be part of a mixture: a part must give windows "
        "or n-step transitions (a `SequenceSample` or `Transitions`, or a prioritised, aged "
        "or relabelled sample of one)."
    )
