"""ReplayService: one buffer shared by actor threads and learner threads under a rate law.

The host side of issue 32 (Sebulba-style actors and learners in one process): the law is
`Rate`'s, evaluated on exact Python ints; the buffer operations are the buffer's own methods,
jitted once per process. `_Gate` holds the counts and the waits, `_Cell` the buffer, and
`ReplayService` puts them together.
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray, PyTree

from ._abstract import AbstractReplay, AbstractTrajectoryBuffer
from ._checks import check_bool, check_choice, check_nonnegative_float, check_positive_int, plural
from ._queue import TrajectoryQueue
from ._rate_limiter import RateLimited
from ._rates import Rate


Side = Literal["actor", "learner"]


class RateLimitTimeout(TimeoutError):
    """A `ReplayService` call waited its `timeout` for the rate law and gave up.

    The message says which side waited (the actor for samples, the learner for inserts), how
    many more it needed, the counts and the law.
    """


class ServiceClosed(RuntimeError):
    """A `ReplayService` call came after `close()`, or was waiting when `close()` came.

    Also raised after the service lost its buffer (a donated operation failed while running);
    then the error that lost it is the `__cause__`.
    """


class WaitCannotEnd(RuntimeError):
    """A `ReplayService` call waits for the other side, and the other side has stopped: the
    learner waits for inserts and every actor has left (or `close_inserts()` was called), or an
    actor waits for samples and every learner has left. Raised at once, and to the waiters at
    the moment it becomes so. A learner's loop ends on it once the actors are done."""


# ---------------------------------------------------------------------------------------------
# The law's numbers, for messages


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def inserts_needed(rate: Rate, inserts: int, samples: int, n: int) -> int:
    """The fewest further inserts after which a sample of `n` rows may proceed."""
    need = rate.min_size_to_sample
    if rate.scaled_min is not None:
        need = max(need, _ceil_div(rate.scaled_min + (samples + n) * rate.scale, rate.p))
    return max(need - inserts, 0)


def samples_needed(rate: Rate, inserts: int, samples: int, n: int) -> int:
    """The fewest further samples after which an insert of `n` items may proceed."""
    if rate.can_insert(inserts, samples, n) or rate.scaled_max is None:
        return 0
    return max(_ceil_div((inserts + n) * rate.p - rate.scaled_max, rate.scale) - samples, 0)


def _law(rate: Rate) -> str:
    return (
        f"samples_per_insert = {rate.samples_per_insert}, min_size_to_sample = "
        f"{rate.min_size_to_sample}, min_diff = {rate.min_diff}, max_diff = {rate.max_diff}"
    )


# ---------------------------------------------------------------------------------------------
# The counts and the waits


