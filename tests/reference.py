"""Plain Python/NumPy models of every buffer's observable behaviour.

These are the oracles of the property tests: deliberately simple (a deque, a list), with no
attempt at efficiency, so that they are obviously right. Items are pytrees of NumPy arrays.
"""

import collections
from collections.abc import Callable

import numpy as np


class EmptyBufferError(Exception):
    """The model's counterpart of the library's "empty buffer" runtime error."""


class RefCircularBuffer:
    """A FIFO of at most `max_size` items; pushing into a full one drops the oldest."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.items: collections.deque = collections.deque()

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def is_full(self) -> bool:
        return len(self.items) == self.max_size

    @property
    def is_empty(self) -> bool:
        return not self.items

    def push(self, item) -> None:
        self.items.append(item)
        if len(self.items) > self.max_size:
            self.items.popleft()

    def push_batch(self, items: list) -> None:
        for item in items:
            self.push(item)

    def pop(self):
        if not self.items:
            raise EmptyBufferError
        return self.items.popleft()

    def get(self, index: int):
        if not 0 <= index < len(self.items):
            raise IndexError(index)
        return self.items[index]

    def update(self, fn: Callable) -> None:
        self.items = collections.deque(fn(item) for item in self.items)


class RefUniformReplay:
    """Uniform replay: a `RefCircularBuffer` sampled uniformly with replacement."""

    def __init__(self, max_size: int):
        self.buffer = RefCircularBuffer(max_size)

    @property
    def size(self) -> int:
        return self.buffer.size

    def add(self, item) -> None:
        self.buffer.push(item)

    def add_batch(self, items: list) -> None:
        self.buffer.push_batch(items)

    def update(self, fn: Callable) -> None:
        self.buffer.update(fn)

    def contents(self) -> list:
        return list(self.buffer.items)

    def probabilities(self) -> np.ndarray:
        """The probability of drawing each stored item (oldest first) in one draw."""
        if not self.buffer.items:
            raise EmptyBufferError
        return np.full(self.size, 1.0 / self.size)


class ClusterIdError(Exception):
    """The model's counterpart of the library's "cluster id out of range" runtime error."""


class RefClusteredReplay:
    """Clustered replay: one inner model per cluster, each item added to the cluster it names.

    `cluster_fn(item) -> int`; `inner()` makes an empty inner model (a `RefUniformReplay` by
    default). A draw picks non-empty cluster `c` with probability proportional to
    `size_c ** distribution_power`, then an item with the inner model's probabilities.
    """

    def __init__(
        self,
        num_clusters: int,
        cluster_fn: Callable,
        distribution_power: float = 0.0,
        *,
        inner: Callable,
    ):
        self.clusters = [inner() for _ in range(num_clusters)]
        self.cluster_fn = cluster_fn
        self.distribution_power = distribution_power

    @property
    def size(self) -> int:
        return sum(c.size for c in self.clusters)

    @property
    def cluster_sizes(self) -> list[int]:
        return [c.size for c in self.clusters]

    def add(self, item) -> None:
        self.add_batch([item])

    def add_batch(self, items: list) -> None:
        # All or nothing: a batch holding a bad id raises and changes nothing.
        ids = [int(self.cluster_fn(item)) for item in items]
        if any(not 0 <= c < len(self.clusters) for c in ids):
            raise ClusterIdError(ids)
        for item, c in zip(items, ids):
            self.clusters[c].add(item)

    def update(self, fn: Callable) -> None:
        for c in self.clusters:
            c.update(fn)

    def contents(self) -> list:
        """Every stored item, cluster by cluster, each cluster in its inner model's order."""
        return [item for c in self.clusters for item in c.contents()]

    def cluster_probabilities(self) -> np.ndarray:
        sizes = np.array(self.cluster_sizes, dtype=np.float64)
        if not sizes.any():
            raise EmptyBufferError
        weights = np.zeros_like(sizes)
        weights[sizes > 0] = sizes[sizes > 0] ** self.distribution_power
        return weights / weights.sum()

    def probabilities(self) -> np.ndarray:
        """The probability of drawing each stored item (in `contents()` order) in one draw."""
        p = self.cluster_probabilities()
        return np.concatenate(
            [p[i] * c.probabilities() for i, c in enumerate(self.clusters) if c.size > 0]
        )
