"""On-disk datasets of per-env streams: zarr arrays written with tensorstore, and a manifest.

A dataset is a directory:

- `manifest.json`: what the dataset holds (format, item spec, per-env first step and length,
    priority metadata), replaced atomically (temporary file, `fsync`, rename, directory
    `fsync`) as the last act of every write. It is the commit record: readers see exactly the
    steps it counts.
- `leaves/<i>/`: one zarr v3 array per leaf of a step, shape `(num_envs, 2**31 - 1,
    *leaf_shape)`, chunked `(1, chunk_length, *leaf_shape)`. Chunks are only created when
    written, so the huge time axis costs nothing, and a write never resizes an array.
- `priority/`: a float32 zarr array `(num_envs, 2**31 - 1)`: at a window's first step, the
    sum-tree mass of that window (`priority ** priority_exponent`) as of the last write; NaN
    elsewhere. Written only from a `PrioritisedTrajectoryBuffer`.

Why this is crash safe: tensorstore's file store writes every chunk to a temporary file and
renames it into place, so a chunk is always either its old or its new version, and a chunk
that holds committed steps keeps them either way. New steps go past the committed end; the
manifest moves the end only after every chunk of a write is in place. A writer killed at any
point leaves the dataset readable at its previous end, and the next write overwrites whatever
the killed one left past it.
"""

import dataclasses
import importlib.metadata
import json
import math
import os
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import PRNGKeyArray, PyTree

from ._abstract import AbstractTrajectoryBuffer
from ._checks import (
    as_prototype,
    check_positive_int,
    check_sequences,
    INT32_MAX,
    Prototype,
)
from ._io import replace_atomically
from ._prioritised_trajectory import PrioritisedTrajectoryBuffer
from ._sequences import draw_whole_windows, whole_windows
from ._streams import gather_steps, Streams
from ._windows import as_whole_window, mask_windows, SequenceSample, Window


_FORMAT = 1
_MANIFEST = "manifest.json"
_TIME_AXIS = INT32_MAX  # as many steps as an env's int32 step count can number
_B = TypeVar("_B", bound=AbstractTrajectoryBuffer)

# A hook for the crash-safety tests: called after a write's chunks are in place and before
# its manifest is committed. Never set outside tests.
_BEFORE_COMMIT: Any = None


def _tensorstore():
    try:
        import tensorstore
    except ImportError as error:  # pragma: no cover - the tests install it
        raise ImportError(
            "`dejax_eqx.Dataset` needs tensorstore: pip install tensorstore (or the "
            "`datasets` extra of dejax_eqx)."
        ) from error
    return tensorstore


def _spec_of_like(like: Any, call: str) -> PyTree[jax.ShapeDtypeStruct]:
    if isinstance(like, AbstractTrajectoryBuffer):
        return like.item_spec
    return as_prototype(like, f"{call}(like=...)")


