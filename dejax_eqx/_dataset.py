"""On-disk datasets of per-env streams: zarr arrays written with tensorstore, and a manifest.

A dataset is a directory (its files: `_dataset_files.py`):

- `manifest.json`: what the dataset holds (format, item spec, per-env first step and length,
    priority metadata and segments, the digest of every array's metadata) and its own
    SHA-256 checksum, replaced atomically (temporary file, `fsync`, rename, directory
    `fsync`) as the last act of every write. It is the commit record: readers see exactly
    the steps it counts.
- `leaves/<i>/`: one zarr v3 array per leaf of a step, shape `(num_envs, 2**31 - 1,
    *leaf_shape)`, chunked `(1, chunk_length, *leaf_shape)`, each chunk with a CRC-32C.
    Chunks are only created when written, so the huge time axis costs nothing, and a write
    never resizes an array.
- `priorities/<n>/`: the priority segment of write `n`: the sum-tree masses of the windows
    the buffer held then. Written only from a `PrioritisedTrajectoryBuffer`.
- `writer.lock`: what a writer holds an OS lock on, so that one writes at a time.

Why this is crash safe: tensorstore's file store writes every chunk to a temporary file and
renames it into place, so a chunk is always either its old or its new version, and a chunk
that holds committed steps keeps them either way. New steps go past the committed end, new
masses into a new segment; the manifest moves the end and lists the segment only after every
chunk of a write is in place. A writer killed at any point leaves the dataset readable at its
previous commit, and the next write overwrites whatever the killed one left past it.
"""

import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Integer, PRNGKeyArray, PyTree

from ._abstract import AbstractTrajectoryBuffer, WindowPriorities
from ._checks import (
    as_prototype,
    check_bool,
    check_positive_int,
    check_sequences,
    INT32_MAX,
    Prototype,
)
from ._dataset_files import (
    commit,
    describe,
    Files,
    leaves_text,
    MANIFEST,
    Manifest,
    parse_manifest,
    TIME_AXIS,
    Writer,
)
from ._faults import is_concrete
from ._results import check_results
from ._sequences import draw_whole_windows, whole_windows
from ._streams import gather_steps, Streams
from ._windows import as_whole_window, mask_windows, SequenceSample, Window


_B = TypeVar("_B", bound=AbstractTrajectoryBuffer)
_Int = Integer[ArrayLike, ""]  # an env id or a step number: what `sample` returns too

# A hook for the crash-safety tests: called after a write's chunks are in place and before
# its manifest is committed. Never set outside tests.
_BEFORE_COMMIT: Any = None


def dataset_of(source: Any) -> "Dataset | None":
    """`source` if it is a `Dataset` (an open one), else `None`: for the callers that take a
    dataset or something else in its place (a path, a buffer)."""
    return source if isinstance(source, Dataset) else None


def _spec_of_like(like: Any, call: str) -> PyTree[jax.ShapeDtypeStruct]:
    if isinstance(like, AbstractTrajectoryBuffer):
        return like.item_spec
    return as_prototype(like, f"{call}(like=...)")


