"""Every layer over every buffer kind: the matrix.

The layers (policy age, clusters, global buffers over a mesh, rate limiting, the service, the
disk) are each written once, over the families' protocol (`AbstractReplay.law`,
`AbstractTrajectoryBuffer.law`, ...). This file holds every layer to every kind of the
registry, and to `RecentReplay`, a replay defined here, outside the package, which gets every
layer by implementing its family's methods. A pair with no check fails
`test_the_matrix_has_no_hole`, unless `MEANINGLESS` gives the reason it cannot be, which the
guide (`docs/layers.md`) gives too.

The global buffers run on a mesh of every device of this process (`tests/conftest.py` gives it
four CPU devices), so a draw over the union of four shards is checked against the same
buffer's contents in one buffer where the law makes that exact.
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, NamedTuple

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx.internal import Fault, locate
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Real

from .helpers import SLOW
from .registry import BY_NAME, ITEM


ROOT = Path(__file__).parent.parent
GLOBAL = hasattr(jax, "shard_map")  # the global buffers need JAX 0.7+


# ---------------------------------------------------------------------------------------------
# A replay of the family, written outside the package: a ring of items, each sample uniform
# over the newest `recent` of them (a recency window, as DreamerV3 mixes in). It implements
# `AbstractReplay`'s methods, its law included, and nothing of any layer.


class RecentLaw(dx.AbstractEnumerableLaw):
    """Uniform over the newest `recent` stored items; over a union, over every buffer's."""

    recent: int = eqx.field(static=True)
    max_size: int = eqx.field(static=True)

    def summary(self, buffer: "RecentReplay") -> PyTree[Array]:
        return jnp.minimum(buffer.storage.size, self.recent)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> dx.Draw:
        total = jnp.sum(summaries)
        position = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1))
        return dx.Draw(*locate(position, summaries))

    def read(self, buffer: "RecentReplay", at: PyTree[Array]) -> PyTree[Array]:
        return buffer.at_slots(buffer.recent_slot(at))

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return jnp.sum(summaries) > 0

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return [(jnp.sum(summaries) == 0, f"`{call}`: cannot sample from an empty RecentReplay")]

    def candidates(self, buffer: "RecentReplay") -> dx.Candidates:
        slot = jnp.arange(self.max_size, dtype=jnp.int32)
        newer = (buffer.storage.head - 1 - slot) % self.max_size  # 0 for the newest
        recent = newer < jnp.minimum(buffer.storage.size, self.recent)
        stored = newer < buffer.storage.size
        return dx.Candidates(jnp.where(recent, 0.0, -jnp.inf), None, buffer.storage.data, stored)

    def read_candidates(self, buffer: "RecentReplay", index: Int[Array, " b"]) -> PyTree[Array]:
        return buffer.at_slots(index)

    def num_candidates(self, buffer: "RecentReplay") -> int:
        return self.max_size


class RecentReplay(dx.AbstractReplay):
    storage: dx.CircularBuffer
    recent: int = eqx.field(static=True)

    def __init__(self, prototype: Any, max_size: int, recent: int):
        self.storage = dx.CircularBuffer(prototype, max_size)
        self.recent = recent

    @property
    def max_size(self) -> int:
        return self.storage.max_size

    @property
    def size(self) -> Int[Array, ""]:
        return self.storage.size

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.storage.item_spec

    def add(self, item: PyTree[ArrayLike]) -> "RecentReplay":
        return eqx.tree_at(lambda r: r.storage, self, self.storage.push(item))

    def add_batch(
        self, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> "RecentReplay":
        return eqx.tree_at(lambda r: r.storage, self, self.storage.push_batch(items, mask=mask))

    def update(self, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> "RecentReplay":
        return eqx.tree_at(lambda r: r.storage, self, self.storage.update(fn))

    def law(
        self,
        *,
        age: dx.PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "RecentReplay.law",
    ) -> tuple[dx.AbstractLaw, list[Fault]]:
        base = RecentLaw(self.recent, self.max_size)
        if age is None:
            return base, []
        return dx.AgedLaw(base, self, age, call=call), []

    # Its own reads (no checks: the law's draw is in range).
    def recent_slot(self, position: Int[Array, " b"]) -> Int[Array, " b"]:
        count = jnp.minimum(self.storage.size, self.recent)
        return (self.storage.head - count + position) % self.max_size

    def at_slots(self, slots: Int[Array, " b"]) -> PyTree[Array]:
        return jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), self.storage.data)


