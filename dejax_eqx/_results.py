"""Faults as results: what a buffer built with `throw=False` reports instead of raising.

A fault of such a buffer is an int32 *code*: the kind of fault (an item of `RESULTS`) in its
high bits and, in its low 24 bits, a hash of the full message the call would have raised
(the call, the configuration's numbers, the line of user code that made the call). The
message itself is kept on the host in `_MESSAGES`, filled when a call is traced, so that
`Result.check()` raises exactly what `throw=True` would have raised. The hash (not an index
in the order of tracing) makes a code the same in every process of a program.

`_faults.py` decides *when* faults are recorded rather than raised; this module says what a
recorded fault is, and how public methods hand it to their caller (`reports`).
"""

import functools
import re
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

from ._checks import check_bool
from ._faults import is_concrete, recording, SITE


_P = ParamSpec("_P")
_R = TypeVar("_R")


# Each kind of fault and its text (`…` where a message says more), in the order of `RESULTS`.
_TEXTS: dict[str, str] = {
    "successful": "",
    # Nothing to draw or read.
    "empty": "cannot sample from an empty …",
    "pop_empty": "cannot pop from an empty CircularBuffer",
    "zero_priority": "every stored … has priority 0; none can be drawn",
    "no_window": "no env's … window has an admissible start; a start needs …",
    "no_transition": (
        "no env's … window holds n + 1 = … steps yet; a transition needs its n steps and the "
        "step after them"
    ),
    "no_prioritised_window": (
        "no window is admissible yet: no env holds … steps from a start on a multiple of period = …"
    ),
    "too_old": (
        "every … that could be drawn is older than `max_age` (its age, `current` minus its "
        "policy version, is above `max_age`); no … can be drawn"
    ),
    "no_cluster_item": (
        "no cluster holds an item that can be drawn (every stored item has priority 0, or is "
        "older than `max_age`)"
    ),
    "nothing_to_peek": "an env has no stored step yet; there is nothing to peek at",
    "queue_short": "an env holds fewer than …; pop once `can_pop(sequence_length)` holds",
    # Names that name nothing.
    "index_out_of_range": "index out of range; … must satisfy 0 <= index < …",
    "index_names_no_item": (
        "an index names no item of any shard (a global index is shard · … + the index within "
        "the shard, below max_size = …)"
    ),
    "env_id_out_of_range": (
        "an env id is out of range; env ids must satisfy 0 <= env_id < num_envs = …"
    ),
    "env_id_outside": "an env id is outside [0, num_envs) = [0, …)",
    "env_id_repeated": "an env id occurs more than once; each call adds to each env at most once",
    "env_id_other_shard": (
        "rows of block s of `env_ids` must name envs of shard s (s · … <= env id < (s + 1) · …);"
        " a process adds only to its own envs"
    ),
    "cluster_id_out_of_range": "a cluster id is outside [0, num_clusters) = [0, …)",
    "cluster_fn_out_of_range": (
        "`cluster_fn` returned a cluster id outside [0, num_clusters) = [0, …)"
    ),
    "start_not_taken": (
        "a start is not a step of its env (negative, or not yet taken); stamps must come from "
        "this buffer"
    ),
    "stamp_not_given": (
        "a stamp this buffer cannot have given: its start is not on a multiple of period = …, "
        "or its window of … steps has not been stored yet"
    ),
    "step_overwritten": "a step is no longer stored; a newer step took its slot",
    "stale_window": (
        "a window is stale (its first step has been overwritten); read only the windows "
        "`stale` says are not"
    ),
    # Values out of their range.
    "bad_priority": "priorities must be finite and non-negative",
    "bad_value": "values must be finite and non-negative",
    "bad_mass": "masses must be finite and non-negative",
    "mass_not_finite": (
        "the total priority mass sum(priority ** priority_exponent) is not finite in the "
        "tree's dtype"
    ),
    "bad_max_priority": "`max_priority` must be finite and at least 1",
    "bad_beta": "`beta` must be finite and non-negative",
    "bad_discount": "`discount` must be in [0, 1]",
    "bad_distribution_power": "`distribution_power` must be finite",
    "bad_size": "`size` must be positive",
    "bad_probability": "probabilities must be positive",
    "float_too_large": (
        "`…` holds a finite value too large for …, the dtype it is used in (it would become inf)"
    ),
    "version_ahead": (
        "a stored … has a policy version greater than `current` (or negative); every stored "
        "version must be in [0, current]"
    ),
    "bad_policy_count": "must be in [0, 2**31 - 1]",
    "step_count_overflow": (
        "an env would pass 2**31 - 1 steps, the most its int32 step count holds; the step "
        "numbers that align periods and stamp samples would wrap"
    ),
    "queue_full": (
        "an env's queue has no room for …; the add would overwrite unread ones (max_length = …)."
        " Pop first, or check `can_add`"
    ),
    "restore_ends": "`ends` must be in [0, 2**31 - 1]",
    "restore_lengths": "`lengths` must be in [0, max_length = …]",
    "restore_lengths_exceed_ends": "`lengths` exceed `ends`",
    # The rate law.
    "insert_not_allowed": (
        "the rate limit does not allow this insert now (…): the learner is behind. Call "
        "`can_insert` first, and insert when it is True"
    ),
    "sample_not_allowed": (
        "the rate limit does not allow this sample now (samples_per_insert = …, "
        "min_size_to_sample = …, min_diff = …): fewer than min_size_to_sample items are in, or "
        "the actors are behind. Call `can_sample` (or `sample_budget`) first, and sample when "
        "it allows"
    ),
    "insert_too_large": (
        "`n` must be in [0, insert_batch_size = …]; a larger insert could deadlock the limiter "
        "(its deadlock check holds for inserts of at most … items)"
    ),
    "sample_too_large": (
        "`n` must be in [0, sample_batch_size = …]; a larger sample could deadlock the limiter "
        "(its deadlock check holds for samples of at most … rows)"
    ),
    "rate_counters_overflow": (
        "the limiter's counters would leave their range (counts below 2**63, the scaled "
        "balance within ±2**62); a bound (`min_diff`, `max_diff`) that holds the balance "
        "keeps it there"
    ),
    # Mixtures.
    "bad_fractions": "every fraction must be finite and non-negative",
    "fractions_sum": "the fractions must sum to 1 (within …)",
    "past_max_fraction": "part … was given more rows than its max_fraction = … allows (… of …)",
    # Episodes as the unit.
    "no_episode_start": (
        "no … that could be drawn is the first step of a stored episode "
        "(`Window(starts='episode')`)"
    ),
    "no_episode": "no stored … episode can be drawn; a whole-episode row needs …",
    # The flashbax layer's own.
    "flashbax_no_window": (
        "an index names no window: indices must be sum-tree leaves in [0, …) whose window has "
        "been stored, as `sample` returns them"
    ),
    "flashbax_depth_level": "depth_level must be in [0, …] (the root is 0)",
    "flashbax_node_index": "node_index must be in [0, 2**depth_level): level d holds 2**d nodes",
    "flashbax_empty_tree": (
        "every leaf is 0 (nothing stored yet, or every priority 0), so no leaf …"
    ),
    "flashbax_query_value": "query_value must be in [0, 1] (a fraction of the total), not NaN",
    "flashbax_sequence_length": (
        "sample_sequence_length = …, but this state already holds steps added with "
        "sample_sequence_length = …; the windows a state prioritises have one length, fixed by "
        "its first add. Use the same sample_sequence_length for every add and sample of a state"
    ),
    "flashbax_too_few_steps": (
        "the buffer holds fewer than sequence_length = … steps per row; sample once "
        "`can_sample` holds"
    ),
}