class Dataset:
    """An on-disk dataset of per-env streams of steps, appended to while training and read
    back in ranges, in random windows, or into a buffer.

    Each env's stream is a run of consecutive steps, numbered as a `TrajectoryBuffer`
    numbers them (its absolute step numbers), from `starts[e]` to `ends[e] - 1`. Writes
    append; nothing is ever rewritten or dropped.

    - `Dataset.create(path, prototype, num_envs)` makes an empty dataset;
        `Dataset.open(path, like)` opens one (`like`: the prototype, or a buffer).
    - `write(buffer)` appends, per env, exactly the steps a trajectory buffer (any
        `AbstractTrajectoryBuffer`) took since the previous write, and refuses, writing
        nothing, if some were overwritten before they could be written. From a buffer whose
        windows carry priorities (`window_priorities`) it also stores those and its
        `max_priority`; from a rate-limited buffer (`counts`) its counts.
    - `append(steps, env_ids=None)` appends steps given directly (`[n, T, ...]`).
    - `read(env, start, stop)` reads a range of one env's steps; `sample(key, batch_size,
        window)` draws random whole windows (a strict `Window`); neither loads the dataset.
    - `load(like)` returns a buffer holding each env's newest steps, its counters and (for a
        prioritised buffer) its priorities, to continue training.

    Every write ends by replacing the manifest atomically, so a writer killed midway leaves
    the dataset readable at its previous end. Everything read is checked (the manifest's
    checksum, each array's metadata digest, each chunk's CRC-32C); damage raises a
    `ValueError` naming the file. One writer at a time, held by an OS lock from its first
    write to `close()`; readers take no lock and see the steps committed when they opened it.
    """

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        raw: bytes,
        spec: PyTree[jax.ShapeDtypeStruct],
        sync: bool,
        call: str,
    ):
        self._path = path
        self._manifest = manifest
        self._spec = spec
        self._files = Files(path, manifest, sync, call)
        self._writer = Writer(path, raw, sync, manifest.format)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        prototype: Prototype,
        num_envs: int,
        *,
        chunk_length: int = 1024,
        sync: bool = True,
    ) -> "Dataset":
        """Make an empty dataset at `path`, a directory that must not exist yet.

        **Arguments:**

        - `prototype`: one step (as for `TrajectoryBuffer`), or a buffer whose steps to store.
        - `num_envs`: the number of streams, a positive int.
        - `chunk_length`: steps per chunk of each env's stream (default 1024): the unit of
            disk I/O. Reads and writes touch whole chunks.
        - `sync`: `fsync` every chunk and the manifest before a write returns (default
            `True`), so that a committed write survives a power loss too. `False` is several
            times faster; a killed process still leaves the dataset readable at its previous
            write, but a power loss may lose or tear recently committed steps.

        Every argument is checked before anything is made on disk; if making the dataset
        fails, what was made is removed.
        """
        call = "Dataset.create"
        spec = _spec_of_like(prototype, call)
        num_envs = check_positive_int(num_envs, f"{call}(num_envs=...)")
        chunk_length = check_positive_int(chunk_length, f"{call}(chunk_length=...)")
        sync = check_bool(sync, f"{call}(sync=...)")
        path = _as_path(path, call)
        if path.exists():
            raise FileExistsError(f"`{call}`: {str(path)!r} already exists.")
        manifest = Manifest(num_envs, chunk_length, describe(spec), [0] * num_envs, [0] * num_envs)
        path.mkdir(parents=True)
        try:
            manifest.digests = Files.create(path, manifest)
            raw = commit(path, manifest, sync)
            return cls(path, manifest, raw, spec, sync, call)
        except BaseException:
            _remove_new(path)
            raise

    @classmethod
    def open(cls, path: str | os.PathLike, like: Any, *, sync: bool = True) -> "Dataset":
        """Open the dataset at `path`. `like` is the prototype of a step, or a buffer: the
        dataset must hold steps of exactly its structure, shapes and dtypes. `sync` is as for
        `create`, for the writes made through this object.

        **Raises:** `FileNotFoundError`/`NotADirectoryError` if `path` is not a dataset,
        `ValueError` if its manifest or an array's metadata is damaged (naming the file) or
        its steps are not `like`'s.
        """
        call = "Dataset.open"
        spec = _spec_of_like(like, call)
        sync = check_bool(sync, f"{call}(sync=...)")
        path = _as_path(path, call)
        manifest, raw = _read_manifest(path, describe(spec), call)
        return cls(path, manifest, raw, spec, sync, call)

    def close(self) -> None:
        """Release the writer's lock, if this object holds it. The object still reads; a
        later write takes the lock again (and refuses if another writer committed since)."""
        self._writer.close()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def num_envs(self) -> int:
        return self._manifest.num_envs

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return self._spec

    @property
    def starts(self) -> np.ndarray:
        """Per env, the absolute step number of its first stored step (int64)."""
        return np.asarray(self._manifest.start, np.int64)

    @property
    def lengths(self) -> np.ndarray:
        """Per env, the number of stored steps (int64)."""
        return np.asarray(self._manifest.length, np.int64)

    @property
    def ends(self) -> np.ndarray:
        """Per env, one past the absolute step number of its last stored step (int64): the
        `step_count` of the buffer at the last write."""
        return self.starts + self.lengths

    @property
    def max_priority(self) -> float | None:
        """The `max_priority` of the prioritised buffer last written, or `None`."""
        p = self._manifest.priorities
        return None if p is None else p["max_priority"]

    def __repr__(self) -> str:
        steps = int(self.lengths.sum())
        return f"Dataset({str(self._path)!r}, num_envs={self.num_envs}, steps={steps})"

    def append(self, steps: PyTree, env_ids: Any = None) -> None:
        """Append `T` steps to each listed env: leaves `[n, T, ...]`, oldest first, as for
        `TrajectoryBuffer.extend`; `env_ids` distinct ids in `[0, num_envs)`, `None` for
        every env in order. Call it on the host, outside `jit`.

        **Raises:** `ValueError`/`TypeError` for steps that do not match the dataset
        (structure, shape, dtype: nothing is cast), traced steps, bad env ids, or an env
        that would pass `2**31 - 1` steps; `RuntimeError` if another writer holds the
        dataset or committed since this object read it. Nothing is written then.
        """
        call = "Dataset.append"
        # Checked only: the steps go from where they are to disk, not through a device.
        items, n, length = check_sequences(self._spec, steps, call, convert=False)
        _check_host(items, call, "the steps")
        rows = _env_ids(env_ids, n, self.num_envs, call)
        if length == 0 or n == 0:
            return
        host = [np.asarray(x) for x in jax.tree.leaves(items)]
        new = np.zeros(self.num_envs, np.int64)
        new[rows] = length
        _check_count(self.ends, new, call)
        self._writer.begin(call)
        per_env = {int(e): [x[i] for x in host] for i, e in enumerate(rows)}
        self._files.write(self.lengths, per_env, call)
        self._commit(self._manifest, new, call)

    def write(self, buffer: AbstractTrajectoryBuffer) -> int:
        """Append the steps each env of `buffer` took since the previous write; return how
        many were written. Call it on the host, between jitted steps.

        The first write of a dataset starts each env at the oldest step the buffer still
        holds. From a buffer whose windows carry priorities (a `PrioritisedTrajectoryBuffer`,
        or a layer over one), every write also stores the priority of each window the buffer
        holds (as of now, in a new segment: what was committed before is never rewritten)
        and its `max_priority`. From a rate-limited buffer (`dx.RateLimited`), it records the
        `counts()`; a write from a buffer without a limiter records none (`append` keeps what
        was recorded).

        **Raises:** `ValueError`, writing nothing, if:

        - `buffer`'s steps do not match the dataset's, or it has another number of envs;
        - an env has fewer steps than the dataset holds for it (not the buffer this dataset
            follows);
        - an env took more steps since the previous write than the buffer still holds: the
            older ones were overwritten before they could be written. Write at least every
            `max_length` steps of each env;
        - the prioritised metadata (priority exponent, period, window) differs from that of
            the buffer written before.

        `TypeError` for a traced or abstract buffer, and `RuntimeError` as for `append`.
        """
        call = "Dataset.write"
        check_results(buffer, call)  # a `throw=False` buffer's fault is refused
        t, manifest, priorities, new, start = _planned(self._manifest, buffer, call)
        self._writer.begin(call)
        steps = _newest(t, new)
        per_env = {int(e): [x[e, : new[e]] for x in steps] for e in np.flatnonzero(new)}
        self._files.write(self.lengths, per_env, call)
        if priorities is not None:
            period = manifest.priorities["period"]  # pyright: ignore[reportOptionalSubscript]
            manifest = _with_segment(self._files, manifest, priorities, period, start, call)
        self._commit(manifest, new, call)
        return int(new.sum())

    def check_write(self, buffer: AbstractTrajectoryBuffer) -> int:
        """What `write(buffer)` would check, and nothing written: the number of steps it would
        write, or the error it would raise (see `write`). For a writer of several datasets
        that must refuse before it writes any (`GlobalTrajectoryBuffer.write_datasets`)."""
        return int(_planned(self._manifest, buffer, "Dataset.write")[3].sum())

    def _commit(self, manifest: Manifest, new: np.ndarray, call: str) -> None:
        """Commit `manifest` with each env's `new` steps and one more write counted."""
        manifest = dataclasses.replace(
            manifest, length=(self.lengths + new).tolist(), writes=manifest.writes + 1
        )
        if _BEFORE_COMMIT is not None:
            _BEFORE_COMMIT(self)
        self._writer.commit(manifest, call)
        self._manifest = manifest

    def read(self, env: _Int, start: _Int, stop: _Int) -> PyTree[np.ndarray]:
        """The steps `start .. stop - 1` (absolute step numbers) of env `env`, as NumPy arrays
        with a leading axis of `stop - start`. The bounds are ints (Python, NumPy or JAX
        integer scalars, such as a `sample`'s `start`).

        **Raises:** `TypeError` for a bound that is not an int, `ValueError` if the range is
        not within the env's stored steps or a chunk it reads is damaged.
        """
        call = "Dataset.read"
        env, start, stop, first = _range(self._manifest, env, start, stop, call)
        out = self._files.read(env, start - first, stop - first, call)
        return jax.tree.unflatten(jax.tree.structure(self._spec), out)

    def sample(
        self, key: PRNGKeyArray, batch_size: int, window: Window | int, **options: Any
    ) -> SequenceSample:
        """Draw `batch_size` whole windows uniformly, with replacement, over every env and
        every start that `window` (a strict `Window`) admits: on a multiple of its period
        (absolute step numbers), with all `W = burn_in + sequence_length + bootstrap` steps
        stored. As `TrajectoryBuffer.sample` with the same window, on the dataset; only the
        drawn windows are read.

        **Returns:** a `SequenceSample` `(items, mask, learn, env, start)` of JAX arrays.

        **Raises:** `ValueError`/`TypeError` for a bad window (not strict, or `done` naming no
        boolean leaf of the steps), and `ValueError` if no env holds a whole window yet.
        """
        call = "Dataset.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        window = _whole_window(window, options, self._spec, call)
        first, number = whole_windows(self.starts, self.ends, window.size, window.period)
        if number.sum() == 0:
            raise ValueError(
                f"`{call}`: no env holds a whole window of {window.size} steps starting on a "
                f"multiple of period = {window.period} yet."
            )
        env, start = draw_whole_windows(key, first, number, window.period, batch_size)
        offsets = (start - self.starts[env])[:, None] + np.arange(window.size)[None, :]
        rows = np.broadcast_to(env[:, None], offsets.shape)
        out = [jnp.asarray(x) for x in self._files.read_points(rows, offsets, call)]
        items = jax.tree.unflatten(jax.tree.structure(self._spec), out)
        full = jnp.full(batch_size, window.size, jnp.int32)
        return mask_windows(
            items, full, window, jnp.asarray(env, jnp.int32), jnp.asarray(start, jnp.int32)
        )

    def priorities(self, env: _Int, start: _Int, stop: _Int) -> np.ndarray:
        """The stored sum-tree masses (`priority ** priority_exponent`) of the windows that
        start at steps `start .. stop - 1` of env `env`, each as of the last write whose
        buffer held it: float32, NaN where no window starts or none was written from a
        prioritised buffer."""
        call = "Dataset.priorities"
        env, start, stop, _ = _range(self._manifest, env, start, stop, call)
        return self._files.masses(self._manifest, env, np.arange(start, stop), call)

    def load(self, like: _B) -> _B:
        """A buffer of `like`'s type and configuration holding each env's newest steps (up to
        its `max_length`), with its step counts, to continue training (`like.with_streams`:
        an empty online queue, nothing unread).

        For a buffer whose windows carry priorities, each stored window gets the priority the
        dataset holds for it, and the buffer its `max_priority`; windows with none (steps
        written with `append`, or from a plain buffer) get `max_priority`, as new windows do.

        For a rate-limited `like` (`dx.RateLimited`), its limiter comes back with the counts
        the last write recorded. `like` may come from `eqx.filter_eval_shape`.

        **Raises:** `ValueError` if `like`'s steps or number of envs differ from the
        dataset's, or its priority exponent, period or window from those the priorities
        were written with, or a chunk it reads is damaged; for a rate-limited `like`, if the
        last write recorded no counts (load `like.buffer` and wrap it yourself).
        """
        call = "Dataset.load"
        template = _template(self._manifest, like, call)  # before any reading
        ends, kept = self.ends, np.minimum(self.lengths, template.max_length)
        data = _newest_stored(self._files, self._manifest, kept, template.max_length, call)
        steps = jax.tree.unflatten(jax.tree.structure(self._spec), data)
        buffer = like.with_streams(template.restore(steps, ends, kept))
        return _restored(self._files, self._manifest, buffer, call)