# ---------------------------------------------------------------------------------------------
# The kinds: each a way to make a small empty buffer and to fill it, and its plain sample.


class Kind(NamedTuple):
    name: str
    family: str  # "replay" or "trajectory"
    make: Callable[[], Any]
    sample: Callable[[Any, PRNGKeyArray], Any]  # its plain read (a queue's pop)
    options: dict  # what `sample` takes (a window), for the layers that sample it


WINDOW = dx.Window(2)
CAPACITY = 8
ENVS = 2  # per buffer (per shard)


def _registry(name: str, capacity: int = CAPACITY) -> Callable[[], Any]:
    t = BY_NAME[name]
    return lambda: t.make(ITEM, capacity)


def _recent() -> RecentReplay:
    return RecentReplay(ITEM, CAPACITY, 5)


def _trajectories() -> dx.TrajectoryBuffer:
    return dx.TrajectoryBuffer(ITEM, ENVS, CAPACITY)


def _prioritised_windows() -> dx.PrioritisedTrajectoryBuffer:
    return dx.PrioritisedTrajectoryBuffer(ITEM, ENVS, CAPACITY, dx.Window(1, period=2, strict=True))


def _queue() -> dx.TrajectoryQueue:
    return dx.TrajectoryQueue(ITEM, ENVS, CAPACITY)


KINDS = [
    Kind("uniform", "replay", _registry("UniformReplay"), lambda b, k: b.sample(k, 3), {}),
    Kind("prioritised", "replay", _registry("PrioritisedReplay"), lambda b, k: b.sample(k, 3), {}),
    Kind(
        "clustered",
        "replay",
        _registry("ClusteredReplay(PrioritisedReplay)"),
        lambda b, k: b.sample(k, 3),
        {},
    ),
    Kind("recent", "replay", _recent, lambda b, k: b.sample(k, 3), {}),
    Kind("trajectory", "trajectory", _trajectories, lambda b, k: b.sample(k, 3, WINDOW), {}),
    Kind(
        "prioritised windows",
        "trajectory",
        _prioritised_windows,
        lambda b, k: b.sample(k, 3),
        {},
    ),
    Kind("queue", "trajectory", _queue, lambda b, k: b.pop(1)[0], {}),
]
BY_KIND = {k.name: k for k in KINDS}

LAYERS = [
    "aged",
    "clustered",
    "global",
    "rate-limited",
    "rate-limited global",
    "served",
    "served global",
    "dataset",
    "saved",
]

# The pairs that cannot be, and why: the guide gives the same reasons (checked below).
MEANINGLESS = {
    ("aged", "queue"): "a queue is read once, oldest first: nothing is drawn, so nothing is "
    "reweighed by age",
    **{
        ("clustered", kind.name): "a ClusteredReplay sorts the items of a replay into clusters; "
        "a step belongs to its env's stream"
        for kind in KINDS
        if kind.family == "trajectory"
    },
    **{
        ("dataset", kind.name): "a Dataset keeps per-env streams; a replay's items go into one "
        "with `Dataset.append`"
        for kind in KINDS
        if kind.family == "replay"
    },
}


def _version(item):
    return item["act"].astype(jnp.int32) & 7