class RESULTS(eqx.Enumeration):
    """What a call of a buffer built with `throw=False` reports: `successful`, or the kind
    of fault that `throw=True` would have raised, one item per kind. Each item's message is
    the text of its kind, with `…` where a message says more (the call, the configuration's
    numbers); `Result.message` gives the full message of a fault.

    Compare a result's `kind` with an item: `buf.result.kind == dx.RESULTS.empty`.
    """

    successful = _TEXTS["successful"]
    empty = _TEXTS["empty"]
    pop_empty = _TEXTS["pop_empty"]
    zero_priority = _TEXTS["zero_priority"]
    no_window = _TEXTS["no_window"]
    no_transition = _TEXTS["no_transition"]
    no_prioritised_window = _TEXTS["no_prioritised_window"]
    too_old = _TEXTS["too_old"]
    no_cluster_item = _TEXTS["no_cluster_item"]
    nothing_to_peek = _TEXTS["nothing_to_peek"]
    queue_short = _TEXTS["queue_short"]
    index_out_of_range = _TEXTS["index_out_of_range"]
    index_names_no_item = _TEXTS["index_names_no_item"]
    env_id_out_of_range = _TEXTS["env_id_out_of_range"]
    env_id_outside = _TEXTS["env_id_outside"]
    env_id_repeated = _TEXTS["env_id_repeated"]
    env_id_other_shard = _TEXTS["env_id_other_shard"]
    cluster_id_out_of_range = _TEXTS["cluster_id_out_of_range"]
    cluster_fn_out_of_range = _TEXTS["cluster_fn_out_of_range"]
    start_not_taken = _TEXTS["start_not_taken"]
    stamp_not_given = _TEXTS["stamp_not_given"]
    step_overwritten = _TEXTS["step_overwritten"]
    stale_window = _TEXTS["stale_window"]
    bad_priority = _TEXTS["bad_priority"]
    bad_value = _TEXTS["bad_value"]
    bad_mass = _TEXTS["bad_mass"]
    mass_not_finite = _TEXTS["mass_not_finite"]
    bad_max_priority = _TEXTS["bad_max_priority"]
    bad_beta = _TEXTS["bad_beta"]
    bad_discount = _TEXTS["bad_discount"]
    bad_distribution_power = _TEXTS["bad_distribution_power"]
    bad_size = _TEXTS["bad_size"]
    bad_probability = _TEXTS["bad_probability"]
    float_too_large = _TEXTS["float_too_large"]
    version_ahead = _TEXTS["version_ahead"]
    bad_policy_count = _TEXTS["bad_policy_count"]
    step_count_overflow = _TEXTS["step_count_overflow"]
    queue_full = _TEXTS["queue_full"]
    restore_ends = _TEXTS["restore_ends"]
    restore_lengths = _TEXTS["restore_lengths"]
    restore_lengths_exceed_ends = _TEXTS["restore_lengths_exceed_ends"]
    insert_not_allowed = _TEXTS["insert_not_allowed"]
    sample_not_allowed = _TEXTS["sample_not_allowed"]
    insert_too_large = _TEXTS["insert_too_large"]
    sample_too_large = _TEXTS["sample_too_large"]
    rate_counters_overflow = _TEXTS["rate_counters_overflow"]
    bad_fractions = _TEXTS["bad_fractions"]
    fractions_sum = _TEXTS["fractions_sum"]
    past_max_fraction = _TEXTS["past_max_fraction"]
    no_episode_start = _TEXTS["no_episode_start"]
    no_episode = _TEXTS["no_episode"]
    flashbax_no_window = _TEXTS["flashbax_no_window"]
    flashbax_depth_level = _TEXTS["flashbax_depth_level"]
    flashbax_node_index = _TEXTS["flashbax_node_index"]
    flashbax_empty_tree = _TEXTS["flashbax_empty_tree"]
    flashbax_query_value = _TEXTS["flashbax_query_value"]
    flashbax_sequence_length = _TEXTS["flashbax_sequence_length"]
    flashbax_too_few_steps = _TEXTS["flashbax_too_few_steps"]