def _planned(manifest: Manifest, buffer: AbstractTrajectoryBuffer, call: str) -> tuple:
    """`write`'s checks of `buffer` against the dataset of `manifest`, before any I/O: the
    streams, the manifest to commit (but for its lengths), the window priorities, the new
    steps of each env, and each env's start."""
    t = _streams_of(buffer, manifest, call, "the buffer")
    _check_host(t, call, "the buffer's leaves")
    count = np.asarray(t.step_count, np.int64)
    stored = np.asarray(t.lengths, np.int64)
    lengths = np.asarray(manifest.length, np.int64)
    ends = np.asarray(manifest.start, np.int64) + lengths
    planned = manifest
    if planned.writes == 0 and not lengths.any():
        planned = dataclasses.replace(planned, start=(count - stored).tolist())
    start = np.asarray(planned.start, np.int64)
    new = _new_steps(count, stored, start + lengths, t.max_length, call)
    planned, priorities = _with_settings(planned, buffer, call)
    _check_count(ends, new, call)
    return t, planned, priorities, new, start


def _newest_stored(
    files: Files, manifest: Manifest, kept: np.ndarray, max_length: int, call: str
) -> list[np.ndarray]:
    """Per leaf, `[num_envs, max_length]` on the host: the first `kept[e]` entries of row `e`
    are env e's newest `kept[e]` stored steps, oldest first (zeros past them)."""
    lengths = np.asarray(manifest.length, np.int64)
    data = [
        np.zeros((manifest.num_envs, max_length, *leaf["shape"]), leaf["dtype"])
        for leaf in manifest.leaves
    ]
    for e in np.flatnonzero(kept):
        lo = int(lengths[e] - kept[e])
        values = files.read(int(e), lo, int(lengths[e]), call)
        for out, x in zip(data, values):
            out[e, : kept[e]] = x
    return data