class _Gate:
    """The host counts, the participants and the waits of a `ReplayService`, under one
    condition. It holds no buffer and runs no JAX, so its lock is only ever held briefly.

    `inserts` counts the items whose buffer is published; `reserved` those that passed the law
    and are being written. Inserters test the law on `inserts + reserved` (two cannot pass on
    the same state), samplers on `inserts` (they never count items not in the buffer yet).
    `running` counts the operations between passing the law and finishing: each may still roll
    back, so no wait is declared endless while one runs.
    """

    def __init__(self, rate: Rate, inserts: int, samples: int):
        self.rate = rate
        self.cond = threading.Condition(threading.Lock())
        self.inserts, self.reserved, self.samples, self.running = inserts, 0, samples, 0
        self.present: dict[Side, int] = {"actor": 0, "learner": 0}
        self.seen: dict[Side, bool] = {"actor": False, "learner": False}
        self.inserts_closed = False
        self.closed = False
        self.cause: BaseException | None = None

    def check_open(self, call: str) -> None:
        """Raise `ServiceClosed` if the service is closed. Call with the lock held."""
        if self.closed:
            raise _closed(call, self.cause) from self.cause

    def ended(self, side: Side) -> str | None:
        """Why `side` will not act again, or `None`. Call with the lock held."""
        if side == "actor" and self.inserts_closed:
            return "inserts were closed (`close_inserts()`)"
        if self.seen[side] and self.present[side] == 0:
            return f"every {side} has stopped"
        return None

    def _state(self) -> str:
        flight = f" (+{self.reserved} being written)" if self.reserved else ""
        return f"inserts = {self.inserts}{flight}, samples = {self.samples}; {_law(self.rate)}"

    def _wait(
        self, deadline: float | None, timeout: float | None, other: Side, why: str, call: str
    ) -> None:
        """Wait for a change, or raise if none can help or the deadline has passed."""
        ended = self.ended(other)
        if ended is not None and self.running == 0:
            raise WaitCannotEnd(f"`{call}`: {why}, but {ended} ({self._state()}).")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise RateLimitTimeout(
                f"`{call}`: timed out after {timeout} s: {why} ({self._state()})."
            )
        self.cond.wait(remaining)

    def pass_insert(self, n: int, noun: str, timeout: float | None, call: str) -> None:
        """Wait until the law lets `n` items in, then reserve them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                self.check_open(call)
                if self.inserts_closed:
                    raise ServiceClosed(f"`{call}`: inserts were closed (`close_inserts()`).")
                total = self.inserts + self.reserved
                if n == 0 or self.rate.can_insert(total, self.samples, n):
                    self.reserved += n
                    self.running += 1
                    return
                k = samples_needed(self.rate, total, self.samples, n)
                why = f"the actor waits for {plural(k, 'more sample')} to insert {plural(n, noun)}"
                self._wait(deadline, timeout, "learner", why, call)

    def end_insert(self, n: int, published: bool) -> None:
        """Commit the reserved `n` items (`published`), or release them."""
        with self.cond:
            self.reserved -= n
            self.inserts += n if published else 0
            self.running -= 1
            self.cond.notify_all()

    def pass_sample(self, n: int, timeout: float | None, call: str) -> None:
        """Wait until the law lets a sample of `n` rows through, then count it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                self.check_open(call)
                if self.rate.can_sample(self.inserts, self.samples, n):
                    self.samples += n
                    self.running += 1
                    return
                k = inserts_needed(self.rate, self.inserts, self.samples, n)
                why = (
                    f"the learner waits for {plural(k, 'more insert')} to sample {plural(n, 'row')}"
                )
                self._wait(deadline, timeout, "actor", why, call)

    def end_sample(self, n: int, done: bool) -> None:
        """Finish a sample of `n` rows; uncount it if it did not run (`done` false)."""
        with self.cond:
            self.samples -= 0 if done else n
            self.running -= 1
            self.cond.notify_all()

    def join(self, side: Side, call: str) -> None:
        with self.cond:
            self.check_open(call)
            if side == "actor" and self.inserts_closed:
                raise ServiceClosed(f"`{call}`: inserts were closed (`close_inserts()`).")
            self.present[side] += 1
            self.seen[side] = True

    def leave(self, side: Side) -> None:
        with self.cond:
            self.present[side] -= 1
            self.cond.notify_all()

    def close(self, cause: BaseException | None = None, *, inserts_only: bool = False) -> None:
        with self.cond:
            if inserts_only:
                self.inserts_closed = True
            elif not self.closed:
                self.closed, self.cause = True, cause
            self.cond.notify_all()


# ---------------------------------------------------------------------------------------------
# The buffer operations, jitted once per process. The buffer is the first argument, the one
# donated. Inserts take arrays only (items, env ids, masks, priorities): plain `jax.jit`, whose
# dispatch is the cheapest. Samples and updates may take static arguments (a batch size, a
# `Window`, a function): those go through `_Static`, compared by value as `eqx.filter_jit`
# compares them.


def _add(buffer: Any, items: Any, args: tuple, kwargs: dict) -> Any:
    return buffer.add(items, *args, **kwargs)


