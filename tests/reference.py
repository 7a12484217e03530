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
