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

    def set_priorities(self, cluster_ids, indices, priorities) -> None:
        """Route each entry to its cluster's (prioritised) inner model, in order."""
        cluster_ids = [int(c) for c in cluster_ids]
        if any(not 0 <= c < len(self.clusters) for c in cluster_ids):
            raise ClusterIdError(cluster_ids)
        for c, i, p in zip(cluster_ids, indices, priorities):
            self.clusters[c].set_priorities([i], [p])

    def contents(self) -> list:
        """Every stored item, cluster by cluster, each cluster in its inner model's order."""
        return [item for c in self.clusters for item in c.contents()]

    def drawable(self) -> list[bool]:
        """Per cluster, whether its inner model holds an item it can draw: a non-empty
        cluster whose items all have priority 0 is never chosen."""
        out = []
        for c in self.clusters:
            try:
                c.probabilities()
            except (EmptyBufferError, AllZeroError):
                out.append(False)
            else:
                out.append(True)
        return out

    def cluster_probabilities(self) -> np.ndarray:
        sizes = np.array(self.cluster_sizes, dtype=np.float64)
        if not sizes.any():
            raise EmptyBufferError
        drawable = np.asarray(self.drawable())
        if not drawable.any():
            raise AllZeroError
        weights = np.zeros_like(sizes)
        weights[drawable] = sizes[drawable] ** self.distribution_power
        return weights / weights.sum()

    def probabilities(self) -> np.ndarray:
        """The probability of drawing each stored item (in `contents()` order) in one draw."""
        p = self.cluster_probabilities()
        return np.concatenate(
            [
                p[i] * c.probabilities()[: c.size] if p[i] > 0 else np.zeros(c.size)
                for i, c in enumerate(self.clusters)
                if c.size > 0
            ]
        )


class EnvIdError(Exception):
    """The model's counterpart of the library's "env id out of range / repeated" error."""