def _items(n: int, seed: int = 0) -> dict:
    """`n` items (or steps) of the registry's spec, distinct and all with a positive first
    entry (so that every cluster of `ClusteredReplay(cluster_of)` is 1)."""
    rng = np.random.default_rng(seed)
    return {
        "obs": (np.arange(3 * n, dtype=np.float32).reshape(n, 3) + 1 + 100 * seed),
        "act": rng.integers(0, 8, n).astype(np.int8),
        "rew": rng.standard_normal(n).astype(np.float32),
        "done": rng.random(n) < 0.2,
    }


# Compiled once per buffer type, where the same adds made eagerly would compile each of their
# operations (the eager path has tests of its own: tests/test_transforms.py).
_add_batch = eqx.filter_jit(lambda buf, items: buf.add_batch(items))
_add = eqx.filter_jit(lambda buf, items: buf.add(items))


def _fill(buf: Any, kind: Kind, shards: int = 1) -> Any:
    """`buf` after a few adds (one equal block per shard)."""
    if kind.family == "replay":
        for seed in range(2):
            buf = _add_batch(buf, _items(3 * shards, seed))
        return buf
    envs = ENVS * shards
    for seed in range(4):
        buf = _add(buf, _items(envs, seed))
    return buf


@functools.cache
def _compiled(sample: Callable[[Any, PRNGKeyArray], Any]) -> Callable[[Any, PRNGKeyArray], Any]:
    return eqx.filter_jit(sample)


def _sample(kind: Kind, buf: Any, key: PRNGKeyArray) -> Any:
    return _compiled(kind.sample)(buf, key)


def _leaves_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


def _same_form(a: Any, b: Any) -> bool:
    """The same structure, shapes and dtypes."""
    spec = lambda t: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), t)  # noqa: E731
    return jax.tree.structure(a) == jax.tree.structure(b) and spec(a) == spec(b)


# ---------------------------------------------------------------------------------------------
# The checks, one per layer.


def check_aged(kind: Kind) -> None:
    buf = _fill(kind.make(), kind)
    age = dx.PolicyAge(_version, 7, max_age=5)
    what = (WINDOW,) if kind.name == "trajectory" else ()
    out = buf.sample(jax.random.key(0), 16, *what, age=age)
    assert isinstance(out, dx.AgedSample)
    assert (np.asarray(out.ages) <= 5).all() and (np.asarray(out.ages) >= 0).all()
    assert np.isfinite(np.asarray(out.probabilities)).all()
    # Every row comes from a candidate young enough: its version is the age's complement.
    first = out.items.items if kind.family == "trajectory" else out.items
    if kind.family == "trajectory":
        first = jax.tree.map(lambda x: x[:, 0], first)
    assert (7 - np.asarray(jax.vmap(_version)(first)) == np.asarray(out.ages)).all()


def check_clustered(kind: Kind) -> None:
    def cluster(item):
        return (item["act"] > 3).astype(jnp.int32)

    clustered = _fill(dx.ClusteredReplay(kind.make(), 2, cluster), kind)
    assert isinstance(clustered, dx.AbstractReplay)
    out = clustered.sample(jax.random.key(1), 3)
    # The rows are the inner replay's, each from the cluster drawn for it.
    assert _same_form(out, _sample(kind, _fill(kind.make(), kind), jax.random.key(1)))
    rows = out.items if isinstance(out, dx.PrioritisedSample) else out
    stored = {tuple(x) for x in _items(3, 0)["obs"].tolist() + _items(3, 1)["obs"].tolist()}
    assert {tuple(x) for x in np.asarray(rows["obs"]).tolist()} <= stored


def _mesh():
    return jax.make_mesh((jax.device_count(),), ("shards",))


def _global(kind: Kind) -> Any:
    cls = dx.GlobalReplay if kind.family == "replay" else dx.GlobalTrajectoryBuffer
    return cls(_mesh(), kind.make)