# ---------------------------------------------------------------------------------------------
# Messages and codes

_KIND_BITS = 24
_HASH_MASK = (1 << _KIND_BITS) - 1
_CALL = re.compile(r"`[^`\n]*`:? ?")


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(".+?".join(re.escape(part) for part in text.split("…")), re.DOTALL)


# The kinds, most specific first (the most literal text): a message is of the first that
# matches it whole. An item's value is its position in `_TEXTS` (the class is written in that
# order; a test holds it).
_KINDS: list[tuple[int, re.Pattern[str]]] = sorted(
    ((i, _pattern(text)) for i, text in enumerate(_TEXTS.values()) if i > 0),
    key=lambda kind: -len(list(_TEXTS.values())[kind[0]].replace("…", "")),
)

# Every message a code was made for in this process, by code (a list: two messages that
# share a kind and a 24-bit hash are told apart by listing both).
_MESSAGES: dict[int, list[str]] = {}
_lock = threading.Lock()


def kind_of(message: str) -> int:
    """The index in `RESULTS` of the kind of `message` (a full message, as `check_faults`
    gets it). A message of no kind is a bug of the library: the test of `RESULTS` against
    the catalogue of `docs/errors.md` keeps every message of the package in a kind."""
    body = message.split(SITE)[0]
    found = _CALL.match(body)
    body = body[found.end() :] if found else body
    for index, pattern in _KINDS:
        if pattern.fullmatch(body):
            return index
    raise AssertionError(f"dejax_eqx: a fault message of no kind in `RESULTS`: {message!r}")