class RefTrajectoryBuffer:
    """Per-env streams of steps: a deque of the last `max_length` steps for each env, and the
    number of steps added to each env since the last `reset_online_queue` (capped).

    The replay window of an env is its whole deque; the online window is its last
    `online[e]` steps. Sampling is described by `start_probabilities`, computed by brute force
    over every (env, offset) pair.
    """

    def __init__(self, num_envs: int, max_length: int):
        self.num_envs = num_envs
        self.max_length = max_length
        self.streams = [collections.deque(maxlen=max_length) for _ in range(num_envs)]
        self.online = [0] * num_envs
        self.count = [0] * num_envs  # steps ever added: the next step's absolute number

    def add(self, items: list, env_ids: list[int]) -> None:
        """One step for each listed env; all-or-nothing: a bad id list changes nothing."""
        if any(not 0 <= e < self.num_envs for e in env_ids):
            raise EnvIdError("out of range")
        if len(set(env_ids)) != len(env_ids):
            raise EnvIdError("repeated")
        for item, e in zip(items, env_ids):
            self.streams[e].append(item)
            self.online[e] = min(self.online[e] + 1, self.max_length)
            self.count[e] += 1

    def reset_online_queue(self) -> None:
        self.online = [0] * self.num_envs

    def lengths(self, source: str = "replay") -> np.ndarray:
        if source == "replay":
            return np.array([len(s) for s in self.streams])
        return np.array(self.online)

    def window(self, env: int, source: str = "replay") -> list:
        """The steps of one env's window, oldest first."""
        stream = list(self.streams[env])
        return stream[len(stream) - int(self.lengths(source)[env]) :]

    def peek(self, env_ids: list[int]) -> list:
        if any(not 0 <= e < self.num_envs for e in env_ids):
            raise EnvIdError("out of range")
        if any(not self.streams[e] for e in env_ids):
            raise EmptyBufferError
        return [self.streams[e][-1] for e in env_ids]

    def start_probabilities(self, sequence_length: int, power: float, source: str) -> dict:
        """`{(env, offset): probability}` of one draw, over every start with positive weight.

        A start at `offset` of a window of `L` steps has `r = min(L - offset, T)` steps left and
        weight `r ** power` (with `r >= 1`, so `0 ** 0` never arises).
        """
        weights = {}
        for env, length in enumerate(self.lengths(source)):
            for offset in range(length):
                r = min(length - offset, sequence_length)
                weights[(env, offset)] = float(r) ** power
        total = sum(weights.values())
        if total == 0:
            raise EmptyBufferError
        return {start: w / total for start, w in weights.items()}

    def sequence(self, env: int, offset: int, sequence_length: int, source: str) -> list:
        """The real steps of the sequence starting at `offset`: `min(L - offset, T)` of them."""
        return self.window(env, source)[offset : offset + sequence_length]

    # Windows with options, by absolute step numbers: step `s` of env `e` is stored when
    # `count[e] - len(stream) <= s < count[e]`, and in the online window when
    # `s >= count[e] - online[e]`.

    def step(self, env: int, s: int):
        """The stored step with absolute number `s` of env `env`."""
        first = self.count[env] - len(self.streams[env])
        assert first <= s < self.count[env], (env, s)
        return self.streams[env][s - first]

    def window_probabilities(
        self,
        size: int,
        *,
        period: int = 1,
        min_real: int = 1,
        strict: bool = False,
        power: float = 1.0,
        source: str = "replay",
    ) -> dict:
        """`{(env, start): probability}` over every admissible window start, by enumeration.

        A start is a stored step of the source's window whose absolute number is a multiple
        of `period`; its window holds `r = min(count - start, size)` real steps. Strict: only
        `r == size`, all equally likely. Otherwise `r >= min_real`, weight `r ** power`.
        """
        weights = {}
        for env in range(self.num_envs):
            count = self.count[env]
            for start in range(count - int(self.lengths(source)[env]), count):
                r = min(count - start, size)
                if start % period or (strict and r < size) or r < min_real:
                    continue
                weights[(env, start)] = 1.0 if strict else float(r) ** power
        total = sum(weights.values())
        if total == 0:
            raise EmptyBufferError
        return {start: w / total for start, w in weights.items()}

    def window_mask(
        self, env: int, start: int, size: int, burn_in: int, policy: str, is_end: Callable
    ) -> list[bool]:
        """Which of the `size` positions of the window from `start` it holds: the stored steps
        up to the newest, cut by the episode-end policy (`is_end(step)` says whether a step
        ends its episode)."""
        mask = [start + t < self.count[env] for t in range(size)]
        if policy == "cross":
            return mask
        ends = [mask[t] and bool(is_end(self.step(env, start + t))) for t in range(size)]
        late = [t for t in range(burn_in, size) if ends[t]]
        if late:  # keep the first end at or past the learning part, drop what follows it
            mask = [m and t <= late[0] for t, m in enumerate(mask)]
        early = [t for t in range(burn_in) if ends[t]]
        if policy == "within" and early:  # drop the burn-in up to its last end
            mask = [m and t > early[-1] for t, m in enumerate(mask)]
        return mask

    def transition_starts(self, n: int, source: str = "replay") -> list:
        """Every `(env, t)` an n-step transition may start from: step `t` and the `n` after
        it stored in the source's window."""
        return [
            (env, t)
            for env in range(self.num_envs)
            for t in range(self.count[env] - int(self.lengths(source)[env]), self.count[env] - n)
        ]

    def transition(
        self, env: int, t: int, n: int, gamma: float, reward, terminated, truncated
    ) -> tuple:
        """`(returns, discount, next_t)` of the n-step transition from step `t`, by a loop."""
        total = 0.0
        for i in range(n):
            step = self.step(env, t + i)
            total += gamma**i * float(reward(step))
            if terminated(step):
                return total, 0.0, t + i + 1
            if truncated(step):
                return total, gamma ** (i + 1), t + i + 1
        return total, gamma**n, t + n


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
        self.generations = [0] * max_size  # add calls that wrote each slot, mod 2**32

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
        written = set()
        for item, p in zip(items, priorities):
            self.items[self.head] = item
            self.priorities[self.head] = p
            written.add(self.head)
            self.head = (self.head + 1) % self.max_size
            self.count = min(self.count + 1, self.max_size)
        for slot in written:
            self.generations[slot] = (self.generations[slot] + 1) % 2**32

    def stale(self, indices, stamps) -> list[bool]:
        """Which entries' slots were written since their sample (`stamps`: its generations)."""
        if any(not 0 <= i < self.count for i in indices):
            raise IndexError(indices)
        return [self.generations[i] != int(s) for i, s in zip(indices, stamps)]

    def set_priorities(self, indices, priorities, stamps=None) -> None:
        """Every entry is checked; with `stamps`, the stale ones are then left out."""
        indices = np.asarray(indices)
        if ((indices < 0) | (indices >= self.count)).any():
            raise IndexError(indices)
        _check_values(priorities)
        self.max_priority = max([self.max_priority, *map(float, priorities)])
        stale = [False] * len(indices) if stamps is None else self.stale(indices, stamps)
        for i, p, old in zip(indices, priorities, stale):
            if not old:
                self.priorities[i] = p

    def update(self, fn: Callable) -> None:
        for i in range(self.count):
            self.items[i] = fn(self.items[i])

    def contents(self) -> list:
        """The stored items in slot order (the order of `probabilities`)."""
        return self.items[: self.count]

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