def _describe(spec: PyTree[jax.ShapeDtypeStruct]) -> list[dict]:
    return [
        {"path": keystr(path), "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
        for path, leaf in tree_flatten_with_path(spec)[0]
    ]


@dataclasses.dataclass
class _Manifest:
    num_envs: int
    chunk_length: int
    leaves: list[dict]
    start: list[int]  # per env: the absolute step number of its first stored step
    length: list[int]  # per env: the number of stored steps
    writes: int = 0
    # From a PrioritisedTrajectoryBuffer: {"priority_exponent", "period", "window",
    # "max_priority"}; None until one is written.
    priorities: dict | None = None

    def to_json(self) -> dict:
        out = {"format": _FORMAT, "library": importlib.metadata.version("dejax_eqx")}
        return out | dataclasses.asdict(self)


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
        nothing, if some were overwritten before they could be written. From a
        `PrioritisedTrajectoryBuffer` it also stores the priorities of its windows and its
        `max_priority`.
    - `append(steps, env_ids=None)` appends steps given directly (`[n, T, ...]`).
    - `read(env, start, stop)` reads a range of one env's steps; `sample(key, batch_size,
        window)` draws random whole windows (a strict `Window`); neither loads the dataset.
    - `load(like)` returns a buffer holding each env's newest steps, its counters and (for a
        prioritised buffer) its priorities, to continue training.

    Every write ends by replacing the manifest atomically, so a writer killed midway leaves
    the dataset readable at its previous end. One writer at a time; readers may open the
    dataset while it is written (they see the steps committed when they opened it).
    """

    def __init__(
        self, path: Path, manifest: _Manifest, spec: PyTree[jax.ShapeDtypeStruct], sync: bool
    ):
        self._path = path
        self._manifest = manifest
        self._spec = spec
        self._sync = sync
        ts = _tensorstore()
        context = ts.Context({"file_io_sync": sync})
        specs = _array_specs(path, manifest)
        self._leaves = [ts.open(x, open=True, context=context).result() for x in specs[:-1]]
        self._priority = ts.open(specs[-1], open=True, context=context).result()

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
        """
        call = "Dataset.create"
        spec = _spec_of_like(prototype, call)
        num_envs = check_positive_int(num_envs, f"{call}(num_envs=...)")
        chunk_length = check_positive_int(chunk_length, f"{call}(chunk_length=...)")
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"`{call}`: {str(path)!r} already exists.")
        manifest = _Manifest(
            num_envs=num_envs,
            chunk_length=chunk_length,
            leaves=_describe(spec),
            start=[0] * num_envs,
            length=[0] * num_envs,
        )
        path.mkdir(parents=True)
        ts = _tensorstore()
        for spec_ in _array_specs(path, manifest):
            ts.open(spec_, create=True).result()
        _commit(path, manifest, sync)
        return cls(path, manifest, spec, sync)

    @classmethod
    def open(cls, path: str | os.PathLike, like: Any, *, sync: bool = True) -> "Dataset":
        """Open the dataset at `path`. `like` is the prototype of a step, or a buffer: the
        dataset must hold steps of exactly its structure, shapes and dtypes. `sync` is as for
        `create`, for the writes made through this object."""
        call = "Dataset.open"
        spec = _spec_of_like(like, call)
        path = Path(path)
        manifest = _read_manifest(path, call)
        expected = _describe(spec)
        if manifest.leaves != expected:
            raise ValueError(
                f"`{call}`: {str(path)!r} holds steps {_leaves_text(manifest.leaves)}, but "
                f"`like` describes {_leaves_text(expected)}."
            )
        return cls(path, manifest, spec, sync)

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
        every env in order.

        **Raises:** `ValueError`/`TypeError` for steps that do not match the dataset
        (structure, shape, dtype: nothing is cast), bad env ids, or an env that would pass
        `2**31 - 1` steps. Nothing is written then.
        """
        call = "Dataset.append"
        # Checked only: the steps go from where they are to disk, not through a device.
        items, n, length = check_sequences(self._spec, steps, call, convert=False)
        rows = _env_ids(env_ids, n, self.num_envs, call)
        if length == 0 or n == 0:
            return
        host = [np.asarray(x) for x in jax.tree.leaves(items)]
        new = np.zeros(self.num_envs, np.int64)
        new[rows] = length
        _check_count(self.ends, new, call)
        _write_steps(
            self._leaves, self.lengths, {int(e): [x[i] for x in host] for i, e in enumerate(rows)}
        )
        manifest = dataclasses.replace(
            self._manifest, length=(self.lengths + new).tolist(), writes=self._manifest.writes + 1
        )
        self._commit(manifest)

    def write(self, buffer: AbstractTrajectoryBuffer) -> int:
        """Append the steps each env of `buffer` took since the previous write; return how
        many were written.

        The first write of a dataset starts each env at the oldest step the buffer still
        holds. From a `PrioritisedTrajectoryBuffer`, every write also stores the priority of
        each window the buffer holds (as of now) and its `max_priority`.

        **Raises:** `ValueError`, writing nothing, if:

        - `buffer`'s steps do not match the dataset's, or it has another number of envs;
        - an env has fewer steps than the dataset holds for it (not the buffer this dataset
            follows);
        - an env took more steps since the previous write than the buffer still holds: the
            older ones were overwritten before they could be written. Write at least every
            `max_length` steps of each env;
        - the prioritised metadata (priority exponent, period, window) differs from that of
            the buffer written before.
        """
        call = "Dataset.write"
        t = _streams_of(buffer, self._manifest, call, "the buffer")
        count = np.asarray(t.step_count, np.int64)
        stored = np.asarray(t.lengths, np.int64)
        manifest = self._manifest
        if manifest.writes == 0 and not self.lengths.any():
            manifest = dataclasses.replace(manifest, start=(count - stored).tolist())
        end = np.asarray(manifest.start, np.int64) + self.lengths
        new = _new_steps(count, stored, end, t.max_length, call)
        priorities = manifest.priorities
        if isinstance(buffer, PrioritisedTrajectoryBuffer):
            _check_priorities(manifest, buffer, call, "the buffer's")
            priorities = _priority_settings(buffer) | {"max_priority": float(buffer.max_priority)}
        _check_count(self.ends, new, call)
        steps = _newest(t, new)
        per_env = {int(e): [x[e, : new[e]] for x in steps] for e in np.flatnonzero(new)}
        _write_steps(self._leaves, self.lengths, per_env)
        if isinstance(buffer, PrioritisedTrajectoryBuffer):
            _write_masses(self._priority, buffer, np.asarray(manifest.start, np.int64))
        manifest = dataclasses.replace(
            manifest,
            length=(self.lengths + new).tolist(),
            writes=manifest.writes + 1,
            priorities=priorities,
        )
        self._commit(manifest)
        return int(new.sum())

    def _commit(self, manifest: _Manifest) -> None:
        if _BEFORE_COMMIT is not None:
            _BEFORE_COMMIT(self)
        _commit(self._path, manifest, self._sync)
        self._manifest = manifest

    def read(self, env: int, start: int, stop: int) -> PyTree[np.ndarray]:
        """The steps `start .. stop - 1` (absolute step numbers) of env `env`, as NumPy arrays
        with a leading axis of `stop - start`.

        **Raises:** `ValueError` if the range is not within the env's stored steps.
        """
        env, first = self._range(env, start, stop, "Dataset.read")
        out = [a[env, start - first : stop - first].read().result() for a in self._leaves]
        return jax.tree.unflatten(jax.tree.structure(self._spec), out)

    def _range(self, env: Any, start: int, stop: int, call: str) -> tuple[int, int]:
        """The checked env and its first stored step, for steps `start .. stop - 1`."""
        env = _env_index(env, self.num_envs, call)
        first, end = int(self.starts[env]), int(self.ends[env])
        if not (first <= start <= stop <= end):
            raise ValueError(
                f"`{call}`: steps {start} .. {stop - 1} of env {env} are not all stored; it "
                f"holds steps {first} .. {end - 1} ({end - first} steps)."
            )
        return env, first

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
        out = [jnp.asarray(a.vindex[rows, offsets].read().result()) for a in self._leaves]
        items = jax.tree.unflatten(jax.tree.structure(self._spec), out)
        full = jnp.full(batch_size, window.size, jnp.int32)
        return mask_windows(
            items, full, window, jnp.asarray(env, jnp.int32), jnp.asarray(start, jnp.int32)
        )

    def priorities(self, env: int, start: int, stop: int) -> np.ndarray:
        """The stored sum-tree masses (`priority ** priority_exponent`) of the windows that
        start at steps `start .. stop - 1` of env `env`: float32, NaN where no window starts
        or none was written from a prioritised buffer."""
        env, first = self._range(env, start, stop, "Dataset.priorities")
        return self._priority[env, start - first : stop - first].read().result()

    def load(self, like: _B) -> _B:
        """A buffer of `like`'s type and configuration holding each env's newest steps (up to
        its `max_length`), with its step counts, to continue training (`like.with_streams`:
        an empty online queue, nothing unread).

        For a `PrioritisedTrajectoryBuffer`, each stored window gets the priority the dataset
        holds for it, and the buffer its `max_priority`; windows with none (steps written
        with `append`, or from a plain buffer) get `max_priority`, as new windows do.

        `like` may come from `eqx.filter_eval_shape`.

        **Raises:** `ValueError` if `like`'s steps or number of envs differ from the
        dataset's, or its priority exponent, period or window from those the priorities
        were written with.
        """
        call = "Dataset.load"
        template = _streams_of(like, self._manifest, call, "`like`")
        if isinstance(like, PrioritisedTrajectoryBuffer):  # before any reading
            _check_priorities(self._manifest, like, call, "`like`'s")
        ends, kept = self.ends, np.minimum(self.lengths, template.max_length)
        data = [
            np.zeros((self.num_envs, template.max_length, *leaf["shape"]), leaf["dtype"])
            for leaf in self._manifest.leaves
        ]
        for e in np.flatnonzero(kept):
            values = self.read(int(e), int(ends[e] - kept[e]), int(ends[e]))
            for out, x in zip(data, jax.tree.leaves(values)):
                out[e, : kept[e]] = x
        steps = jax.tree.unflatten(jax.tree.structure(self._spec), data)
        buffer = like.with_streams(template.restore(steps, ends, kept))
        if isinstance(buffer, PrioritisedTrajectoryBuffer):
            buffer = self._load_priorities(buffer)
        return buffer  # type: ignore[return-value]

    def _load_priorities(self, buffer: PrioritisedTrajectoryBuffer) -> PrioritisedTrajectoryBuffer:
        """`buffer` (fresh from `with_streams`) with the stored masses of its windows."""
        meta = self._manifest.priorities
        top = jnp.asarray(1.0 if meta is None else meta["max_priority"], buffer.max_priority.dtype)
        # Windows without a stored mass get the largest priority's, as new windows do.
        shape = (buffer.num_envs, buffer.leaves_per_env)
        masses = np.array(jnp.broadcast_to(buffer.priorities.mass(top), shape))
        for e, starts, _, leaves in _held_windows(buffer, self.starts):
            stored = self._priority[e].vindex[starts - self.starts[e]].read().result()
            masses[e, leaves] = np.where(np.isnan(stored), masses[e, leaves], stored)
        return buffer.with_window_masses(masses, max_priority=top)


def _streams_of(buffer: Any, manifest: _Manifest, call: str, what: str) -> Streams:
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
    found = _describe(t.item_spec)
    if found != manifest.leaves:
        raise ValueError(
            f"`{call}`: the buffer's steps are {_leaves_text(found)}, the dataset's "
            f"{_leaves_text(manifest.leaves)}."
        )
    return t


def _write_steps(arrays: list, lengths: np.ndarray, per_env: dict[int, list[np.ndarray]]) -> None:
    """Write each env's new steps past its committed end (`lengths`), all chunks concurrently."""
    futures = []
    for e, leaves in per_env.items():
        at = int(lengths[e])
        for array, x in zip(arrays, leaves):
            futures.append(array[e, at : at + x.shape[0]].write(x))
    for f in futures:
        f.result()


def _write_masses(array: Any, buffer: PrioritisedTrajectoryBuffer, start: np.ndarray) -> None:
    """The mass of every window the buffer holds, at its first step's position."""
    futures = [
        array[e].vindex[starts - start[e]].write(masses.astype(np.float32))
        for e, starts, masses, _ in _held_windows(buffer, start)
    ]
    for f in futures:
        f.result()


def _array_specs(path: Path, manifest: _Manifest) -> list[dict]:
    """The tensorstore specs of the dataset's arrays: one per leaf, then the priorities."""
    priority = {"shape": [], "dtype": "float32"}
    named = [(f"leaves/{i}", leaf, None) for i, leaf in enumerate(manifest.leaves)]
    out = []
    for name, leaf, fill in [*named, ("priority", priority, math.nan)]:
        chunk = [1, manifest.chunk_length, *leaf["shape"]]
        metadata: dict[str, Any] = {
            "shape": [manifest.num_envs, _TIME_AXIS, *leaf["shape"]],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "data_type": leaf["dtype"],  # zarr v3 names dtypes as NumPy does
        }
        if fill is not None:
            metadata["fill_value"] = fill
        kvstore = {"driver": "file", "path": str(path / name)}
        out.append({"driver": "zarr3", "kvstore": kvstore, "metadata": metadata})
    return out


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


def _env_index(env: Any, num_envs: int, call: str) -> int:
    if not isinstance(env, int | np.integer) or isinstance(env, bool):
        raise TypeError(f"`{call}(env=...)` must be an int, got {env!r}.")
    if not 0 <= env < num_envs:
        raise ValueError(f"`{call}`: env {env} is out of range; 0 <= env < num_envs = {num_envs}.")
    return int(env)


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


def _check_priorities(
    manifest: _Manifest, buffer: PrioritisedTrajectoryBuffer, call: str, whose: str
) -> None:
    """Refuse a prioritised buffer whose exponent, period or window differ from those of the
    buffer the dataset's priorities were written from."""
    old = manifest.priorities
    for key, value in _priority_settings(buffer).items():
        if old is not None and old[key] != value:
            raise ValueError(
                f"`{call}`: {whose} {key} is {value}, but the dataset's priorities were "
                f"written with {old[key]}."
            )


def _whole_window(window: Any, options: dict[str, Any], spec: PyTree, call: str) -> Window:
    """`sample`'s window: strict, its `done` leaves among the steps'."""
    window = as_whole_window(window, options, call, "a dataset is sampled in whole windows")
    window.check(spec, _TIME_AXIS, call)
    return window


def _priority_settings(buffer: PrioritisedTrajectoryBuffer) -> dict:
    """What the stored masses depend on: the exponent and which windows they are of."""
    return {
        "priority_exponent": buffer.priority_exponent,
        "period": buffer.window.period,
        "window": buffer.window.size,
    }


def _held_windows(
    buffer: PrioritisedTrajectoryBuffer, floor: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per env `e` with any, `(e, starts, masses, leaves)`: the windows `buffer` holds whole
    that start at or after `floor[e]`, their masses and their leaves in the env's row of
    `window_masses`, on the host."""
    held = jax.tree.map(np.asarray, buffer.window_masses())
    out = []
    for e in range(buffer.num_envs):
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


def _leaves_text(leaves: list[dict]) -> str:
    return "{" + ", ".join(f"{x['path']}: {x['dtype']}{tuple(x['shape'])}" for x in leaves) + "}"


def _read_manifest(path: Path, call: str) -> _Manifest:
    file = path / _MANIFEST
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"`{call}`: {str(path)!r} is not a dataset (no {_MANIFEST}).")
    if raw.get("format") != _FORMAT:
        raise ValueError(
            f"`{call}`: {str(file)!r} has format {raw.get('format')!r}; this version reads "
            f"format {_FORMAT}."
        )
    fields = {f.name for f in dataclasses.fields(_Manifest)}
    return _Manifest(**{k: v for k, v in raw.items() if k in fields})


def _commit(path: Path, manifest: _Manifest, sync: bool) -> None:
    """Replace the manifest atomically (`replace_atomically`: the fsyncs only with `sync`)."""
    text = json.dumps(manifest.to_json(), indent=1)
    replace_atomically(path / _MANIFEST, lambda f: f.write(text.encode()), sync=sync)