def code_of(message: str) -> int:
    """The code that reports `message`, registered so that `Result.message` finds it."""
    code = (kind_of(message) << _KIND_BITS) | (zlib.crc32(message.encode()) & _HASH_MASK)
    with _lock:
        known = _MESSAGES.setdefault(code, [])
        if message not in known:
            known.append(message)
    return code


def _message(code: int) -> str:
    known = _MESSAGES.get(code)
    if not known:
        kind = code >> _KIND_BITS
        text = list(_TEXTS.values())[kind] if 0 < kind < len(_TEXTS) else "unknown"
        return (
            f"a fault of kind `{text}` (code {code}), whose full message was made in another "
            "process or program"
        )
    if len(known) == 1:
        return known[0]
    return "one of these faults (they share a code):\n" + "\n".join(known)


class Result(eqx.Module):
    """The first fault of a `throw=False` buffer's calls, or of one read: an int32 code per
    lane (a scalar, or one per lane under `vmap`). 0 is success.

    Made by the buffer's calls, never by hand; kept first-wins (`first`), so a `scan` of
    many calls carries the fault of the earliest faulty one.
    """

    code: Int[Array, "*lanes"]

    @staticmethod
    def successful() -> "Result":
        """A result that holds no fault."""
        return Result(jnp.zeros((), jnp.int32))

    @property
    def ok(self) -> Bool[Array, "*lanes"]:
        """Whether no fault is held (per lane)."""
        return self.code == 0

    @property
    def kind(self) -> RESULTS:
        """The kind of the fault, a `RESULTS` item (`RESULTS.successful` if none)."""
        item_type = type(RESULTS.successful)  # equinox's item class, as `RESULTS.promote` makes
        return item_type(jnp.right_shift(self.code, _KIND_BITS), RESULTS)  # pyright: ignore

    def first(self, later: "Result") -> "Result":
        """This result if it holds a fault, else `later`: the first fault wins."""
        return Result(jnp.where(self.code != 0, self.code, later.code))

    @property
    def message(self) -> str | None:
        """The full message of the fault held (of the first faulty lane, which it names),
        or `None`: what `check` raises. On the host: the code must be concrete."""
        code = np.asarray(self.code)
        faulty = np.flatnonzero(code.reshape(-1))
        if faulty.size == 0:
            return None
        lane = int(faulty[0])
        text = _message(int(code.reshape(-1)[lane]))
        if code.ndim:
            where = np.unravel_index(lane, code.shape)
            text = f"{text}\n  (in lane {tuple(int(i) for i in where)} of {code.shape})"
        return text

    def check(self) -> None:
        """Raise `equinox.EquinoxRuntimeError` with the fault's message, as `throw=True`
        would have raised it; nothing if no fault is held. On the host."""
        if not is_concrete(self.code):
            raise TypeError(
                "`Result.check`: the result is traced; check it outside `jit` (return it, or "
                "the buffer that holds it, from the compiled function)."
            )
        message = self.message
        if message is not None:
            raise eqx.EquinoxRuntimeError(message)