def _add_batch(buffer: Any, items: Any, args: tuple, kwargs: dict) -> Any:
    return buffer.add_batch(items, *args, **kwargs)


def _extend(buffer: Any, items: Any, args: tuple, kwargs: dict) -> Any:
    return buffer.extend(items, *args, **kwargs)


class _Static:
    """The structure and the non-array leaves of a call's arguments: a static argument of
    `jax.jit`, hashable and compared by value (as `eqx.filter_jit` compares its static
    arguments); `_ARRAY` marks where the arrays go."""

    def __init__(self, treedef: Any, leaves: tuple, call: str):
        self.treedef, self.leaves = treedef, leaves
        try:
            self.hash = hash((treedef, leaves))
        except TypeError:
            raise TypeError(
                f"`{call}`: an argument that is not an array must be hashable (it is static: "
                f"each value compiles once); got {[type(x).__name__ for x in leaves]}."
            ) from None

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Static)
            and self.treedef == other.treedef
            and self.leaves == other.leaves
        )


_ARRAY = object()  # where an array goes


def _split(tree: Any, call: str) -> tuple[list, _Static]:
    """`tree` as its arrays (`None` elsewhere) and the rest: what `_call` puts back together."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [eqx.is_array(x) for x in leaves]
    dynamic = [x if a else None for x, a in zip(leaves, arrays)]
    static = tuple(_ARRAY if a else x for x, a in zip(leaves, arrays))
    return dynamic, _Static(treedef, static, call)


def _call(buffer: Any, static: _Static, dynamic: list) -> Any:
    leaves = [d if s is _ARRAY else s for d, s in zip(dynamic, static.leaves)]
    fn, args, kwargs = jax.tree.unflatten(static.treedef, leaves)
    return fn(buffer, *args, **kwargs)


def _sample(buffer: Any, *args: Any, **kwargs: Any) -> Any:
    return buffer.sample(*args, **kwargs)


def _sample_mixed(buffer: Any, *args: Any, **kwargs: Any) -> Any:
    return buffer.sample_mixed(*args, **kwargs)


def _sample_transitions(buffer: Any, *args: Any, **kwargs: Any) -> Any:
    return buffer.sample_transitions(*args, **kwargs)


def _sample_by_age(buffer: Any, *args: Any, **kwargs: Any) -> Any:
    return buffer.sample_by_age(*args, **kwargs)


_SAMPLERS = {
    "sample": _sample,
    "sample_by_age": _sample_by_age,
    "sample_transitions": _sample_transitions,
}


def _update(buffer: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    out = fn(buffer, *args, **kwargs)
    spec = lambda tree: (
        jax.tree.structure(tree),
        [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)],
    )
    if spec(out) != spec(buffer):
        raise TypeError(
            "`ReplayService.update`: `fn` must return the buffer it was given, updated: the "
            f"same type, configuration, shapes and dtypes; got {type(out).__name__}."
        )
    return out


_INSERTS = {op: jax.jit(op) for op in (_add, _add_batch, _extend)}
_INSERTS_DONATED = {op: jax.jit(op, donate_argnums=0) for op in (_add, _add_batch, _extend)}
_CALL = jax.jit(_call, static_argnums=1)
_CALL_DONATED = jax.jit(_call, static_argnums=1, donate_argnums=0)


def _leading(items: Any, axes: int, call: str) -> tuple[int, ...]:
    """The first `axes` dimensions of `items`' first leaf, without reading any value."""
    leaves = jax.tree.leaves(items)
    shape = np.shape(leaves[0]) if leaves else ()
    if len(shape) < axes:
        what = "a leading batch axis" if axes == 1 else "leading axes (n, T)"
        raise ValueError(f"`{call}`: `items` must have {what}; its first leaf has shape {shape}.")
    return tuple(shape[:axes])


def _env_count(envs: int, args: tuple, kwargs: dict) -> int:
    """The number of envs an `add(items, env_ids=None)` or `extend` lists."""
    env_ids = kwargs["env_ids"] if "env_ids" in kwargs else (args[0] if args else None)
    return envs if env_ids is None else int(np.size(env_ids))


