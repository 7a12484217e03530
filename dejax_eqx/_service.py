"""ReplayService: one buffer shared by actor threads and learner threads under a rate law.

Sebulba-style actors and learners: the law is `Rate`'s, evaluated on exact Python ints; the
buffer operations are the buffer's own methods, each compiled once by `eqx.filter_jit`.
`_Gate` holds the counts and the waits, `_Cell` the buffer, and `ReplayService` puts them
together. Over a buffer spread across the processes of a `jax.distributed` program (a global
buffer), each process runs its own service: its actors are held to its share of the law, and
its learner, which samples in step with the other processes' learners, learns the global
counts from them by one collective (`_exchange`).
"""

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer, Source
from ._checks import check_bool, check_nonnegative_float, check_positive_int, plural
from ._episode_laws import WholeEpisode
from ._nstep import NStep
from ._policy_age import PolicyAge
from ._rate_limited import checked_rate_limited, insert_units, RateLimited
from ._rates import Rate
from ._results import check_result
from ._shard_map import run
from ._windows import Window


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

    `inserts` counts the items whose buffer is published and whom the law has counted in;
    `reserved` those that passed the law and are being written. Inserters test the law on
    `inserts + reserved` (two cannot pass on the same state), samplers on `inserts` (they
    never count items not in the buffer yet). `running` counts the operations between passing
    the law and finishing: each may still roll back, so no wait is declared endless while one
    runs.

    Over a buffer spread across `shares` processes, `inserts` are the global counts as of the
    last exchange with the other processes (`folded`), and this process's published inserts
    since then are `local`: its actors are held to its share of the law (`Rate.can_insert`
    with `shares`), and its learner exchanges the counts before it waits (`ReplayService`).
    """

    def __init__(self, rate: Rate, inserts: int, samples: int, shares: int):
        self.rate, self.shares = rate, shares
        self.cond = threading.Condition(threading.Lock())
        self.inserts, self.local, self.reserved = inserts, 0, 0
        self.samples, self.running = samples, 0
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
        """Why `side` will not act again (it has stopped), or `None`. Call with the lock."""
        if side == "actor" and self.inserts_closed:
            return "inserts were closed (`close_inserts()`)"
        if self.seen[side] and self.present[side] == 0:
            return f"every {side} has stopped"
        return None

    def _state(self) -> str:
        flight = f" (+{self.reserved} being written)" if self.reserved else ""
        local = f" (+{self.local} in this process since)" if self.local else ""
        return (
            f"inserts = {self.inserts}{local}{flight}, samples = {self.samples}; {_law(self.rate)}"
        )

    def _wait(
        self,
        deadline: float | None,
        timeout: float | None,
        other: Side,
        why: str,
        call: str,
        *,
        poll: float | None = None,
    ) -> None:
        """Wait for a change (at most `poll` seconds), or raise if none can help or the
        deadline has passed."""
        ended = self.ended(other)
        if ended is not None and self.running == 0 and poll is None:
            raise WaitCannotEnd(f"`{call}`: {why}, but {ended} ({self._state()}).")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise RateLimitTimeout(
                f"`{call}`: timed out after {timeout} s: {why} ({self._state()})."
            )
        if poll is not None:
            remaining = poll if remaining is None else min(remaining, poll)
        self.cond.wait(remaining)

    def pass_insert(self, n: int, noun: str, timeout: float | None, call: str) -> None:
        """Wait until the law lets `n` items in, then reserve them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rate = self.rate
        with self.cond:
            while True:
                self.check_open(call)
                if self.inserts_closed:
                    raise ServiceClosed(f"`{call}`: inserts were closed (`close_inserts()`).")
                pending = self.local + self.reserved
                ok = rate.can_insert(
                    self.inserts, self.samples, n, shares=self.shares, pending=pending
                )
                if n == 0 or ok:
                    self.reserved += n
                    self.running += 1
                    return
                k = samples_needed(rate, self.inserts + self.shares * pending, self.samples, n)
                why = f"the actor waits for {plural(k, 'more sample')} to insert {plural(n, noun)}"
                self._wait(deadline, timeout, "learner", why, call)

    def end_insert(self, n: int, published: bool) -> None:
        """Commit the reserved `n` items (`published`), or release them."""
        with self.cond:
            self.reserved -= n
            if published:
                if self.shares == 1:
                    self.inserts += n  # the law sees every insert at once
                else:
                    self.local += n  # counted in at the next exchange
            self.running -= 1
            self.cond.notify_all()

    def pass_sample(
        self,
        n: int,
        timeout: float | None,
        call: str,
        exchange: Callable[[int, bool], tuple[int, bool]] | None = None,
    ) -> None:
        """Wait until the law lets a sample of `n` rows through, then count it. With
        `exchange` (a buffer across processes), the counts are exchanged with the other
        processes' learners whenever the law does not allow it yet: every learner then reaches
        the same verdict, and waits (or gives up) with the others."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rate = self.rate
        with self.cond:
            while True:
                self.check_open(call)
                if rate.can_sample(self.inserts, self.samples, n):
                    self.samples += n
                    self.running += 1
                    return
                if exchange is not None:
                    local, active = self.local, self.ended("actor") is None
                    self.cond.release()  # a collective: no lock held while it runs
                    try:
                        total, anywhere = exchange(local, active or self.running > 0)
                    finally:
                        self.cond.acquire()
                    # `total`: every process's inserts since the last exchange.
                    self.inserts, self.local = self.inserts + total, self.local - local
                    self.cond.notify_all()  # an actor held to its share may pass now
                    if rate.can_sample(self.inserts, self.samples, n):
                        continue
                    if not anywhere:
                        k = inserts_needed(rate, self.inserts, self.samples, n)
                        raise WaitCannotEnd(
                            f"`{call}`: the learner waits for {plural(k, 'more insert')} to "
                            f"sample {plural(n, 'row')}, but every actor of every process has "
                            f"stopped ({self._state()})."
                        )
                k = inserts_needed(rate, self.inserts, self.samples, n)
                why = (
                    f"the learner waits for {plural(k, 'more insert')} to sample {plural(n, 'row')}"
                )
                poll = None if exchange is None else _POLL
                self._wait(deadline, timeout, "actor", why, call, poll=poll)

    def fold(self, exchange: Callable[[int, bool], tuple[int, bool]]) -> int:
        """Exchange the counts with the other processes, as no active actor (no lock held
        while the collective runs), fold this process's inserts into them, and return the
        global inserts."""
        with self.cond:
            local = self.local
        total = exchange(local, False)[0]  # every process's inserts since the last exchange
        with self.cond:
            self.inserts, self.local = self.inserts + total, self.local - local
            self.cond.notify_all()
            return self.inserts

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


# How long a learner across processes waits before it exchanges the counts again.
_POLL = 0.01


# ---------------------------------------------------------------------------------------------
# The buffer operations: module-level functions of (arguments, buffer), each compiled once per
# signature by `eqx.filter_jit`, which also waits for the checks of every call and raises a
# failed one as `eqx.EquinoxRuntimeError`. The buffer is the last argument, the one donated
# (`donate="all-except-first"`): the arguments stay the caller's.


def _add(args: tuple, buffer: Any) -> Any:
    items, env_ids = args
    if env_ids is None:
        return buffer.add(items) if _is_replay(buffer) else buffer.add(items, None)
    return buffer.add(items, env_ids)


def _is_replay(buffer: Any) -> bool:
    return not isinstance(buffer, AbstractTrajectoryBuffer)


def _add_batch(args: tuple, buffer: Any) -> Any:
    items, priorities, mask = args
    if priorities is None:
        return buffer.add_batch(items, mask=mask)
    return buffer.add_batch(items, priorities, mask=mask)


def _extend(args: tuple, buffer: Any) -> Any:
    items, env_ids = args
    return buffer.extend(items, env_ids)


def _sample(args: tuple, buffer: Any) -> Any:
    key, batch_size, what, options = args
    if what is None:
        return buffer.sample(key, batch_size, **options)
    return buffer.sample(key, batch_size, what, **options)


def _pop(args: tuple, buffer: Any) -> Any:
    (length,) = args
    items, buffer = buffer.pop(length)
    return buffer, items


def _update(args: tuple, buffer: Any) -> Any:
    fn, fn_args = args
    out = fn(buffer, *fn_args)
    spec = lambda tree: (  # noqa: E731
        jax.tree.structure(tree),
        [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)],
    )
    if spec(out) != spec(buffer):
        raise TypeError(
            "`ReplayService.update`: `fn` must return the buffer it was given, updated: the "
            f"same type, configuration, shapes and dtypes; got {type(out).__name__}."
        )
    return out


def _jitted(op: Callable[..., Any], donate: bool) -> Callable[..., Any]:
    return _DONATED[op] if donate else _KEPT[op]


_OPS = (_add, _add_batch, _extend, _pop, _update)
_DONATED = {op: eqx.filter_jit(op, donate="all-except-first") for op in _OPS}
_KEPT = {op: eqx.filter_jit(op) for op in (*_OPS, _sample)}


def _exchange(buffer: Any, local: int, active: bool) -> tuple[int, bool]:
    """The inserts of every process's service added to the counts, and whether an actor of
    any process is still active: one all-reduce over the buffer's shards, which every
    process's learner makes in the same order. Each process writes its own counts into its
    own shards' rows (`place_shards`); each count is sent as four 16-bit limbs, so the sum is
    exact for any count below `2**63`."""
    shards = buffer.num_shards
    processes = jax.process_count()
    row = [(local >> (16 * k)) & 0xFFFF for k in range(4)] + [int(active)]
    rows = buffer.place_shards(np.tile(np.asarray(row, np.uint32), (shards, 1)))
    totals = np.asarray(run(_exchanged, buffer, rows))
    per_process = shards // processes  # every shard of a process sent the same row
    counted = sum(int(totals[k]) << (16 * k) for k in range(4)) // per_process
    return counted, bool(totals[4])


def _exchanged(buffer: Any, rows: Array) -> Array:
    return buffer.map_shards(_sum_rows, (rows,), ())[1]


def _sum_rows(rows: tuple[Array], shared: tuple, axis: str | None, shards: int) -> Any:
    (row,) = rows
    total = row if axis is None else jax.lax.psum(row, axis)
    return (row[None],), total


def _own(n: int, shares: int, mask: Any, call: str) -> int:
    """This process's units of an insert of `n` units (every process's rows together, as
    `rows()` makes them) over `shares` processes: its equal share, or the `True`s of `mask`
    in its own rows. Each process counts its own; the exchange sums them."""
    if shares == 1:
        return n
    if mask is not None:
        if not isinstance(mask, jax.Array) or mask.is_fully_addressable:
            raise TypeError(
                f"`{call}(mask=...)`: over {shares} processes, give the mask as the items are "
                "given, a global array of every process's rows (`buffer.rows(local_mask)`)."
            )
        blocks = {(s.index[0].start, s.index[0].stop): s.data for s in mask.addressable_shards}
        return sum(int(np.count_nonzero(np.asarray(b))) for b in blocks.values())
    if n % shares:
        raise ValueError(
            f"`{call}`: over {shares} processes an insert holds every process's rows, an equal "
            f"share each (`buffer.rows(...)`); {n} units do not split so."
        )
    return n // shares


def _timeout(timeout: float | None, call: str) -> float | None:
    return None if timeout is None else check_nonnegative_float(timeout, f"{call}(timeout=...)")


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


def _closed(call: str, cause: BaseException | None) -> ServiceClosed:
    why = "" if cause is None else f" (its buffer was lost when an operation failed: {cause!r})"
    return ServiceClosed(f"`{call}`: the service is closed{why}.")


class _Cell:
    """The current buffer of a `ReplayService` and the lock that serializes its operations.

    The lock is held while an operation runs: until its checks have passed (`eqx.filter_jit`
    waits for them), so that a buffer is published only once it is known good, and so that
    none reads a value another has consumed by donation. `published` counts the items in the
    current value.
    """

    def __init__(self, buffer: Any, donate: bool, inserts: int, gate: _Gate):
        self.buffer, self.donate, self.published, self.gate = buffer, donate, inserts, gate
        self.lock = threading.Lock()
        self.lost: BaseException | None = None

    def _check(self, call: str) -> None:
        if self.lost is not None:
            raise _closed(call, self.lost) from self.lost

    def write(self, op: Callable[..., Any], args: tuple, call: str, n: int = 0) -> Any:
        """`buffer = op(args, buffer)` (or `buffer, out = ...` for `_pop`), holding `n` more
        items. If `op` raises after consuming a donated buffer, the buffer is lost and the
        service closes."""
        with self.lock:
            self._check(call)
            try:
                out = _jitted(op, self.donate)(args, self.buffer)
            except BaseException as error:
                leaves = jax.tree.leaves(self.buffer)
                if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
                    self.lost = error
                    self.gate.close(error)
                raise
            self.buffer, result = out if op is _pop else (out, None)
            fault = getattr(self.buffer, "result", None)
            if fault is not None and not bool(fault.ok):
                # A `throw=False` buffer's fault: the call changed nothing; it is raised here,
                # to its caller, and the buffer serves on.
                self.buffer = self.buffer.with_throw(True).with_throw(False)
                check_result(fault, call)
            self.published += n
            return result

    def read(self, op: Callable[..., Any], args: tuple, call: str) -> Any:
        """`op(args, buffer)`, which must not consume it."""
        with self.lock:
            self._check(call)
            out = _KEPT[op](args, self.buffer)
            if self.buffer.throw:
                return out
            out, fault = out  # a `throw=False` buffer's read: its fault raises here
            check_result(fault, call)
            return out

    def exchange(self, local: int, active: bool) -> tuple[int, bool]:
        with self.lock:
            self._check("ReplayService.sample")
            return _exchange(self.buffer, local, active)

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


def _shares(buffer: Any) -> int:
    """The processes a buffer is spread across (1 for one held whole by this process).

    **Raises:** `ValueError` if its shards are not spread evenly over them.
    """
    shares = jax.process_count() if buffer.num_shards > 1 else 1
    if buffer.num_shards % shares:
        raise ValueError(
            f"`ReplayService`: the buffer's {buffer.num_shards} shards are not spread "
            f"evenly over {shares} processes; each process needs the same number."
        )
    return shares


def _insert(
    cell: _Cell, op: Callable[..., Any], args: tuple, n: int, noun: str, timeout: Any, call: str
) -> None:
    """Wait until the law lets `n` items (`noun`s) in, then `op` on the buffer: the count is
    committed once its buffer is published, and given back if it raises."""
    timeout = _timeout(timeout, call)
    # Over processes, judged as the law judges a share: as if every process inserted as much.
    _check_amount(cell.gate.rate, n * cell.gate.shares, "insert", noun, call)
    cell.gate.pass_insert(n, noun, timeout, call)
    published = False
    try:
        cell.write(op, args, call, n)
        published = True
    finally:
        cell.gate.end_insert(n, published)


def _draw(
    cell: _Cell,
    op: Callable[..., Any],
    rows: int,
    args: tuple,
    timeout: Any,
    call: str,
    exchange: Callable[[int, bool], tuple[int, bool]] | None,
) -> Any:
    """Wait until the law lets `rows` rows through, then `op` on the buffer: `_pop` consumes
    it (`_Cell.write`), a sample reads it. The count is given back if it raises."""
    timeout = _timeout(timeout, call)
    _check_amount(cell.gate.rate, rows, "sample", "row", call)
    cell.gate.pass_sample(rows, timeout, call, exchange)
    done = False
    try:
        out = cell.write(op, args, call) if op is _pop else cell.read(op, args, call)
        done = True
    finally:
        cell.gate.end_sample(rows, done)
    return out


def _sample_options(
    buffer: Any,
    trajectories: bool,
    what: Window | NStep | WholeEpisode | None,
    given: dict[str, Any],
    call: str,
) -> dict[str, Any]:
    """`sample`'s options given (those not `None`), checked at the door, before any wait: the
    law they ask for is made (from the buffer's static configuration) and dropped."""
    options = {name: value for name, value in given.items() if value is not None}
    if not trajectories and (what is not None or set(options) - {"beta", "age"}):
        raise TypeError(
            f"`{call}`: a replay's `sample` takes `age` and `beta` only; "
            f"{sorted(set(options) - {'beta', 'age'}) or ['what']} are a trajectory "
            "buffer's."
        )
    if trajectories:
        buffer.law(what, **options, call=call)
    else:
        buffer.law(**options, call=call)
    return options


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
    priority) raises `eqx.EquinoxRuntimeError`: every operation runs through `eqx.filter_jit`,
    which waits for its checks, also on an accelerator. By then the operation has consumed a
    donated buffer: with `donate=True` the service closes, and later calls raise
    `ServiceClosed` with the fault as its cause. With `donate=False` nothing is lost, but each
    insert copies the buffer.

    **Across processes.** Over a global buffer (`GlobalReplay`, `GlobalTrajectoryBuffer`),
    each process of a `jax.distributed` program runs its own service: its actors insert their
    own rows (each add a global array of this process's rows, as `rows` makes it; no
    collective), and its learner samples the whole buffer in step with the other processes'
    learners (each sample a collective). An actor sees only its own process's inserts since
    the counts were last exchanged, and is held to its process's share of the law: it may
    insert if the balance stays within `max_diff` as if every process had inserted as much
    (summed over the processes, the law's bound holds). A learner whose sample the law does
    not allow yet exchanges the counts with the other learners (one all-reduce), all reach the
    same verdict, and they wait, or give up together with `WaitCannotEnd` once every actor of
    every process has stopped. So the law holds over the global counts, exactly.

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

        - `limited`: a `RateLimited`: any buffer (a replay, a trajectory buffer or queue, a
            global buffer) and its `RateLimiter`, whose counts the service starts from (a
            restored snapshot goes on). The service takes the buffer over: with donation, its
            first operation consumes `limited.buffer`'s arrays.
        - `donate`: whether the operations update the buffer in place (the default). Without
            donation every insert copies the buffer, and a run-time fault loses nothing.

        **Raises:** `TypeError` if `limited` is not a `RateLimited`; `ValueError` for a
        global buffer whose processes hold unequal numbers of shards.
        """
        limited = checked_rate_limited(limited, "ReplayService(limited=...)")
        self._donate = check_bool(donate, "ReplayService(donate=...)")
        self._limiter = limited.limiter
        inserts, samples = limited.counts()
        buffer = limited.buffer
        shares = _shares(buffer)
        self._gate = _Gate(self._limiter.rate, inserts, samples, shares)
        self._cell = _Cell(buffer, self._donate, inserts, self._gate)
        self._trajectories = isinstance(buffer, AbstractTrajectoryBuffer)
        self._noun = "step" if self._trajectories else "item"
        self._envs = buffer.num_envs if isinstance(buffer, AbstractTrajectoryBuffer) else 0
        self._exchange = None if shares == 1 else self._cell.exchange

    @property
    def rate(self) -> Rate:
        """The law, `limiter.rate` (static)."""
        return self._gate.rate

    # --- inserts ----------------------------------------------------------------------------

    def add(
        self,
        items: PyTree[ArrayLike],
        env_ids: Integer[ArrayLike, " n"] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Wait until the law allows, then store: the buffer's `add`.

        For a replay, one item (`add(item)`; `env_ids` must be `None`). For a trajectory
        buffer, `add(items, env_ids=None)`: one step for each listed env (every env if
        `None`), counted as that many steps. Arguments are arrays (NumPy or JAX) or `None`.

        **Arguments:**

        - `timeout`: the most seconds to wait for the law; `None` (the default) waits as long
            as it takes.

        **Raises:** `RateLimitTimeout`, `ServiceClosed`, `WaitCannotEnd` (see the class);
        `ValueError` at once for more items or steps in one call than the limiter's
        `insert_batch_size` (as `RateLimited`); and whatever the buffer's `add` raises.
        """
        call = "ReplayService.add"
        if not self._trajectories and env_ids is not None:
            raise TypeError(f"`{call}`: a replay's `add` takes one item, and no `env_ids`.")
        n = insert_units(items, call, steps=False) if self._trajectories else 1
        n = _own(n, self._gate.shares, None, call)
        _insert(self._cell, _add, (items, env_ids), n, self._noun, timeout, call)

    def add_batch(
        self,
        items: PyTree[ArrayLike],
        priorities: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        timeout: float | None = None,
    ) -> None:
        """A replay's `add_batch(items, priorities, mask=mask)`, once the law allows:
        counted as the batch's items, or the `True`s of `mask` (read to the host).
        `timeout` and the errors are as for `add`."""
        call = "ReplayService.add_batch"
        if self._trajectories:
            raise TypeError(f"`{call}`: a trajectory buffer takes `add` and `extend`.")
        shares = self._gate.shares
        n = insert_units(items, call, steps=False, mask=mask if shares == 1 else None)
        n = _own(n, shares, mask, call)
        _insert(self._cell, _add_batch, (items, priorities, mask), n, self._noun, timeout, call)

    def extend(
        self,
        items: PyTree[ArrayLike],
        env_ids: Integer[ArrayLike, " n"] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """A trajectory buffer's `extend(items, env_ids=None)`, once the law allows: `T` steps
        for each listed env, counted as `n * T` steps. `timeout` and the errors are as for
        `add`."""
        call = "ReplayService.extend"
        if not self._trajectories:
            raise TypeError(f"`{call}`: a replay takes `add` and `add_batch`.")
        n = _own(insert_units(items, call, steps=True), self._gate.shares, None, call)
        _insert(self._cell, _extend, (items, env_ids), n, self._noun, timeout, call)

    # --- samples and updates ------------------------------------------------------------------

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Wait until the law allows `batch_size` rows, then return the buffer's
        `sample(key, batch_size, what, ...)` with the options given (those of its family's
        `sample`: a replay takes `age` and `beta` only).

        Arguments that are not arrays (`batch_size`, a `Window`, `source`, a Python float)
        are static: each value compiles once.

        **Raises:** as `add`, with the limiter's `sample_batch_size` for the rows of one call;
        `TypeError` for a trajectory queue (read with `pop`).
        """
        call = "ReplayService.sample"
        rows = check_positive_int(batch_size, f"{call}(batch_size=...)")
        given = {
            "distribution_power": distribution_power,
            "source": source,
            "discount": discount,
            "beta": beta,
            "age": age,
        }
        options = _sample_options(self._cell.buffer, self._trajectories, what, given, call)
        args = (key, batch_size, what, options)
        return _draw(self._cell, _sample, rows, args, timeout, call, self._exchange)

    def pop(self, sequence_length: int, *, timeout: float | None = None) -> PyTree[Array]:
        """Wait until the law allows `num_envs` rows, then a trajectory queue's `pop`: the
        `sequence_length` oldest unread steps of every env, removed.

        **Raises:** as `sample`; `TypeError` for a buffer that is not read once.
        """
        call = "ReplayService.pop"
        if not self._trajectories:
            raise TypeError(f"`{call}`: a replay is sampled, not read once.")
        args = (sequence_length,)
        return _draw(self._cell, _pop, self._envs, args, timeout, call, self._exchange)

    def update(self, fn: Callable[..., Any], *args: PyTree[ArrayLike]) -> None:
        """Replace the buffer by `fn(buffer, *args)`, compiled, uncounted: for
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
        with self._gate.cond:
            self._gate.check_open(call)
        self._cell.write(_update, (fn, args), call)

    # --- the buffer ---------------------------------------------------------------------------

    def snapshot(self) -> RateLimited:
        """The current buffer and its counts, as a `RateLimited` (its limiter's counts set by
        `with_counts`): what to save with `dx.save`, and to start a service from again.

        The counts are those of the items in this buffer (over processes: every process's,
        exchanged, so every process calls it, in step). With donation the buffer is a copy
        (the service's own value is consumed by its next operation).

        **Raises:** `ServiceClosed` if the buffer was lost.
        """
        buffer, inserts, samples = self._cell.copy("ReplayService.snapshot")
        if self._exchange is not None:
            inserts = self._gate.fold(self._exchange)
        return RateLimited(buffer, self._limiter.with_counts(inserts, samples))

    def counts(self) -> tuple[int, int]:
        """The cumulative `(inserts, samples)` the law sees now: the items in the published
        buffer and the rows of every sample that has passed, as Python ints (over processes:
        the global inserts as of the last exchange, and this process's since)."""
        with self._gate.cond:
            return self._gate.inserts + self._gate.local, self._gate.samples

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