class StampError(Exception):
    """The model's counterpart of a "stamp this buffer cannot have given" runtime error."""


class RefPrioritisedTrajectory:
    """Prioritised windows of per-env streams: the windows of `size` steps that start on a
    multiple of `period` and lie wholly in the stored stream, each with a priority. A window
    that becomes admissible takes the largest priority recorded so far; one whose first step
    is dropped leaves. P(window) = p ** alpha / sum of all."""

    def __init__(self, num_envs: int, max_length: int, size: int, period: int, alpha: float):
        self.streams = RefTrajectoryBuffer(num_envs, max_length)
        # `size` is the window length W.
        self.size, self.period, self.alpha = size, period, alpha
        self.priorities: dict = {}
        self.max_priority = 1.0

    def admissible(self) -> list:
        out = []
        for env in range(self.streams.num_envs):
            count, stored = self.streams.count[env], len(self.streams.streams[env])
            out += [
                (env, s)
                for s in range(count - stored, count - self.size + 1)
                if s % self.period == 0
            ]
        return out

    def add(self, items: list, env_ids: list[int]) -> None:
        self.streams.add(items, env_ids)
        now = self.admissible()
        self.priorities = {w: self.priorities.get(w, self.max_priority) for w in now}

    def check_stamps(self, env_ids, starts) -> None:
        for env, start in zip(env_ids, starts):
            ok = 0 <= env < self.streams.num_envs and start >= 0
            ok = ok and start % self.period == 0 and start + self.size <= self.streams.count[env]
            if not ok:
                raise StampError((env, start))

    def stale(self, env_ids, starts) -> list[bool]:
        self.check_stamps(env_ids, starts)
        return [(e, s) not in self.priorities for e, s in zip(env_ids, starts)]

    def set_priorities(self, env_ids, starts, priorities) -> None:
        self.check_stamps(env_ids, starts)
        _check_values(priorities)
        self.max_priority = max([self.max_priority, *map(float, priorities)])
        for env, start, p in zip(env_ids, starts, priorities):
            if (env, start) in self.priorities:
                self.priorities[(env, start)] = float(p)

    def mass(self, window) -> float:
        p = self.priorities[window]
        return 0.0 if p == 0 else p**self.alpha

    def probabilities(self) -> dict:
        if not self.priorities:
            raise EmptyBufferError
        total = sum(self.mass(w) for w in self.priorities)
        if total == 0:
            raise AllZeroError
        return {w: self.mass(w) / total for w in self.priorities}


# Policy age (`sample(..., age=...)`): a candidate's age is the current policy version minus the
# version stored with it (with its window's first step).


def age_weight(age: int, decay) -> float:
    """The weight of an admitted age: 1, or `1 / (age + 1)` for `decay="inverse"`."""
    return 1.0 if decay is None else 1.0 / (age + 1)


def ref_aged(weights: dict, ages: dict, max_age: int, decay) -> dict:
    """`{candidate: probability}` of one draw: `weights[c] · age_weight(ages[c])`, normalised
    over the candidates of positive weight and age in `[0, max_age]`."""
    aged = {
        c: w * age_weight(ages[c], decay)
        for c, w in weights.items()
        if w > 0 and 0 <= ages[c] <= max_age
    }
    total = sum(aged.values())
    if total == 0:
        raise EmptyBufferError
    return {c: w / total for c, w in aged.items()}


def ref_aged_weights(target: dict, probabilities: dict, drawn: list, beta: float) -> np.ndarray:
    """The importance weights of the `drawn` candidates, literally: `(q / P) ** beta` over the
    batch's largest, `q` the target and `P` the sampling probabilities, in float64."""
    w = np.array([(target[c] / probabilities[c]) ** beta for c in drawn])
    return w / w.max()


def episode_rows(dones, autoreset):
    """Per step of one env's whole history (its end flags `dones`): `[episode, first, last,
    ended]` as `EpisodeInfo` says it (episode -1 for an auto-reset step), from the flags alone:
    the model of the episode bookkeeping that relabelling and episode sampling read."""
    rows, episodes, k, pending = [], {}, -1, "begins"
    for t, done in enumerate(dones):
        if pending == "resets":
            rows.append([-1, t, t, True])
            pending = "begins"
            continue
        if pending == "begins":
            k += 1
            episodes[k] = [t, None]
        rows.append([k, None, None, None])
        if done:
            episodes[k][1] = t
            pending = "resets" if autoreset == "next-step" else "begins"
        else:
            pending = "continues"
    for row in rows:
        if row[0] >= 0:
            first, last = episodes[row[0]]
            row[1:] = [first, len(dones) - 1 if last is None else last, last is not None]
    return rows