def check_global(kind: Kind) -> None:
    shards = jax.device_count()
    buf = _fill(_global(kind), kind, shards)
    key = jax.random.key(2)
    out = _sample(kind, buf, key)
    if kind.name in ("uniform", "trajectory", "queue"):
        # The union of the shards draws as one buffer of their contents end to end.
        one = _one_of(kind, shards)
        assert _leaves_equal(out, _sample(kind, one, key)), kind.name
    else:
        assert _same_form(out, _sample(kind, _fill(kind.make(), kind), key))
    if kind.name == "prioritised":
        # Global indices route back to the shard that owns each entry, and every shard's
        # largest priority rises with every entry.
        buf = buf.set_priorities(out.indices, jnp.full(3, 9.0), generations=out.generations)
        assert (np.asarray(buf.shards.max_priority) == 9.0).all()
        assert not np.asarray(buf.stale(out.indices, out.generations)).any()
    if kind.name == "prioritised windows":
        env, start = out.sample.env, out.sample.start
        buf = buf.set_priorities(env, start, jnp.full(3, 9.0))
        assert (np.asarray(buf.shards.max_priority) == 9.0).all()
        again = buf.read  # a prioritised buffer reads by priority: `read` is refused
        with pytest.raises(TypeError, match="does not read windows by stamp"):
            again(env, start, WINDOW)


def _one_of(kind: Kind, shards: int) -> Any:
    """One buffer holding what `shards` shards of `kind` hold after `_fill`, end to end."""
    if kind.family == "replay":
        capacity = CAPACITY * shards
        buf = _registry("UniformReplay", capacity)()
        for k in range(shards):  # shard k's block of every add, then shard k + 1's
            for seed in range(2):
                buf = buf.add_batch(
                    jax.tree.map(lambda x: x[3 * k : 3 * k + 3], _items(3 * shards, seed))
                )
        return buf
    cls = {"trajectory": dx.TrajectoryBuffer, "queue": dx.TrajectoryQueue}[kind.name]
    buf = cls(ITEM, ENVS * shards, CAPACITY)
    return _fill(buf, kind, shards)


def check_rate_limited(kind: Kind, *, over: Callable[[Kind], Any] | None = None) -> None:
    shards = 1 if over is None else jax.device_count()
    buf = kind.make() if over is None else over(kind)
    limiter = dx.RateLimiter(1, 1, None, None, insert_batch_size=64, sample_batch_size=64)
    limited = _fill(dx.RateLimited(buf, limiter), kind, shards)
    bare = _fill(buf, kind, shards)
    inserted = (6 if kind.family == "replay" else 4 * ENVS) * shards
    assert isinstance(
        limited, dx.AbstractReplay if kind.family == "replay" else dx.AbstractTrajectoryBuffer
    )
    assert limited.counts() == (inserted, 0)
    key = jax.random.key(3)
    if kind.name == "queue":
        items, limited = cast(dx.AbstractTrajectoryBuffer, limited).pop(1)
        rows = ENVS * shards
    else:
        limited, items = limited.sample(key, 3, *((WINDOW,) if kind.name == "trajectory" else ()))
        rows = 3
    assert _leaves_equal(items, _sample(kind, bare, key))
    assert limited.counts() == (inserted, rows)


def check_served(kind: Kind, *, over: Callable[[Kind], Any] | None = None) -> None:
    shards = 1 if over is None else jax.device_count()
    buf = kind.make() if over is None else over(kind)
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 2, 64, insert_batch_size=64, sample_batch_size=64
    )
    service = dx.ReplayService(dx.RateLimited(buf, limiter))  # takes `buf` over (donates it)
    bare = kind.make() if over is None else over(kind)
    try:
        if kind.family == "replay":
            for seed in range(2):
                service.add_batch(_items(3 * shards, seed))
        else:
            for seed in range(4):
                service.add(_items(ENVS * shards, seed))
        bare = _fill(bare, kind, shards)
        key = jax.random.key(4)
        if kind.name == "queue":
            got = service.pop(1)
        else:
            what = WINDOW if kind.name == "trajectory" else None
            got = service.sample(key, 3, what)
        assert _leaves_equal(got, _sample(kind, bare, key))
        inserts, samples = service.counts()
        assert samples == (ENVS * shards if kind.name == "queue" else 3)
        assert inserts == (6 if kind.family == "replay" else 4 * ENVS) * shards
    finally:
        service.close()