def _check_amount(rate: Rate, n: int, side: str, noun: str, call: str) -> None:
    """A `ValueError` for more than the limiter's batch size in one call, as `RateLimited`
    refuses it: the law is free of deadlock only for calls up to that size."""
    most = rate.insert_batch_size if side == "insert" else rate.sample_batch_size
    if n > most:
        raise ValueError(
            f"`{call}`: {plural(n, noun)} in one call, more than the limiter's "
            f"`{side}_batch_size` = {most}: the law is free of deadlock for {side}s of at "
            f"most that size only. Make the limiter with `{side}_batch_size={n}` or more."
        )


def _timeout(timeout: float | None, call: str) -> float | None:
    return None if timeout is None else check_nonnegative_float(timeout, f"{call}(timeout=...)")


class _QuietChecks(logging.Filter):
    """Drops JAX's log of an Equinox check that failed inside a jitted operation of a service,
    which raises it instead (as `eqx.filter_jit` does). Installed while such operations run."""

    users = 0
    lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ != "_EquinoxRuntimeError"


_QUIET = _QuietChecks()
_CALLBACKS = logging.getLogger("jax._src.callback")


def _quiet(on: bool) -> None:
    with _QuietChecks.lock:
        _QuietChecks.users += 1 if on else -1
        if _QuietChecks.users == (1 if on else 0):
            (_CALLBACKS.addFilter if on else _CALLBACKS.removeFilter)(_QUIET)


def _checked(error: BaseException) -> BaseException:
    """A failed Equinox check, which plain `jax.jit` raises with its message buried in a long
    one, as the `eqx.EquinoxRuntimeError` that `eqx.filter_jit` raises; anything else as is."""
    marker = "_EquinoxRuntimeError: "
    text = str(error)
    at = text.find(marker)
    if at < 0:
        return error
    return eqx.EquinoxRuntimeError(text[at + len(marker) :].split("\n\n")[0].rstrip())


# Equinox's checks raise (`EQX_ON_ERROR=raise`, the default) from a host callback. On an
# accelerator the call returns before the callback has run, and a failed check raises only
# where the result is waited for: `_settled` waits, as `eqx.filter_jit` does, so that the
# failure reaches the caller before the result is published. Otherwise nothing raises while
# an operation runs, and nothing is waited for.
_CHECKS_RAISE = os.environ.get("EQX_ON_ERROR", "raise") == "raise"


def _settled(fn: Callable[[], Any], wait: bool = True) -> Any:
    """`fn()`, waited for if its checks may raise, and a failed check raised as
    `eqx.filter_jit` raises it."""
    _quiet(True)
    try:
        out = fn()
        return jax.block_until_ready(out) if wait and _CHECKS_RAISE else out
    except Exception as error:
        checked = _checked(error)
        if checked is error:
            raise
        raise checked from None
    finally:
        _quiet(False)


def _closed(call: str, cause: BaseException | None) -> ServiceClosed:
    why = "" if cause is None else f" (its buffer was lost when an operation failed: {cause!r})"
    return ServiceClosed(f"`{call}`: the service is closed{why}.")


