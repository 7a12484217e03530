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

import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import PRNGKeyArray, PyTree

from ._checks import (
    as_prototype,
    check_positive_int,
    check_sequences,
    INT32_MAX,
    Prototype,
)
from ._io import _fsync_directory, _new_file_mode
from ._prioritised_trajectory import PrioritisedTrajectoryBuffer
from ._sum_tree import set_leaves, SumTree
from ._trajectory import EpisodeEnds, LeafName, SequenceSample, TrajectoryBuffer


_FORMAT = 1
_MANIFEST = "manifest.json"
_TIME_AXIS = INT32_MAX  # as many steps as an env's int32 step count can number
_B = TypeVar("_B", TrajectoryBuffer, PrioritisedTrajectoryBuffer)

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
    if isinstance(like, TrajectoryBuffer | PrioritisedTrajectoryBuffer):
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
    - `write(buffer)` appends, per env, exactly the steps a `TrajectoryBuffer` or
        `PrioritisedTrajectoryBuffer` took since the previous write, and refuses, writing
        nothing, if some were overwritten before they could be written. From a prioritised
        buffer it also stores the priorities of its windows and its `max_priority`.
    - `append(steps, env_ids=None)` appends steps given directly (`[n, T, ...]`).
    - `read(env, start, stop)` reads a range of one env's steps; `sample(key, ...)` draws
        random whole windows with the options of `TrajectoryBuffer.sample`; neither loads the
        dataset.
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
        self._leaves = [
            ts.open(self._array_spec(f"leaves/{i}", leaf), open=True, context=context).result()
            for i, leaf in enumerate(manifest.leaves)
        ]
        self._priority = ts.open(
            self._array_spec("priority", {"shape": [], "dtype": "float32"}, fill=math.nan),
            open=True,
            context=context,
        ).result()

    # -- making and opening -----------------------------------------------------------------

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
        for i, leaf in enumerate(manifest.leaves):
            ts.open(cls._spec_for(path, manifest, f"leaves/{i}", leaf), create=True).result()
        priority = {"shape": [], "dtype": "float32"}
        ts.open(cls._spec_for(path, manifest, "priority", priority, math.nan), create=True).result()
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

    @staticmethod
    def _spec_for(path: Path, manifest: _Manifest, name: str, leaf: dict, fill: Any = None):
        shape = [manifest.num_envs, _TIME_AXIS, *leaf["shape"]]
        chunk = [1, manifest.chunk_length, *leaf["shape"]]
        metadata: dict[str, Any] = {
            "shape": shape,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "data_type": leaf["dtype"],  # zarr v3 names dtypes as NumPy does
        }
        if fill is not None:
            metadata["fill_value"] = fill
        return {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(path / name)},
            "metadata": metadata,
        }

    def _array_spec(self, name: str, leaf: dict, fill: Any = None):
        return self._spec_for(self._path, self._manifest, name, leaf, fill)

    # -- what it holds ----------------------------------------------------------------------

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
        return (
            f"Dataset({str(self._path)!r}, num_envs={self.num_envs}, "
            f"steps={int(self.lengths.sum())})"
        )

    # -- writing ----------------------------------------------------------------------------

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
        rows = self._env_ids(env_ids, n, call)
        if length == 0 or n == 0:
            return
        host = [np.asarray(x) for x in jax.tree.leaves(items)]
        new = np.zeros(self.num_envs, np.int64)
        new[rows] = length
        self._check_count(new, call)
        self._write_steps({int(e): [x[i] for x in host] for i, e in enumerate(rows)})
        manifest = dataclasses.replace(
            self._manifest, length=(self.lengths + new).tolist(), writes=self._manifest.writes + 1
        )
        self._commit(manifest)

    def write(self, buffer: TrajectoryBuffer | PrioritisedTrajectoryBuffer) -> int:
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
        t, _ = self._streams(buffer, call, "the buffer")
        count = np.asarray(t.step_count, np.int64)
        stored = np.asarray(t.replay_length, np.int64)
        manifest = self._manifest
        if manifest.writes == 0 and not self.lengths.any():
            manifest = dataclasses.replace(manifest, start=(count - stored).tolist())
        end = np.asarray(manifest.start, np.int64) + self.lengths
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
                f"`{call}`: env {e} took {new[e]} steps since the previous write, but the "
                f"buffer holds only its last {stored[e]} (max_length = {t.max_length}): "
                f"{new[e] - stored[e]} steps were overwritten before they could be written. "
                f"Nothing was written. Write at least every {t.max_length} steps of each env "
                f"({lost.size} env(s) lost steps)."
            )
        priorities = manifest.priorities
        if isinstance(buffer, PrioritisedTrajectoryBuffer):
            mismatch = self._priority_mismatch(buffer)
            if mismatch:
                key, value, old = mismatch
                raise ValueError(
                    f"`{call}`: the buffer's {key} is {value}, but the dataset's "
                    f"priorities were written with {old}."
                )
            priorities = _priority_settings(buffer) | {"max_priority": float(buffer.max_priority)}
        self._check_count(new, call)
        steps = _newest(t, new, end)
        self._write_steps({int(e): [x[e, : new[e]] for x in steps] for e in np.flatnonzero(new)})
        if isinstance(buffer, PrioritisedTrajectoryBuffer):
            self._write_priorities(buffer, np.asarray(manifest.start, np.int64))
        manifest = dataclasses.replace(
            manifest,
            length=(self.lengths + new).tolist(),
            writes=manifest.writes + 1,
            priorities=priorities,
        )
        self._commit(manifest)
        return int(new.sum())

    def _streams(self, buffer: Any, call: str, what: str) -> tuple[TrajectoryBuffer, bool]:
        """The per-env streams of `buffer`, checked against the dataset, and whether it is
        prioritised."""
        prioritised = isinstance(buffer, PrioritisedTrajectoryBuffer)
        if not isinstance(buffer, TrajectoryBuffer | PrioritisedTrajectoryBuffer):
            raise TypeError(
                f"`{call}`: {what} must be a TrajectoryBuffer or PrioritisedTrajectoryBuffer, "
                f"got {type(buffer).__name__}."
            )
        t = buffer.trajectories if prioritised else buffer
        self._check_buffer(t, call)
        return t, prioritised

    def _check_buffer(self, t: TrajectoryBuffer, call: str) -> None:
        if t.num_envs != self.num_envs:
            raise ValueError(
                f"`{call}`: the buffer has {t.num_envs} envs, the dataset {self.num_envs}."
            )
        found = _describe(t.item_spec)
        if found != self._manifest.leaves:
            raise ValueError(
                f"`{call}`: the buffer's steps are {_leaves_text(found)}, the dataset's "
                f"{_leaves_text(self._manifest.leaves)}."
            )

    def _priority_mismatch(self, buffer: PrioritisedTrajectoryBuffer) -> tuple | None:
        """The first setting `(name, buffer's value, dataset's value)` in which `buffer`
        differs from the buffer the priorities were written from, or `None`."""
        old = self._manifest.priorities
        if old is None:
            return None
        for key, value in _priority_settings(buffer).items():
            if old[key] != value:
                return key, value, old[key]
        return None

    def _check_count(self, new: np.ndarray, call: str) -> None:
        over = np.flatnonzero(self.ends + new > INT32_MAX)
        if over.size:
            raise ValueError(
                f"`{call}`: env {int(over[0])} would pass 2**31 - 1 steps, the most a "
                "dataset (and a buffer's int32 step count) numbers."
            )

    def _env_ids(self, env_ids: Any, n: int, call: str) -> np.ndarray:
        if env_ids is None:
            if n != self.num_envs:
                raise ValueError(
                    f"`{call}`: without `env_ids` there must be steps for every env, but the "
                    f"batch has {n} entries and num_envs is {self.num_envs}."
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
        if ((ids < 0) | (ids >= self.num_envs)).any():
            raise ValueError(
                f"`{call}`: an env id is out of range; env ids must satisfy 0 <= env_id < "
                f"num_envs = {self.num_envs}."
            )
        if np.unique(ids).size != ids.size:
            raise ValueError(f"`{call}`: an env id occurs more than once.")
        return ids.astype(np.int64)

    def _write_steps(self, per_env: dict[int, list[np.ndarray]]) -> None:
        """Write each env's new steps past its committed end, all chunks concurrently."""
        futures = []
        for e, leaves in per_env.items():
            at = int(self.lengths[e])
            for array, x in zip(self._leaves, leaves):
                futures.append(array[e, at : at + x.shape[0]].write(x))
        for f in futures:
            f.result()

    def _write_priorities(self, buffer: PrioritisedTrajectoryBuffer, start: np.ndarray) -> None:
        """The mass of every window the buffer holds, at its first step's position."""
        masses = np.asarray(buffer.tree.leaves).astype(np.float32)
        futures = [
            # Windows are `period` apart: index their positions.
            self._priority[e].vindex[starts - start[e]].write(masses[leaves])
            for e, starts, leaves in _held_windows(buffer, buffer.trajectories, start)
        ]
        for f in futures:
            f.result()

    def _commit(self, manifest: _Manifest) -> None:
        if _BEFORE_COMMIT is not None:
            _BEFORE_COMMIT(self)
        _commit(self._path, manifest, self._sync)
        self._manifest = manifest

    # -- reading ----------------------------------------------------------------------------

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
        env = self._env_index(env, call)
        first, end = int(self.starts[env]), int(self.ends[env])
        if not (first <= start <= stop <= end):
            raise ValueError(
                f"`{call}`: steps {start} .. {stop - 1} of env {env} are not all stored; it "
                f"holds steps {first} .. {end - 1} ({end - first} steps)."
            )
        return env, first

    def _env_index(self, env: Any, call: str) -> int:
        if not isinstance(env, int | np.integer) or isinstance(env, bool):
            raise TypeError(f"`{call}(env=...)` must be an int, got {env!r}.")
        if not 0 <= env < self.num_envs:
            raise ValueError(
                f"`{call}`: env {env} is out of range; 0 <= env < num_envs = {self.num_envs}."
            )
        return int(env)

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        sequence_length: int,
        *,
        burn_in: int = 0,
        bootstrap: int = 0,
        period: int = 1,
        episode_ends: EpisodeEnds = "cross",
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> SequenceSample:
        """Draw `batch_size` whole windows uniformly, with replacement, over every env and
        every start on a multiple of `period` (absolute step numbers) whose `W = burn_in +
        sequence_length + bootstrap` steps are stored: `TrajectoryBuffer.sample` with
        `strict=True` and the same options, on the dataset. Only the drawn windows are read.

        **Returns:** a `SequenceSample` `(items, mask, learn, env, start)` of JAX arrays.

        **Raises:** `ValueError`/`TypeError` for bad options (as `TrajectoryBuffer.sample`),
        and `ValueError` if no env holds a whole window yet.
        """
        call = "Dataset.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        check_positive_int(sequence_length, f"{call}(sequence_length=...)")
        window = burn_in + sequence_length + bootstrap
        # The options are checked, and the windows masked, by a TrajectoryBuffer's own code:
        # one stream per sampled window, each holding exactly its window.
        template = eqx.filter_eval_shape(
            TrajectoryBuffer, self._spec, num_envs=batch_size, max_length=max(window, 1)
        )
        windows = template._windows(
            call, sequence_length, burn_in, bootstrap, period, True, episode_ends, done
        )
        law = windows.law
        starts, ends = self.starts, self.ends
        first = -(-starts // law.period) * law.period
        per_env = np.maximum((ends - law.size - first) // law.period + 1, 0)
        total = int(per_env.sum())
        if total == 0:
            raise ValueError(
                f"`{call}`: no env holds a whole window of {law.size} steps starting on a "
                f"multiple of period = {law.period} yet."
            )
        draws = np.asarray(jax.random.randint(key, (batch_size,), 0, total, dtype=jnp.int32))
        cumulative = np.cumsum(per_env)
        env = np.searchsorted(cumulative, draws, side="right")
        start = first[env] + (draws - (cumulative[env] - per_env[env])) * law.period
        offsets = (start - starts[env])[:, None] + np.arange(law.size)[None, :]
        rows = np.broadcast_to(env[:, None], offsets.shape)
        out = [a.vindex[rows, offsets].read().result() for a in self._leaves]
        data = jax.tree.unflatten(jax.tree.structure(self._spec), [jnp.asarray(x) for x in out])
        # Window b is the whole stream of env b of a buffer that has taken W steps; its env
        # and start are put back afterwards.
        holder = eqx.tree_at(
            lambda b: (b.data, b.step_count, b.replay_length, b.online_length),
            template,
            (
                data,
                jnp.full(batch_size, law.size, jnp.int32),
                jnp.full(batch_size, law.size, jnp.int32),
                jnp.zeros(batch_size, jnp.int32),
            ),
        )
        b = jnp.arange(batch_size, dtype=jnp.int32)
        full = jnp.full(batch_size, law.size, jnp.int32)
        sample = holder._gather(b, full, full, windows)
        return sample._replace(env=jnp.asarray(env, jnp.int32), start=jnp.asarray(start, jnp.int32))

    def priorities(self, env: int, start: int, stop: int) -> np.ndarray:
        """The stored sum-tree masses (`priority ** priority_exponent`) of the windows that
        start at steps `start .. stop - 1` of env `env`: float32, NaN where no window starts
        or none was written from a prioritised buffer."""
        env, first = self._range(env, start, stop, "Dataset.priorities")
        return self._priority[env, start - first : stop - first].read().result()

    # -- into a buffer ----------------------------------------------------------------------

    def load(self, like: _B) -> _B:
        """A buffer of `like`'s type and configuration holding each env's newest steps (up to
        its `max_length`), with its step counts, to continue training. Its online queue is
        empty.

        For a `PrioritisedTrajectoryBuffer`, each stored window gets the priority the dataset
        holds for it, and the buffer its `max_priority`; windows with none (steps written
        with `append`, or from a plain buffer) get `max_priority`, as new windows do.

        `like` may come from `eqx.filter_eval_shape`.

        **Raises:** `ValueError` if `like`'s steps or number of envs differ from the
        dataset's, or its priority exponent, period or window from those the priorities
        were written with.
        """
        call = "Dataset.load"
        template, prioritised = self._streams(like, call, "`like`")
        m = template.max_length
        ends = self.ends
        kept = np.minimum(self.lengths, m)
        data = [
            np.zeros((self.num_envs, m, *leaf["shape"]), leaf["dtype"])
            for leaf in self._manifest.leaves
        ]
        for e in range(self.num_envs):
            if kept[e] == 0:
                continue
            steps = np.arange(ends[e] - kept[e], ends[e])
            values = self.read(e, int(steps[0]), int(ends[e]))
            for out, x in zip(data, jax.tree.leaves(values)):
                out[e, steps % m] = x
        # Every array of `template` is replaced: it may hold no arrays at all (eval_shape).
        trajectories = eqx.tree_at(
            lambda b: (b.data, b.step_count, b.replay_length, b.online_length),
            template,
            (
                jax.tree.unflatten(jax.tree.structure(self._spec), [jnp.asarray(x) for x in data]),
                jnp.asarray(ends, jnp.int32),
                jnp.asarray(kept, jnp.int32),
                jnp.zeros(self.num_envs, jnp.int32),
            ),
        )
        if not prioritised:
            return trajectories  # type: ignore[return-value]
        return self._load_prioritised(like, trajectories, call)  # type: ignore[return-value]

    def _load_prioritised(
        self, like: PrioritisedTrajectoryBuffer, trajectories: TrajectoryBuffer, call: str
    ) -> PrioritisedTrajectoryBuffer:
        mismatch = self._priority_mismatch(like)
        if mismatch:
            key, value, old = mismatch
            raise ValueError(
                f"`{call}`: `like` has {key} = {value}, but the dataset's priorities were "
                f"written with {old}."
            )
        meta = self._manifest.priorities
        dtype = like.max_priority.dtype
        max_priority = jnp.asarray(1.0 if meta is None else meta["max_priority"], dtype)
        default = float(max_priority) ** like.priority_exponent
        leaves, masses = [], []
        for e, starts, held in _held_windows(like, trajectories, self.starts):
            stored = self._priority[e].vindex[starts - self.starts[e]].read().result()
            masses.append(np.where(np.isnan(stored), default, stored))
            leaves.append(held)
        tree = SumTree(like.tree.capacity, dtype)
        if leaves:
            tree = set_leaves(
                tree,
                jnp.asarray(np.concatenate(leaves), jnp.int32),
                jnp.asarray(np.concatenate(masses), dtype),
                unique=True,
            )
        return eqx.tree_at(
            lambda b: (b.trajectories, b.tree, b.max_priority),
            like,
            (trajectories, tree, max_priority),
        )


def _priority_settings(buffer: PrioritisedTrajectoryBuffer) -> dict:
    """What the stored masses depend on: the exponent and which windows they are of."""
    return {
        "priority_exponent": buffer.priority_exponent,
        "period": buffer.period,
        "window": buffer.window,
    }


def _held_windows(
    buffer: PrioritisedTrajectoryBuffer, streams: TrajectoryBuffer, floor: np.ndarray
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per env `e` with any, `(e, starts, leaves)`: the starts of the windows `streams` hold
    whole (on `buffer`'s period, none before `floor[e]`), and their sum-tree leaves."""
    count = np.asarray(streams.step_count, np.int64)
    oldest = np.maximum(count - np.asarray(streams.replay_length, np.int64), floor)
    p = buffer.period
    out = []
    for e in range(streams.num_envs):
        first = -(-oldest[e] // p) * p
        starts = np.arange(first, count[e] - buffer.window + 1, p, dtype=np.int64)
        if starts.size:
            env = jnp.full(starts.shape, e, jnp.int32)
            leaves = buffer._leaf(env, jnp.asarray(starts, jnp.int32))
            out.append((e, starts, np.asarray(leaves)))
    return out


def _newest(t: TrajectoryBuffer, new: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
    """Per leaf, `[num_envs, max(new)]` on the host: env e's steps `end[e] ..` (the first
    `new[e]` of each row are its new steps), gathered on the device."""
    width = int(new.max(initial=0))
    if width == 0:
        return [np.zeros((t.num_envs, 0, *s.shape), s.dtype) for s in jax.tree.leaves(t.item_spec)]
    slots = (end[:, None] + np.arange(width)[None, :]) % t.max_length
    rows = np.arange(t.num_envs)[:, None]
    gathered = _gather(t.data, jnp.asarray(rows, jnp.int32), jnp.asarray(slots, jnp.int32))
    return [np.asarray(x) for x in jax.tree.leaves(gathered)]


@jax.jit
def _gather(data, rows, slots):
    return jax.tree.map(lambda x: x[rows, slots], data)


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
    """Replace the manifest atomically: temporary file, fsync, rename, directory fsync (the
    fsyncs only with `sync`)."""
    target = path / _MANIFEST
    fd, tmp = tempfile.mkstemp(prefix=f".{_MANIFEST}.", suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest.to_json(), f, indent=1)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode(str(target)))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        _fsync_directory(str(path))