def _range(
    manifest: Manifest, env: Any, start: Any, stop: Any, call: str
) -> tuple[int, int, int, int]:
    """The checked env and bounds of a range of steps, and the env's first stored step."""
    env = _as_int(env, call, "env")
    if not 0 <= env < manifest.num_envs:
        raise ValueError(
            f"`{call}`: env {env} is out of range; 0 <= env < num_envs = {manifest.num_envs}."
        )
    start, stop = _as_int(start, call, "start"), _as_int(stop, call, "stop")
    first, end = manifest.start[env], manifest.start[env] + manifest.length[env]
    if not (first <= start <= stop <= end):
        raise ValueError(
            f"`{call}`: steps {start} .. {stop - 1} of env {env} are not all stored; it "
            f"holds steps {first} .. {end - 1} ({end - first} steps)."
        )
    return env, start, stop, first


def _as_path(path: Any, call: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"`{call}(path=...)` must be a str or os.PathLike, got {path!r}.")
    return Path(path)


def _remove_new(path: Path) -> None:
    """Remove the dataset `create` was making at `path` (its directory, which it made)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _as_int(value: Any, call: str, name: str) -> int:
    """A step number or env id given as a Python, NumPy or JAX integer scalar (what `sample`
    returns), as an int; never a bool, a float or a traced value."""
    if isinstance(value, jax.Array | np.ndarray | np.generic) and is_concrete(value):
        if value.shape == () and np.issubdtype(value.dtype, np.integer):
            return int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(
        f"`{call}({name}=...)` must be an int (a Python int, or a NumPy or JAX integer "
        f"scalar), got {value!r}."
    )


def _check_host(tree: PyTree, call: str, what: str) -> None:
    """Refuse traced or abstract values: a dataset is written on the host, outside `jit`."""
    for x in jax.tree.leaves(tree):
        if not is_concrete(x):
            raise TypeError(
                f"`{call}`: {what} are traced: a dataset is written on the host, outside "
                "`jit`; call it between jitted steps."
            )
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            raise TypeError(
                f"`{call}`: {what} include a {type(x).__name__}, not an array: an abstract "
                "buffer (from `eqx.filter_eval_shape`) has no steps to write."
            )


def _streams_of(buffer: Any, manifest: Manifest, call: str, what: str) -> Streams:
    """The per-env streams of `buffer`, checked against the dataset's."""
    if not isinstance(buffer, AbstractTrajectoryBuffer):
        raise TypeError(
            f"`{call}`: {what} must be a trajectory buffer (an AbstractTrajectoryBuffer: "
            f"TrajectoryBuffer, PrioritisedTrajectoryBuffer, TrajectoryQueue), got "
            f"{type(buffer).__name__}."
        )
    t = buffer.streams
    if t.num_envs != manifest.num_envs:
        raise ValueError(
            f"`{call}`: the buffer has {t.num_envs} envs, the dataset {manifest.num_envs}."
        )
    found = describe(t.item_spec)
    if found != manifest.leaves:
        raise ValueError(
            f"`{call}`: the buffer's steps are {leaves_text(found)}, the dataset's "
            f"{leaves_text(manifest.leaves)}."
        )
    return t