class _Cell:
    """The current buffer of a `ReplayService` and the lock that serializes its operations.

    The lock is held while an operation is dispatched, so that none reads a value another has
    consumed by donation (JAX orders the dispatched operations by their data), and, for one
    that makes a new buffer, until its checks have passed (`_settled`): a buffer is published
    only once it is known good. A sample's checks are waited for outside the lock.
    `published` counts the items in the current value.
    """

    def __init__(self, buffer: Any, donate: bool, inserts: int, gate: _Gate):
        self.buffer, self.donate, self.published, self.gate = buffer, donate, inserts, gate
        self.lock = threading.Lock()
        self.lost: BaseException | None = None

    def _check(self, call: str) -> None:
        if self.lost is not None:
            raise _closed(call, self.lost) from self.lost

    def write(self, op: Callable[[Any], Any], call: str, n: int = 0) -> None:
        """`buffer = op(buffer)`, holding `n` more items. If `op` raises after consuming a
        donated buffer, the buffer is lost and the service closes."""
        with self.lock:
            self._check(call)
            try:
                self.buffer = _settled(lambda: op(self.buffer))
            except BaseException as error:
                leaves = jax.tree.leaves(self.buffer)
                if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
                    self.lost = error
                    self.gate.close(error)
                raise
            self.published += n

    def read(self, op: Callable[[Any], Any], call: str) -> Any:
        """`op(buffer)`, which must not consume it."""
        with self.lock:
            self._check(call)
            out = _settled(lambda: op(self.buffer), wait=False)
        return _settled(lambda: out)  # its checks, outside the lock: the buffer is unchanged

    def copy(self, call: str) -> tuple[Any, int, int]:
        """The buffer (a copy if later operations may consume it), the items in it, and the
        samples counted so far."""
        with self.lock:
            self._check(call)
            buffer = self.buffer
            if self.donate:
                buffer = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, buffer)
            with self.gate.cond:
                return buffer, self.published, self.gate.samples


class Membership:
    """An actor or a learner of a `ReplayService`, counted in from `service.actor()` or
    `service.learner()` until its context exits (once; exiting again does nothing)."""

    def __init__(self, gate: _Gate, side: Side, call: str):
        gate.join(side, call)
        self._gate, self._in = gate, True
        self._side: Side = side

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        if self._in:
            self._in = False
            self._gate.leave(self._side)