def result_of(faults: Sequence[tuple[ArrayLike, str]]) -> Result:
    """The result of one call: the code of its first fault that holds (in the order they were
    checked), or success. Raises at once, as `throw=True` would, where the faults are
    concrete (an eager call) and one holds."""
    if not faults:
        return Result.successful()
    preds = [jnp.any(jnp.asarray(pred)) for pred, _ in faults]
    codes = [code_of(message) for _, message in faults]
    if all(is_concrete(pred) for pred in preds):
        for pred, code in zip(preds, codes):
            if bool(pred):
                raise eqx.EquinoxRuntimeError(_message(code))
        return Result.successful()
    # The first that holds: a chain of selects from the last fault back (scalars only; no
    # argmax or gather).
    code = jnp.zeros(jnp.shape(preds[0]), jnp.int32)
    for pred, value in reversed(list(zip(preds, codes))):
        code = jnp.where(pred, jnp.int32(value), code)
    return Result(code)


# ---------------------------------------------------------------------------------------------
# Public methods: who records


def reports(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Make a public method of a buffer report its faults as its buffer says.

    The outermost call decides, for every call it makes inside (of wrapped buffers, shards,
    clusters): with `throw=True` the faults raise as they always have; with `throw=False`
    they are recorded (`_faults.recording`) and come back as a `Result`, kept on the buffer
    the method returns (first fault wins over the buffer's own), or, from a method that
    returns no buffer (a read), beside its value: `(value, result)`. An eager call raises at
    once in both modes.
    """

    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        buffer = args[0]
        throw = getattr(buffer, "throw", True)
        out, faults = recording(lambda: method(*args, **kwargs), record=not throw)
        if faults is None:  # inside another public call, or `throw=True`
            return out
        return _handed_back(buffer, out, result_of(faults))  # pyright: ignore[reportReturnType]

    return call


def _handed_back(buffer: Any, out: Any, result: Result) -> Any:
    """`out` of a recording call of `buffer`, with `result` where the caller finds it."""
    if _holds_result(out):
        return out.with_result(buffer.result.first(result))
    if isinstance(out, tuple) and any(_holds_result(x) for x in out):
        return tuple(
            x.with_result(buffer.result.first(result)) if _holds_result(x) else x for x in out
        )
    return out, result


def _holds_result(x: Any) -> bool:
    return isinstance(x, eqx.Module) and isinstance(getattr(x, "result", None), Result)


def initial_result(throw: Any, call: str) -> Result | None:
    """A constructor's `result` field for its `throw` argument (checked: a Python bool)."""
    return None if check_bool(throw, call) else Result.successful()


def inherited_result(throw: Any, inner: Any, call: str) -> Result | None:
    """A layer's `result` field: as `throw` says, or, for `throw=None`, as the buffer it
    is made over reports (`inner`, a buffer or a template of its shards)."""
    if throw is None:
        throw = getattr(inner, "result", None) is None
    return initial_result(throw, call)


def check_result(result: Result | None, call: str) -> None:
    """For a host boundary (`save`, `Dataset.write`, the service): raise the fault held by
    a `throw=False` buffer's `result` (`None` for a `throw=True` buffer: nothing to do),
    naming the boundary that refused it."""
    if result is None:
        return
    if not is_concrete(result.code):
        return  # traced: the boundary itself refuses traced buffers where it must
    message = result.message
    if message is not None:
        raise eqx.EquinoxRuntimeError(
            f"`{call}`: refused: a `throw=False` buffer holds this fault of its calls:\n{message}"
        )


def check_results(tree: Any, call: str) -> None:
    """`check_result` of every `Result` in `tree` (a buffer, a layer over buffers)."""
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Result)):
        if isinstance(leaf, Result):
            check_result(leaf, call)