def _env_ids(env_ids: Any, n: int, num_envs: int, call: str) -> np.ndarray:
    """`append`'s env ids, checked: distinct ids in `[0, num_envs)`, one per entry."""
    if env_ids is None:
        if n != num_envs:
            raise ValueError(
                f"`{call}`: without `env_ids` there must be steps for every env, but the "
                f"batch has {n} entries and num_envs is {num_envs}."
            )
        return np.arange(n)
    ids = np.asarray(env_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(
            f"`{call}(env_ids=...)` must be a 1-D integer array, got shape {ids.shape} and "
            f"dtype {ids.dtype}."
        )
    if ids.shape[0] != n:
        raise ValueError(f"`{call}`: {ids.shape[0]} env ids for a batch of {n} envs' steps.")
    if ((ids < 0) | (ids >= num_envs)).any():
        raise ValueError(
            f"`{call}`: an env id is out of range; env ids must satisfy 0 <= env_id < "
            f"num_envs = {num_envs}."
        )
    if np.unique(ids).size != ids.size:
        raise ValueError(f"`{call}`: an env id occurs more than once.")
    return ids.astype(np.int64)


def _check_count(ends: np.ndarray, new: np.ndarray, call: str) -> None:
    over = np.flatnonzero(ends + new > INT32_MAX)
    if over.size:
        raise ValueError(
            f"`{call}`: env {int(over[0])} would pass 2**31 - 1 steps, the most a dataset (and a "
            "buffer's int32 step count) numbers."
        )


def _new_steps(
    count: np.ndarray, stored: np.ndarray, end: np.ndarray, max_length: int, call: str
) -> np.ndarray:
    """Per env, the steps a buffer that has taken `count` and stores `stored` took since the
    dataset's `end`, refused if the buffer is behind or has overwritten some of them."""
    new = count - end
    behind = np.flatnonzero(new < 0)
    if behind.size:
        e = int(behind[0])
        raise ValueError(
            f"`{call}`: env {e} of the buffer has taken {count[e]} steps, fewer than the "
            f"{end[e]} the dataset already holds up to: it is not the buffer this dataset "
            "follows (or it was reset)."
        )
    lost = np.flatnonzero(new > stored)
    if lost.size:
        e = int(lost[0])
        raise ValueError(
            f"`{call}`: env {e} took {new[e]} steps since the previous write, but the buffer "
            f"holds only its last {stored[e]} (max_length = {max_length}): "
            f"{new[e] - stored[e]} steps were overwritten before they could be written. Nothing "
            f"was written. Write at least every {max_length} steps of each env ({lost.size} "
            "env(s) lost steps)."
        )
    return new


def _check_priorities(manifest: Manifest, settings: dict | None, call: str, whose: str) -> None:
    """Refuse a buffer whose priority exponent, period or window differ from those of the
    buffer the dataset's priorities were written from."""
    old = manifest.priorities
    for key, value in (settings or {}).items():
        if old is not None and old[key] != value:
            raise ValueError(
                f"`{call}`: {whose} {key} is {value}, but the dataset's priorities were "
                f"written with {old[key]}."
            )


def _whole_window(window: Any, options: dict[str, Any], spec: PyTree, call: str) -> Window:
    """`sample`'s window: strict, its `done` leaves among the steps'."""
    window = as_whole_window(window, options, call, "a dataset is sampled in whole windows")
    window.check(spec, TIME_AXIS, call)
    window.refuse_episode_starts(call)
    return window


def _held_windows(
    priorities: WindowPriorities, floor: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per env `e` with any, `(e, starts, masses, leaves)`: the windows held whole that start
    at or after `floor[e]`, their masses and their leaves in the env's row, on the host."""
    held = jax.tree.map(np.asarray, priorities)
    out = []
    for e in range(held.held.shape[0]):
        (leaves,) = np.nonzero(held.held[e] & (held.start[e] >= floor[e]))
        if leaves.size:
            out.append((e, held.start[e, leaves].astype(np.int64), held.mass[e, leaves], leaves))
    return out


def _newest(t: Streams, new: np.ndarray) -> list[np.ndarray]:
    """Per leaf, `[num_envs, max(new)]` on the host: the first `new[e]` entries of row `e` are
    env e's newest `new[e]` steps, oldest first, gathered on the device."""
    width = int(new.max(initial=0))
    if width == 0:
        return [np.zeros((t.num_envs, 0, *s.shape), s.dtype) for s in jax.tree.leaves(t.item_spec)]
    env = jnp.arange(t.num_envs, dtype=jnp.int32)
    gathered = _gather(t, env, jnp.asarray(new, jnp.int32), width)
    return [np.asarray(x) for x in jax.tree.leaves(gathered)]


# One compiled gather per width (the rows past an env's new steps are read and not used).
_gather = jax.jit(gather_steps, static_argnums=3)


def _read_manifest(path: Path, expected: list[dict], call: str) -> tuple[Manifest, bytes]:
    """The checked manifest of the dataset at `path`, which must hold steps `expected`, and
    its bytes."""
    file = path / MANIFEST
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"`{call}`: {str(path)!r} is a file, not a dataset directory.")
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"`{call}`: {str(path)!r} is not a dataset (no {MANIFEST}).")
    manifest = parse_manifest(raw, file, call)
    if manifest.leaves != expected:
        raise ValueError(
            f"`{call}`: {str(path)!r} holds steps {leaves_text(manifest.leaves)}, but "
            f"`like` describes {leaves_text(expected)}."
        )
    return manifest, raw