def check_dataset(kind: Kind, tmp_path: Path) -> None:
    buf = _fill(kind.make(), kind)
    limited = dx.RateLimited(buf, dx.RateLimiter.min_size(1))
    limited = eqx.tree_at(lambda r: r.limiter, limited, limited.limiter.with_counts(8, 3))
    with dx.Dataset.create(tmp_path / "d", ITEM, ENVS) as dataset:
        assert dataset.write(limited) == 4 * ENVS
        back = dataset.load(limited)
    assert back.counts() == (8, 3)
    assert _leaves_equal(back.buffer.streams, buf.streams)
    if kind.name == "prioritised windows":
        assert _leaves_equal(back.window_priorities(), buf.window_priorities())


def check_saved(kind: Kind, tmp_path: Path) -> None:
    buf = _fill(kind.make(), kind)
    limited = dx.RateLimited(buf, dx.RateLimiter.min_size(1))
    dx.save(tmp_path / "b.dx", limited)
    back = dx.load(tmp_path / "b.dx", like=dx.RateLimited(kind.make(), dx.RateLimiter.min_size(1)))
    assert _leaves_equal(back, limited) and type(back) is type(limited)


CHECKS: dict[str, Callable[..., None]] = {
    "aged": check_aged,
    "clustered": check_clustered,
    "global": check_global,
    "rate-limited": check_rate_limited,
    "rate-limited global": functools.partial(check_rate_limited, over=_global),
    "served": check_served,
    "served global": functools.partial(check_served, over=_global),
    "dataset": check_dataset,
    "saved": check_saved,
}
ON_DISK = {"dataset", "saved"}
NEEDS_GLOBAL = {"global", "rate-limited global", "served global"}

PAIRS = [(layer, kind.name) for layer in LAYERS for kind in KINDS]


def _rotation() -> set[tuple[str, str]]:
    """The pairs of the README's test command: each layer over one kind, the kinds taken in
    turn (every kind is in it); the others are marked `slow` (tests/helpers.py)."""
    chosen = set()
    for i, layer in enumerate(LAYERS):
        turn = [KINDS[(i + j) % len(KINDS)].name for j in range(len(KINDS))]
        chosen.add(next((layer, kind) for kind in turn if (layer, kind) not in MEANINGLESS))
    assert {kind for _, kind in chosen} == set(BY_KIND)
    return chosen


_DEFAULT = _rotation()


def test_the_matrix_has_no_hole():
    # Every pair is checked below, or is meaningless and says why, in the guide too.
    guide = (ROOT / "docs" / "layers.md").read_text()
    assert set(CHECKS) == set(LAYERS)
    for pair, reason in MEANINGLESS.items():
        assert pair in PAIRS, pair
        assert reason in " ".join(guide.split()), (pair, reason)


@pytest.mark.parametrize(
    "layer,kind",
    [
        pair if pair in _DEFAULT or pair in MEANINGLESS else pytest.param(*pair, marks=SLOW)
        for pair in PAIRS
    ],
    ids=[f"{a}-{b}" for a, b in PAIRS],
)
def test_every_layer_over_every_kind(layer, kind, tmp_path):
    if (layer, kind) in MEANINGLESS:
        pytest.skip(MEANINGLESS[layer, kind])
    if layer in NEEDS_GLOBAL and not GLOBAL:
        pytest.skip("the global buffers need JAX 0.7+ (jax.shard_map)")
    check = CHECKS[layer]
    if layer in ON_DISK:
        check(BY_KIND[kind], tmp_path)
    else:
        check(BY_KIND[kind])
