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


class BadPriorityError(Exception):
    """The model's counterpart of a "negative, infinite or NaN priority" runtime error."""


class AllZeroError(Exception):
    """The model's counterpart of "cannot sample: every stored priority is zero"."""


def _check_values(values) -> None:
    values = np.asarray(values, dtype=np.float64)
    if not (np.isfinite(values) & (values >= 0)).all():
        raise BadPriorityError(values)


class RefSumTree:
    """A plain array of leaf values; sums and prefix sums computed on demand, in float64."""

    def __init__(self, capacity: int):
        self.values = np.zeros(capacity)

    @property
    def total(self) -> float:
        return float(self.values.sum())

    def set(self, indices, values, mask=None) -> None:
        """Sequential single updates, so the last occurrence of an index wins."""
        keep = np.ones(len(indices), bool) if mask is None else np.asarray(mask)
        indices = np.asarray(indices)[keep]
        values = np.asarray(values)[keep]
        if ((indices < 0) | (indices >= len(self.values))).any():
            raise IndexError(indices)
        _check_values(values)
        for i, v in zip(indices, values):
            self.values[i] = v

    def interval(self, i: int) -> tuple[float, float]:
        """The range `[prefix_i, prefix_i + value_i)` of draws that should find leaf `i`."""
        prefix = float(self.values[:i].sum())
        return prefix, prefix + float(self.values[i])


class RefPrioritisedReplay:
    """Prioritised replay: slots written in order (the k-th add to slot k % max_size), each with
    a priority; P(i) = p_i ** alpha / sum_k p_k ** alpha over stored slots, zero priority never
    drawn. New items default to the largest priority recorded so far (at least 1.0)."""

    def __init__(self, max_size: int, priority_exponent: float):
        self.max_size = max_size
        self.alpha = priority_exponent
        self.items: list = [None] * max_size
        self.priorities = np.zeros(max_size)
        self.count = 0
        self.head = 0
        self.max_priority = 1.0

    @property
    def size(self) -> int:
        return self.count

    def add(self, item, priority=None) -> None:
        self.add_batch([item], None if priority is None else [priority])

    def add_batch(self, items: list, priorities=None) -> None:
        if priorities is None:
            priorities = [self.max_priority] * len(items)
        else:
            _check_values(priorities)
            self.max_priority = max([self.max_priority, *map(float, priorities)])
        for item, p in zip(items, priorities):
            self.items[self.head] = item
            self.priorities[self.head] = p
            self.head = (self.head + 1) % self.max_size
            self.count = min(self.count + 1, self.max_size)

    def set_priorities(self, indices, priorities) -> None:
        indices = np.asarray(indices)
        if ((indices < 0) | (indices >= self.count)).any():
            raise IndexError(indices)
        _check_values(priorities)
        self.max_priority = max([self.max_priority, *map(float, priorities)])
        for i, p in zip(indices, priorities):
            self.priorities[i] = p

    def update(self, fn: Callable) -> None:
        for i in range(self.count):
            self.items[i] = fn(self.items[i])

    def masses(self) -> np.ndarray:
        """`p ** alpha` of every slot, zero where p is zero (for every alpha, also 0)."""
        p = self.priorities
        mass = np.where(p > 0, np.power(p, self.alpha, where=p > 0, out=np.zeros_like(p)), 0.0)
        mass[self.count :] = 0
        return mass

    def probabilities(self) -> np.ndarray:
        """The probability of drawing each slot in one draw."""
        if self.count == 0:
            raise EmptyBufferError
        mass = self.masses()
        if mass.sum() == 0:
            raise AllZeroError
        return mass / mass.sum()


def ref_importance_weights(probabilities, size: int, beta: float) -> np.ndarray:
    """`(N P)^-beta / max (N P)^-beta`, literally, in float64."""
    w = (size * np.asarray(probabilities, np.float64)) ** -beta
    return w / w.max()