def _with_segment(
    files: Files,
    manifest: Manifest,
    priorities: WindowPriorities,
    period: int,
    start: Any,
    call: str,
) -> Manifest:
    """`manifest` listing a new segment with the masses of every window held (whose first
    step is at or after the env's `start`)."""
    held = _held_windows(priorities, start)
    if not held:
        return manifest
    name = f"priorities/{manifest.writes}"
    first, count = [0] * manifest.num_envs, [0] * manifest.num_envs
    masses = {}
    for e, starts, mass, _ in held:
        order = np.argsort(starts)  # leaf order wraps around; a segment is in start order
        # The windows a buffer holds are every `period` steps over its stored steps.
        assert (np.diff(starts[order]) == period).all()
        first[e], count[e] = int(starts[order[0]]), int(starts.size)
        masses[e] = mass[order].astype(np.float32)
    digest = files.write_segment(name, masses, manifest.num_envs, call)
    segment = {"name": name, "first": first, "count": count}
    segments, digests = [*manifest.segments, segment], manifest.digests | {name: digest}
    return dataclasses.replace(manifest, segments=segments, digests=digests)


def _load_priorities(files: Files, manifest: Manifest, buffer: Any, call: str) -> Any:
    """`buffer` (fresh from `with_streams`) with the stored masses of its windows and the
    stored `max_priority`."""
    meta = manifest.priorities
    priorities = buffer.window_priorities()
    top = 1.0 if meta is None else meta["max_priority"]
    # Windows without a stored mass get the largest priority's, as new windows do (NaN).
    masses = np.full(priorities.mass.shape, np.nan, np.float32)
    for e, starts, _, leaves in _held_windows(priorities, np.asarray(manifest.start, np.int64)):
        masses[e, leaves] = files.masses(manifest, e, starts, call)
    return buffer.with_window_priorities(masses, max_priority=np.float32(top))