class ReplayService:
    """One buffer shared by actor threads and learner threads in one process, under a rate
    law: Sebulba's layout, with envpool's async mode in the actors.

    The service owns the current buffer value and the cumulative counts of inserted items and
    sampled rows, as exact Python ints. Every insert and every sample first waits until
    `limiter.rate`'s law (Reverb's, see `RateLimiter`) lets it proceed, then runs the buffer's
    own method. An insert counts items (a replay's `add` 1, `add_batch` its items or its
    mask's `True`s) or steps (a trajectory buffer's `add` one per listed env, `extend` `n * T`);
    a sample counts rows (`batch_size`).

    **Concurrency.** A condition guards the counts and the waits, and only them (no JAX runs
    under it); waits are `threading.Condition.wait`s, woken by every change of the counts or
    the participants and by `close()`. A separate *buffer lock* serializes the buffer
    operations: each insert makes a new buffer from the current one (in place, with donation)
    and publishes it; each sample reads the current one. The lock is held while an operation
    is dispatched (JAX orders the dispatched operations by their data) and, for an insert or
    an update, until its checks have passed (see *Faults*). An insert *reserves* its count
    when it passes the law, so that two inserters never pass on the same state, and
    *commits* it, making it visible to samplers, once its buffer is published: a sampler
    never counts items not in the buffer yet. A sample counts its rows when it passes. An
    operation that raises gives its count back.

    **Faults.** An exception from the buffer's method reaches the caller, with the counts and
    the buffer as before the call: arguments that do not fit (structure, shapes, dtypes) raise
    before anything runs. A run-time fault (an `eqx.error_if` check: an env id repeated, a NaN
    priority) raises `eqx.EquinoxRuntimeError` from a host callback, which on an accelerator
    runs after the call has returned: as `eqx.filter_jit` does, the service waits for the
    checks of each operation (with `EQX_ON_ERROR=nan` or `off` nothing raises, and nothing is
    waited for). By then the operation has consumed a donated buffer: with `donate=True` the
    service closes, and later calls raise `ServiceClosed` with the fault as its cause. With
    `donate=False` nothing is lost, but each insert copies the buffer.

    **Participants and `WaitCannotEnd`.** Actors run inside `with service.actor():`, learners
    inside `with service.learner():`; each is counted in when the call is made and out when
    its context exits. The actors *have stopped* once one has been counted in and none is in
    any more, or after `close_inserts()`; the learners likewise. A call that cannot proceed
    while the side it waits for has stopped, and no operation is still running (it could roll
    back), raises `WaitCannotEnd`: at once, or as soon as that becomes so. Until a side has
    been counted in, the other waits for it as long as `timeout` says. A normal shutdown: the
    actors finish and leave; the learner samples what the law still allows, then its next
    `sample` raises `WaitCannotEnd`, which ends its loop. The actors must be counted in before
    any can finish (make their memberships before starting their threads, as below), or the
    learner could see them all stopped between two of them.

    !!! Example

        ```python
        import threading

        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        buffer = dx.UniformReplay({"obs": jnp.zeros(3)}, max_size=1000)
        limiter = dx.RateLimiter.sample_to_insert_ratio(
            2.0, 16, 64.0, insert_batch_size=8, sample_batch_size=4
        )
        service = dx.ReplayService(dx.RateLimited(buffer, limiter))

        def actor(membership, seed):
            with membership:
                for _ in range(10):
                    service.add_batch({"obs": np.full((8, 3), seed, np.float32)})

        def learner(key):
            with service.learner():
                while True:
                    key, sub = jax.random.split(key)
                    try:
                        batch = service.sample(sub, 4)
                    except dx.WaitCannotEnd:  # every actor has stopped
                        return

        # The actors join before any starts, so that none can finish before another joins.
        threads = [
            threading.Thread(target=actor, args=(service.actor(), seed)) for seed in range(4)
        ]
        threads.append(threading.Thread(target=learner, args=(jax.random.key(0),)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        inserts, samples = service.counts()
        assert inserts == 320 and not service.rate.can_sample(inserts, samples, 4)
        saved = service.snapshot()  # a `RateLimited` with these counts, for `dx.save`
        service.close()
        ```
    """

    def __init__(self, limited: RateLimited, *, donate: bool = True):
        """**Arguments:**

        - `limited`: a `RateLimited`: the buffer (any replay or trajectory buffer) and its
            `RateLimiter`, whose counts the service starts from (a restored snapshot goes
            on). The service takes the buffer over: with donation, its first operation
            consumes `limited.buffer`'s arrays.
        - `donate`: whether the operations update the buffer in place (the default). Without
            donation every insert copies the buffer, and a run-time fault loses nothing.

        **Raises:** `TypeError` if `limited` is not a `RateLimited` of a replay or trajectory
        buffer.
        """
        if not isinstance(limited, RateLimited):
            raise TypeError(
                "`ReplayService(limited=...)` must be a `RateLimited` (a buffer and its "
                f"`RateLimiter`), got {type(limited).__name__}."
            )
        buffer = limited.buffer
        if not isinstance(buffer, AbstractReplay | AbstractTrajectoryBuffer):
            raise TypeError(
                "`ReplayService(limited=...)`: the buffer must be a replay or a trajectory "
                f"buffer, got {type(buffer).__name__}."
            )
        self._donate = check_bool(donate, "ReplayService(donate=...)")
        self._limiter = limited.limiter
        inserts, samples = self._limiter.counts()
        self._gate = _Gate(self._limiter.rate, inserts, samples)
        self._cell = _Cell(buffer, self._donate, inserts, self._gate)
        self._envs = buffer.num_envs if isinstance(buffer, AbstractTrajectoryBuffer) else None
        self._queue = isinstance(buffer, TrajectoryQueue)

    @property
    def rate(self) -> Rate:
        """The law, `limiter.rate` (static)."""
        return self._gate.rate

    # --- inserts ----------------------------------------------------------------------------

    def add(self, items: PyTree, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Wait until the law allows, then store: the buffer's `add(items, *args, **kwargs)`.

        For a replay, one item (`args` may hold a `PrioritisedReplay`'s priority). For a
        trajectory buffer, `add(items, env_ids=None)`: one step for each listed env (every env
        if `None`), counted as that many steps. Arguments are arrays (NumPy or JAX) or `None`.

        **Arguments:**

        - `timeout`: the most seconds to wait for the law; `None` (the default) waits as long
            as it takes.

        **Raises:** `RateLimitTimeout`, `ServiceClosed`, `WaitCannotEnd` (see the class);
        `ValueError` at once for more items or steps in one call than the limiter's
        `insert_batch_size` (as `RateLimited`); and whatever the buffer's `add` raises.
        """
        call = "ReplayService.add"
        n = 1 if self._envs is None else _env_count(self._envs, args, kwargs)
        self._insert(_add, items, args, kwargs, n, timeout, call)

    def add_batch(
        self,
        items: PyTree,
        *args: Any,
        mask: Any = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        """A replay's `add_batch(items, *args, mask=mask, **kwargs)`, once the law allows:
        counted as the batch's items, or the `True`s of `mask` (read to the host).
        `timeout` and the errors are as for `add`."""
        call = "ReplayService.add_batch"
        if self._envs is not None:
            raise TypeError(f"`{call}`: a trajectory buffer takes `add` and `extend`.")
        n = _leading(items, 1, call)[0]
        n = n if mask is None else int(np.count_nonzero(np.asarray(mask)))
        self._insert(_add_batch, items, args, {**kwargs, "mask": mask}, n, timeout, call)

    def extend(
        self, items: PyTree, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> None:
        """A trajectory buffer's `extend(items, env_ids=None)`, once the law allows: `T` steps
        for each listed env, counted as `n * T` steps. `timeout` and the errors are as for
        `add`."""
        call = "ReplayService.extend"
        if self._envs is None:
            raise TypeError(f"`{call}`: a replay takes `add` and `add_batch`.")
        n = _env_count(self._envs, args, kwargs) * _leading(items, 2, call)[1]
        self._insert(_extend, items, args, kwargs, n, timeout, call)

    def _insert(
        self, op: Callable, items: Any, args: tuple, kwargs: dict, n: int, timeout: Any, call: str
    ) -> None:
        timeout = _timeout(timeout, call)
        noun = "item" if self._envs is None else "step"
        _check_amount(self.rate, n, "insert", noun, call)
        jitted = (_INSERTS_DONATED if self._donate else _INSERTS)[op]
        self._gate.pass_insert(n, noun, timeout, call)
        published = False
        try:
            self._cell.write(lambda buffer: jitted(buffer, items, args, kwargs), call, n)
            published = True
        finally:
            self._gate.end_insert(n, published)

    # --- samples and updates ------------------------------------------------------------------

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        *args: Any,
        method: str = "sample",
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Wait until the law allows `batch_size` rows, then return the buffer's
        `sample(key, batch_size, *args, **kwargs)`, or the `method` named.

        Arguments that are not arrays (`batch_size`, a `Window`, `source`, a Python float)
        are static: each value compiles once.

        **Arguments:**

        - `method`: the buffer's method to call, each counting `batch_size` rows:
            `"sample"` (the default), `"sample_by_age"` (with a `PolicyAge`), or
            `"sample_transitions"` (a `TrajectoryBuffer`'s n-step transitions).
        - `timeout`: as for `add`.

        **Raises:** as `add`, with the limiter's `sample_batch_size` for the rows of one call;
        `TypeError` for a `TrajectoryQueue` (its `pop` is not served).
        """
        call = "ReplayService.sample"
        rows = check_positive_int(batch_size, f"{call}(batch_size=...)")
        fn = _SAMPLERS[check_choice(method, tuple(_SAMPLERS), f"{call}(method=...)")]
        return self._draw(fn, rows, (key, batch_size, *args), kwargs, timeout, call)

    def sample_mixed(
        self,
        key: PRNGKeyArray,
        replay_batch_size: int,
        online_batch_size: int,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """A `TrajectoryBuffer`'s `sample_mixed`, once the law allows `replay_batch_size +
        online_batch_size` rows; as `sample` otherwise."""
        call = "ReplayService.sample_mixed"
        rows = check_positive_int(replay_batch_size + online_batch_size, f"{call}: the rows")
        args = (key, replay_batch_size, online_batch_size, *args)
        return self._draw(_sample_mixed, rows, args, kwargs, timeout, call)

    def _draw(
        self, fn: Callable, rows: int, args: tuple, kwargs: dict, timeout: Any, call: str
    ) -> Any:
        timeout = _timeout(timeout, call)
        if self._queue:
            raise TypeError(f"`{call}`: a TrajectoryQueue is read by `pop`, which is not served.")
        _check_amount(self.rate, rows, "sample", "row", call)
        dynamic, static = _split((fn, args, kwargs), call)
        self._gate.pass_sample(rows, timeout, call)
        done = False
        try:
            out = self._cell.read(lambda buffer: _CALL(buffer, static, dynamic), call)
            done = True
        finally:
            self._gate.end_sample(rows, done)
        return out

    def update(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Replace the buffer by `fn(buffer, *args, **kwargs)`, jitted, uncounted: for
        `set_priorities` after a learner step.

        `fn` is static, compared by identity: pass the same function every time (such as
        `dx.PrioritisedReplay.set_priorities`) and its arrays as `args`; not a fresh closure
        per call, which would compile every time, nor a buffer's bound method.

        **Raises:** `ServiceClosed` after `close()`; `TypeError` if `fn` does not return a
        buffer of the same type and configuration; whatever `fn` raises.
        """
        call = "ReplayService.update"
        if not callable(fn):
            raise TypeError(f"`{call}`: `fn` must be callable, got {type(fn).__name__}.")
        dynamic, static = _split((_update, (fn, *args), kwargs), call)
        jitted = _CALL_DONATED if self._donate else _CALL
        with self._gate.cond:
            self._gate.check_open(call)
        self._cell.write(lambda buffer: jitted(buffer, static, dynamic), call)

    # --- the buffer ---------------------------------------------------------------------------

    def snapshot(self) -> RateLimited:
        """The current buffer and its counts, as a `RateLimited` (its limiter's counts set by
        `with_counts`): what to save with `dx.save`, and to start a service from again.

        The counts are those of the items in this buffer. With donation the buffer is a copy
        (the service's own value is consumed by its next operation).

        **Raises:** `ServiceClosed` if the buffer was lost.
        """
        buffer, inserts, samples = self._cell.copy("ReplayService.snapshot")
        return RateLimited(buffer, self._limiter.with_counts(inserts, samples))

    def counts(self) -> tuple[int, int]:
        """The cumulative `(inserts, samples)` the law sees now: the items in the published
        buffer and the rows of every sample that has passed, as Python ints."""
        with self._gate.cond:
            return self._gate.inserts, self._gate.samples

    # --- participants and shutdown -------------------------------------------------------------

    def actor(self) -> Membership:
        """Count one actor in, now, until the returned context exits: `with service.actor():`
        around an actor's loop. **Raises:** `ServiceClosed` after `close()` or
        `close_inserts()`."""
        return Membership(self._gate, "actor", "ReplayService.actor")

    def learner(self) -> Membership:
        """As `actor`, for a learner. **Raises:** `ServiceClosed` after `close()`."""
        return Membership(self._gate, "learner", "ReplayService.learner")

    def close_inserts(self) -> None:
        """Say that no insert will come any more: waiting and later inserts raise
        `ServiceClosed`, and a learner that needs more inserts gets `WaitCannotEnd`. For
        actors that do not enter `actor()`."""
        self._gate.close(inserts_only=True)

    def close(self) -> None:
        """Close the service: waiting and later calls raise `ServiceClosed`; calls past the
        law finish; `counts()` and `snapshot()` still answer. Closing twice is allowed."""
        self._gate.close()