# ---------------------------------------------------------------------------------------------
# What a write records besides steps, and a load restores: a buffer's priorities and counts,
# asked of the buffer (`AbstractTrajectoryBuffer.window_priorities`, `counts`), whatever it is.


def _with_settings(
    manifest: Manifest, buffer: AbstractTrajectoryBuffer, call: str
) -> tuple[Manifest, WindowPriorities | None]:
    """`manifest` with what a write records besides steps (a buffer's priority settings,
    checked against those written before, and its counts, or none), and the buffer's window
    priorities (`None` for a buffer without)."""
    counts = buffer.counts()
    limiter = None if counts is None else {"inserts": counts[0], "samples": counts[1]}
    manifest = dataclasses.replace(manifest, limiter=limiter)
    settings = buffer.priority_settings()
    if settings is None:
        return manifest, None
    _check_priorities(manifest, settings, call, "the buffer's")
    priorities = buffer.window_priorities()
    assert priorities is not None
    settings = settings | {"max_priority": float(priorities.max_priority)}
    return dataclasses.replace(manifest, priorities=settings), priorities


def _template(manifest: Manifest, like: Any, call: str) -> Streams:
    """`load`'s `like`, checked before anything is read: its streams."""
    template = _streams_of(like, manifest, call, "`like`")
    _check_priorities(manifest, like.priority_settings(), call, "`like`'s")
    return template


def _restored(files: Files, manifest: Manifest, buffer: Any, call: str) -> Any:
    """The loaded `buffer` with its stored priorities and counts."""
    if buffer.priority_settings() is not None:
        buffer = _load_priorities(files, manifest, buffer, call)
    counts = manifest.limiter
    return buffer.with_counts(None if counts is None else (counts["inserts"], counts["samples"]))
