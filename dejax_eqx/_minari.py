"""Minari datasets in and out: episodes to per-env streams of steps, and back.

A Minari episode of `T` steps holds `T + 1` observations and infos (the reset's first) and `T`
actions, rewards, terminations and truncations. It becomes `T + 1` consecutive steps of one
env's stream, in the layout of gymnasium's next-step autoreset (docs/sequences.md, "The reset
step"): step `t < T` is `(o_t, a_t, r_t, terminated_t, truncated_t, info_t, valid=True)`, and
step `T`, the reset step, holds the final observation `o_T` and `info_T`, with a zero action,
a zero reward, no end flag and `valid=False`. Writing out inverts this exactly; the reset
step's action and reward have no place in Minari and are not written.

Everything here is host code over public doors: `Dataset.create`/`append`/`read` and, for a
buffer, `Streams.restore`, `with_streams` and `gather_steps` (the ring's own read).
"""

import importlib
import shutil
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import PyTree

from ._abstract import AbstractTrajectoryBuffer
from ._checks import as_prototype, check_bool, check_positive_int
from ._dataset import Dataset, dataset_of
from ._streams import gather_steps


_B = Any  # a trajectory buffer of the caller's type (returned as given)

# The keys of a step, named after Minari's `StepData` (one step of each of its fields).
OBSERVATION, ACTION, REWARD = "observation", "action", "reward"
TERMINATED, TRUNCATED, INFO, VALID = "terminated", "truncated", "info", "valid"
_REQUIRED = (OBSERVATION, ACTION, REWARD, TERMINATED, TRUNCATED, VALID)
_FIXED = ("Box", "Discrete", "MultiDiscrete", "MultiBinary")


class MinariWritten(NamedTuple):
    """What `to_minari` wrote, and what it left out.

    **Fields:**

    - `dataset`: the new `minari.MinariDataset`.
    - `episodes`: int64 `(num_envs,)`, the number of episodes written from each env.
    - `left_out`: one `(env, start, stop, why)` per run of steps not written (absolute step
        numbers `start .. stop - 1` of env `env`): `why` is `"running"` for the steps of an
        episode that had not ended yet, `"cut"` for the steps of an episode whose first steps
        the source no longer holds.
    """

    dataset: Any
    episodes: np.ndarray
    left_out: list[tuple[int, int, int, str]]


def _import(module: str, call: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"`{call}` needs {module.split('.')[0]}, which is not installed: "
            "pip install 'dejax_eqx[offline]'."
        ) from error


def _progress(total: int | None, enabled: bool, what: str) -> Any:
    """A tqdm bar over `total` episodes (`None`: unknown) if `enabled` and tqdm is installed,
    else `None`."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=what, unit="episode")


def _open_source(source: Any, call: str) -> Any:
    """`source` as a `minari.MinariDataset`: given as one, or as the id of a local dataset."""
    minari = _import("minari", call)
    if isinstance(source, str):
        return minari.load_dataset(source)
    if not isinstance(source, minari.MinariDataset):
        raise TypeError(
            f"`{call}(source=...)` must be a `minari.MinariDataset` or the id of a local Minari "
            f"dataset, got {type(source).__name__}."
        )
    return source


# ---------------------------------------------------------------------------------------------
# Reading: spaces and episodes to steps.


def _space_spec(space: Any, data: Any, steps: int, name: str, call: str) -> PyTree:
    """The spec of one step of a field given by `space` (Box, Discrete, MultiDiscrete,
    MultiBinary, or Dict and Tuple of them), read off its `data` for `steps` steps."""
    kind = type(space).__name__
    if kind == "Dict":
        if not isinstance(data, dict) or set(data) != set(space.spaces):
            raise ValueError(
                f"`{call}`: `{name}` is a Dict space of keys {sorted(space.spaces)}, but the "
                f"episode holds {_describe(data)}."
            )
        return {k: _space_spec(s, data[k], steps, f"{name}[{k!r}]", call) for k, s in space.items()}
    if kind == "Tuple":
        if not isinstance(data, tuple) or len(data) != len(space.spaces):
            raise ValueError(
                f"`{call}`: `{name}` is a Tuple space of {len(space.spaces)} entries, but the "
                f"episode holds {_describe(data)}."
            )
        return tuple(
            _space_spec(s, d, steps, f"{name}[{i}]", call)
            for i, (s, d) in enumerate(zip(space.spaces, data))
        )
    if kind not in _FIXED:
        raise ValueError(
            f"`{call}`: `{name}` is a {kind} space, which has no fixed shape and dtype per step; "
            "a step holds Box, Discrete, MultiDiscrete and MultiBinary spaces, and Dict and "
            "Tuple spaces of them."
        )
    return _array_spec(data, steps, name, call)


def _array_spec(data: Any, steps: int, name: str, call: str) -> jax.ShapeDtypeStruct:
    """The spec of one step of `data`, an array of `steps` steps of a fixed shape and a
    numeric or bool dtype."""
    if not isinstance(data, np.ndarray) or data.dtype.kind not in "biufc":
        what = type(data).__name__ if not isinstance(data, np.ndarray) else f"dtype {data.dtype}"
        raise ValueError(
            f"`{call}`: `{name}` is not an array of numbers or bools (it holds {what}); a step "
            "holds fixed-shape numeric or bool arrays only."
        )
    if data.ndim == 0 or data.shape[0] != steps:
        raise ValueError(
            f"`{call}`: `{name}` has shape {data.shape} in an episode of {steps} entries; "
            f"expected a leading axis of {steps}."
        )
    return jax.ShapeDtypeStruct(data.shape[1:], data.dtype)


def _describe(data: Any) -> str:
    if isinstance(data, dict):
        return f"a dict of keys {sorted(data)}"
    if isinstance(data, tuple | list):
        return f"a {type(data).__name__} of {len(data)} entries"
    return f"a {type(data).__name__}"


def _info_spec(infos: Any, steps: int, name: str, call: str) -> PyTree:
    """The spec of one step of an episode's infos (a nested dict of arrays of `steps`)."""
    if isinstance(infos, dict):
        return {k: _info_spec(v, steps, f"{name}[{k!r}]", call) for k, v in infos.items()}
    return _array_spec(infos, steps, name, call)


def _columns(episode: Any, keep_infos: bool) -> dict:
    """An episode's fields under the step's keys (observations and infos: `T + 1` entries)."""
    columns = {
        OBSERVATION: episode.observations,
        ACTION: episode.actions,
        REWARD: episode.rewards,
        TERMINATED: episode.terminations,
        TRUNCATED: episode.truncations,
    }
    if keep_infos and episode.infos:
        columns[INFO] = episode.infos
    return columns


def _source_spec(m: Any, episode: Any, keep_infos: bool, call: str) -> dict:
    """The spec of one step of the dataset `m`, read off its first `episode` and its spaces."""
    steps = len(episode)
    cols = _columns(episode, keep_infos)
    spec = {
        OBSERVATION: _space_spec(
            m.observation_space, cols[OBSERVATION], steps + 1, "observation", call
        ),
        ACTION: _space_spec(m.action_space, cols[ACTION], steps, "action", call),
        REWARD: _array_spec(cols[REWARD], steps, "reward", call),
        TERMINATED: _array_spec(cols[TERMINATED], steps, "terminated", call),
        TRUNCATED: _array_spec(cols[TRUNCATED], steps, "truncated", call),
        VALID: jax.ShapeDtypeStruct((), np.bool_),
    }
    for key in (REWARD, TERMINATED, TRUNCATED):
        if spec[key].shape != ():
            raise ValueError(
                f"`{call}`: `{key}` has shape {spec[key].shape} per step; expected ()."
            )
    for key in (TERMINATED, TRUNCATED):
        if spec[key].dtype != np.bool_:
            raise ValueError(f"`{call}`: `{key}` is {spec[key].dtype}; expected bool.")
    if INFO in cols:
        info = _info_spec(cols[INFO], steps + 1, "info", call)
        if jax.tree.leaves(info):
            spec[INFO] = info
    return spec


def minari_spec(source: Any, *, infos: bool = True) -> dict:
    """The structure, shapes and dtypes of one step of a Minari dataset, as `from_minari`
    lays it out: a dict of `jax.ShapeDtypeStruct` leaves, with Minari's dtypes (often
    `int64` actions and `float64` rewards).

    - `"observation"`: the observation space's structure: an array for a Box, Discrete,
        MultiDiscrete or MultiBinary space, a dict for a Dict space, a tuple for a Tuple space.
    - `"action"`: the same for the action space.
    - `"reward"`, `"terminated"`, `"truncated"`: one value each.
    - `"info"`: the infos, a nested dict of arrays, if the dataset has any (and `infos`).
    - `"valid"`: bool; `False` on the step that holds an episode's final observation.

    Read off the first episode (and the spaces); `from_minari` holds every episode to it.

    **Arguments:** `source`, a `minari.MinariDataset` or a local dataset's id; `infos`, whether
    to keep the infos.

    **Raises:** `ValueError` naming the field for what a step cannot hold (a Text, Sequence or
    Graph space, infos that are not numeric arrays), and for an empty dataset.
    """
    call = "minari_spec"
    m = _open_source(source, call)
    infos = check_bool(infos, f"{call}(infos=...)")
    return _source_spec(m, _first_episode(m, call), infos, call)


def _first_episode(m: Any, call: str) -> Any:
    if m.total_episodes == 0:
        raise ValueError(f"`{call}`: the Minari dataset {m.id!r} holds no episodes.")
    return next(iter(m.iterate_episodes(m.episode_indices[:1])))


def _target_spec(source: dict, like: Any, cast: bool, call: str) -> PyTree:
    """The spec steps are stored as: `source`'s, or `like`'s (a prototype or a trajectory
    buffer) after checking it has `source`'s structure and shapes, and its dtypes unless
    `cast`."""
    if like is None:
        return source
    target = like.item_spec if isinstance(like, AbstractTrajectoryBuffer) else like
    target = as_prototype(target, f"{call}(like=...)")
    found, want = _flat(source), _flat(target)
    if list(found) != list(want):
        missing = [p for p in found if p not in want]
        extra = [p for p in want if p not in found]
        raise ValueError(
            f"`{call}`: `like` does not have the Minari dataset's step structure: it lacks "
            f"{missing or 'nothing'} and has {extra or 'nothing'} besides (`dx.minari_spec` "
            "gives the dataset's)."
        )
    for path, s in found.items():
        t = want[path]
        if s.shape != t.shape:
            raise ValueError(
                f"`{call}`: `{path}` is {s.shape} per step in the Minari dataset, {t.shape} in "
                "`like`."
            )
        if s.dtype != t.dtype and not cast:
            raise TypeError(
                f"`{call}`: `{path}` is {s.dtype} in the Minari dataset, {t.dtype} in `like`; "
                "pass cast=True to convert (refused where a value would change)."
            )
    return target


def _flat(tree: PyTree) -> dict[str, Any]:
    return {_name(path): leaf for path, leaf in tree_flatten_with_path(tree)[0]}


def _name(path: Any) -> str:
    """A leaf path as `observation['pole'][0]`."""
    text = keystr(path)
    head, _, rest = text.partition("]")
    return head.removeprefix("['").removesuffix("'") + rest


def _episode_steps(
    columns: dict, spec: dict, target: PyTree, episode_id: int, call: str
) -> PyTree[np.ndarray]:
    """An episode's `T + 1` steps, checked against the dataset's `spec` and cast to `target`."""
    steps = len(columns[REWARD])
    rows = dict(columns)
    for key in (ACTION, REWARD, TERMINATED, TRUNCATED):  # the reset step's: zeros, no end flag
        rows[key] = jax.tree.map(lambda x: _append_zero(x), columns[key])
    rows[VALID] = np.arange(steps + 1) < steps
    flat, treedef = tree_flatten_with_path(rows)
    if treedef != jax.tree.structure(spec):
        raise ValueError(
            f"`{call}`: episode {episode_id} has the fields {sorted(_flat(rows))}, but the "
            f"dataset's first episode has {sorted(_flat(spec))} (infos of varying keys?)."
        )
    out = []
    for (path, x), s, t in zip(flat, jax.tree.leaves(spec), jax.tree.leaves(target)):
        name = _name(path)
        if not isinstance(x, np.ndarray) or x.shape != (steps + 1, *s.shape) or x.dtype != s.dtype:
            got = f"shape {x.shape}, {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
            raise ValueError(
                f"`{call}`: `{name}` of episode {episode_id} ({steps} steps) is {got} (the reset "
                f"step included), but the dataset's first episode has {s.shape} {s.dtype} per "
                "step: every episode must have the same shapes and dtypes."
            )
        out.append(_cast(x, t.dtype, name, episode_id, call))
    return jax.tree.unflatten(treedef, out)


def _append_zero(x: np.ndarray) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim == 0:
        return x  # refused by the shape check
    return np.concatenate([x, np.zeros((1, *x.shape[1:]), x.dtype)])


def _cast(x: np.ndarray, dtype: Any, name: str, episode_id: int, call: str) -> np.ndarray:
    """`x` as `dtype`, refused where a value changes (a float may be rounded to a narrower
    float's precision, as the buffers round Python floats, but not overflow)."""
    if x.dtype == dtype:
        return x
    with np.errstate(all="ignore"):
        y = x.astype(dtype)
        if np.issubdtype(dtype, np.floating) and np.issubdtype(x.dtype, np.floating):
            changed = np.isfinite(x) & ~np.isfinite(y)
        else:
            changed = y.astype(x.dtype) != x
            if np.issubdtype(x.dtype, np.floating):
                changed |= ~np.isfinite(x)
    if changed.any():
        value = x[np.unravel_index(int(np.argmax(changed)), x.shape)]
        raise ValueError(
            f"`{call}`: `{name}` of episode {episode_id} holds {value!r}, which {np.dtype(dtype)} "
            "cannot hold; nothing is cast where a value would change."
        )
    return y


def _episodes(
    m: Any, spec: dict, target: PyTree, keep_infos: bool, per_read: int, bar: Any, call: str
) -> Iterator[tuple[int, PyTree[np.ndarray]]]:
    """`(k, steps)` for the `k`-th episode of `m`, read `per_read` episodes at a time."""
    indices = m.episode_indices
    for lo in range(0, len(indices), per_read):
        chunk = list(m.iterate_episodes(indices[lo : lo + per_read]))
        for k, episode in enumerate(chunk, start=lo):
            yield (
                k,
                _episode_steps(_columns(episode, keep_infos), spec, target, int(episode.id), call),
            )
        if bar is not None:
            bar.update(len(chunk))


def _plan(m: Any, like: Any, cast: bool, infos: bool, call: str) -> tuple[dict, PyTree]:
    infos = check_bool(infos, f"{call}(infos=...)")
    cast = check_bool(cast, f"{call}(cast=...)")
    spec = _source_spec(m, _first_episode(m, call), infos, call)
    return spec, _target_spec(spec, like, cast, call)


def from_minari(
    source: Any,
    path: Any,
    *,
    num_envs: int = 1,
    like: Any = None,
    cast: bool = False,
    infos: bool = True,
    episodes_per_read: int = 64,
    progress: bool = True,
    chunk_length: int = 1024,
    sync: bool = True,
) -> Dataset:
    """Read a Minari dataset into a new `dx.Dataset` at `path`, episode by episode.

    Episode `k` (in the dataset's order) goes to env `k % num_envs`, after that env's previous
    episode: each env's stream is a concatenation of whole episodes, each of `T + 1` steps
    (`dx.minari_spec` says what a step holds). Step `t < T` holds observation `t` and info
    `t` with action, reward, termination and truncation `t`; step `T`, the reset step, holds
    the final observation and info with a zero action, a zero reward, both end flags `False`
    and `"valid"` `False`. Terminations and truncations stay apart (a step may have both).

    Episodes are read `episodes_per_read` at a time and appended per env, so memory holds one
    such batch, whatever the dataset's size; `progress` shows a bar if tqdm is installed.

    **Arguments:**

    - `source`: a `minari.MinariDataset` or the id of a local one.
    - `path`: where to make the dataset (as `Dataset.create`: it must not exist yet).
    - `num_envs`: the number of streams, a positive int.
    - `like`: `None` to store Minari's dtypes as they are, or a prototype step or a trajectory
        buffer whose dtypes to store (its structure and shapes must be Minari's), so that the
        dataset loads into that buffer (`Dataset.load`). A JAX buffer holds no 64-bit values
        unless `jax_enable_x64` is set.
    - `cast`: convert dtypes that differ from `like`'s (default `False`: refused). A value that
        would change is refused either way; a float may be rounded to a narrower float.
    - `infos`: keep the infos (default `True`); `False` leaves them out.
    - `chunk_length`, `sync`: as for `Dataset.create`.

    **Returns:** the `Dataset`, open.

    **Raises:** `ValueError`/`TypeError` naming the field for a dataset a step cannot hold (a
    Text, Sequence or Graph space, infos that are not numeric arrays or whose keys, shapes or
    dtypes vary between episodes), for a `like` that does not match, or a value `cast` would
    change. The dataset made so far is removed then.
    """
    call = "from_minari"
    m = _open_source(source, call)
    num_envs = check_positive_int(num_envs, f"{call}(num_envs=...)")
    per_read = check_positive_int(episodes_per_read, f"{call}(episodes_per_read=...)")
    progress = check_bool(progress, f"{call}(progress=...)")
    spec, target = _plan(m, like, cast, infos, call)
    dataset = Dataset.create(path, target, num_envs, chunk_length=chunk_length, sync=sync)
    bar = _progress(m.total_episodes, progress, "from Minari")
    try:
        batch: dict[int, list] = {}
        for k, steps in _episodes(m, spec, target, infos, per_read, bar, call):
            batch.setdefault(k % num_envs, []).append(steps)
            if (k + 1) % per_read == 0:
                _append(dataset, batch)
                batch = {}
        _append(dataset, batch)
    except BaseException:
        dataset.close()
        shutil.rmtree(dataset.path, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return dataset


def _append(dataset: Dataset, batch: dict[int, list]) -> None:
    """Append each env's episodes of `batch`, one `append` per env."""
    for env, episodes in sorted(batch.items()):
        steps = jax.tree.map(lambda *xs: np.concatenate(xs)[None], *episodes)
        dataset.append(steps, env_ids=np.asarray([env]))


def load_minari(
    source: Any,
    like: _B,
    *,
    cast: bool = False,
    infos: bool = True,
    episodes_per_read: int = 64,
    progress: bool = True,
) -> _B:
    """A trajectory buffer of `like`'s type and configuration holding a Minari dataset's
    episodes: episode `k` in env `k % like.num_envs`, laid out as by `from_minari`, each env's
    stream starting at step 0 (as `Dataset.load` restores one: an empty online queue, every
    window at the largest priority).

    Every episode must fit: an env whose episodes hold more than `max_length` steps in all
    is refused before any is read (read them into a `Dataset` with `from_minari` and
    `Dataset.load`, which keeps each env's newest steps, to keep only the newest).

    **Arguments:** `like`, any `AbstractTrajectoryBuffer` (its steps must have the dataset's
    structure and shapes; it may come from `eqx.filter_eval_shape`); the rest as for
    `from_minari`. A buffer's steps are JAX arrays, 32-bit unless `jax_enable_x64` is set, so
    Minari's `int64` actions and `float64` rewards need `cast=True`.

    **Raises:** as `from_minari`, and `ValueError` if the episodes do not fit.
    """
    call = "load_minari"
    m = _open_source(source, call)
    if not isinstance(like, AbstractTrajectoryBuffer):
        raise TypeError(
            f"`{call}(like=...)` must be a trajectory buffer (an AbstractTrajectoryBuffer), got "
            f"{type(like).__name__}."
        )
    per_read = check_positive_int(episodes_per_read, f"{call}(episodes_per_read=...)")
    progress = check_bool(progress, f"{call}(progress=...)")
    spec, target = _plan(m, like, cast, infos, call)
    num_envs, max_length = like.num_envs, like.max_length
    metadata = m.storage.get_episode_metadata(m.episode_indices)
    lengths = np.zeros(num_envs, np.int64)
    for k, meta in enumerate(metadata):
        lengths[k % num_envs] += int(meta["total_steps"]) + 1
    over = np.flatnonzero(lengths > max_length)
    if over.size:
        e = int(over[0])
        raise ValueError(
            f"`{call}`: env {e} would hold {lengths[e]} steps (its episodes and their reset "
            f"steps), more than max_length = {max_length}; use more envs or a longer "
            "max_length, or `from_minari` and `Dataset.load` to keep each env's newest steps."
        )
    data = [np.zeros((num_envs, max_length, *s.shape), s.dtype) for s in jax.tree.leaves(target)]
    filled = np.zeros(num_envs, np.int64)
    bar = _progress(m.total_episodes, progress, "from Minari")
    try:
        for k, steps in _episodes(m, spec, target, infos, per_read, bar, call):
            e, leaves = k % num_envs, jax.tree.leaves(steps)
            n = leaves[0].shape[0]
            if filled[e] + n > lengths[e]:
                raise ValueError(
                    f"`{call}`: episode {k} has {n - 1} steps, more than the dataset's episode "
                    "metadata (`total_steps`) says."
                )
            for out, x in zip(data, leaves):
                out[e, filled[e] : filled[e] + n] = x
            filled[e] += n
    finally:
        if bar is not None:
            bar.close()
    steps = jax.tree.unflatten(jax.tree.structure(target), data)
    return like.with_streams(like.streams.restore(steps, filled, filled))


# ---------------------------------------------------------------------------------------------
# Writing: streams of steps to episodes.


class _Stream:
    """One env's stored steps, read `read_length` at a time: `(first, end, read(lo, hi))`."""

    def __init__(self, env: int, first: int, end: int, read: Any):
        self.env, self.first, self.end, self.read = env, first, end, read


def _streams_of(source: Any, call: str) -> tuple[PyTree, list[_Stream]]:
    """The step spec of `source` (a `Dataset` or a trajectory buffer) and a reader per env."""
    dataset = dataset_of(source)
    if dataset is not None:
        source = dataset
        read = lambda e: lambda lo, hi: jax.tree.leaves(source.read(e, lo, hi))  # noqa: E731
        first, end = source.starts, source.ends
        return source.item_spec, [
            _Stream(e, int(first[e]), int(end[e]), read(e)) for e in range(source.num_envs)
        ]
    if not isinstance(source, AbstractTrajectoryBuffer):
        raise TypeError(
            f"`{call}(source=...)` must be a `dx.Dataset` or a trajectory buffer (an "
            f"AbstractTrajectoryBuffer), got {type(source).__name__}."
        )
    t = source.streams
    count, stored = np.asarray(t.step_count, np.int64), np.asarray(t.lengths, np.int64)
    width = int(stored.max(initial=0))
    if width:
        env = jnp.arange(t.num_envs, dtype=jnp.int32)
        back = jnp.asarray(stored, jnp.int32)
        held = [np.asarray(x) for x in jax.tree.leaves(gather_steps(t, env, back, width))]
    else:
        held = []

    def reader(e: int, first: int) -> Any:
        return lambda lo, hi: [x[e, lo - first : hi - first] for x in held]

    first = count - stored
    return t.item_spec, [
        _Stream(e, int(first[e]), int(count[e]), reader(e, int(first[e])))
        for e in range(t.num_envs)
    ]


def _check_layout(spec: PyTree, call: str) -> None:
    """Refuse steps without the layout `from_minari` makes, naming the field."""
    if not isinstance(spec, dict):
        raise TypeError(
            f"`{call}`: the steps must be a dict with keys {list(_REQUIRED)} (and `info`), as "
            f"`dx.from_minari` makes them; got a {type(spec).__name__}."
        )
    missing = [k for k in _REQUIRED if k not in spec]
    extra = [k for k in spec if k not in (*_REQUIRED, INFO)]
    if missing or extra:
        raise ValueError(
            f"`{call}`: the steps lack the fields {missing} and have {extra} besides; a step for "
            f"Minari has {list(_REQUIRED)} and, optionally, `info`."
        )
    for key in (REWARD, TERMINATED, TRUNCATED, VALID):
        s = spec[key]
        if not isinstance(s, jax.ShapeDtypeStruct) or s.shape != ():
            raise ValueError(f"`{call}`: `{key}` must be one value per step, got {s}.")
    for key in (TERMINATED, TRUNCATED, VALID):
        if spec[key].dtype != np.bool_:
            raise TypeError(f"`{call}`: `{key}` must be bool, got {spec[key].dtype}.")


def _check_space(space: Any, spec: PyTree, name: str, call: str) -> None:
    """Refuse steps of a field whose structure or shapes are not those of its `space`."""
    kind = type(space).__name__
    if kind in ("Dict", "Tuple"):
        keys = list(space.spaces) if kind == "Dict" else list(range(len(space.spaces)))
        container = dict if kind == "Dict" else tuple
        if not isinstance(spec, container) or sorted(map(str, keys)) != sorted(
            map(str, spec.keys() if isinstance(spec, dict) else range(len(spec)))
        ):
            raise ValueError(
                f"`{call}`: `{name}` is a {kind} space of {keys}, but the steps hold "
                f"{_describe(spec)} there."
            )
        for key in keys:
            _check_space(space.spaces[key], spec[key], f"{name}[{key!r}]", call)
        return
    if kind not in _FIXED:
        raise ValueError(
            f"`{call}`: `{name}` is a {kind} space, which a step cannot hold (Box, Discrete, "
            "MultiDiscrete, MultiBinary, and Dict and Tuple spaces of them)."
        )
    if not isinstance(spec, jax.ShapeDtypeStruct) or tuple(space.shape) != spec.shape:
        raise ValueError(
            f"`{call}`: `{name}` is a {kind} space of shape {space.shape}, but the steps hold "
            f"{spec} there."
        )
    if kind != "Box" and not np.issubdtype(spec.dtype, np.integer):
        raise TypeError(
            f"`{call}`: `{name}` is a {kind} space, but the steps hold {spec.dtype} there; "
            "expected integers."
        )


class _Episodes:
    """The whole episodes of one env's stream, in order, read `read_length` steps at a time,
    and the runs of steps left out (before the first episode known whole, after the last)."""

    def __init__(self, stream: _Stream, spec: PyTree, read_length: int, call: str):
        self.stream, self.call, self.read_length = stream, call, read_length
        self.treedef = jax.tree.structure(spec)
        self.keys = {k: i for i, k in enumerate(_flat(spec))}
        self.left_out: list[tuple[int, int, int, str]] = []

    def _flag(self, leaves: list[np.ndarray], key: str) -> np.ndarray:
        return leaves[self.keys[key]]

    def __iter__(self) -> Iterator[PyTree[np.ndarray]]:
        s, call = self.stream, self.call
        # An episode is known whole from its first step: step 0 of the env, or the step after
        # a reset step. Before the first such step, the source may have lost the episode's start.
        whole = s.first == 0
        begin, pending = s.first, []  # the current episode's first step, its steps read so far
        for lo in range(s.first, s.end, self.read_length):
            hi = min(lo + self.read_length, s.end)
            leaves = s.read(lo, hi)
            valid = self._flag(leaves, VALID)
            done = self._flag(leaves, TERMINATED) | self._flag(leaves, TRUNCATED)
            bad = np.flatnonzero(~valid & done)
            if bad.size:
                raise ValueError(
                    f"`{call}`: step {lo + int(bad[0])} of env {s.env} has `valid` False (a reset "
                    "step) and an end flag set; a reset step ends no episode."
                )
            at = lo
            for r in np.flatnonzero(~valid):
                cut = int(r) + 1
                part = [x[at - lo : cut] for x in leaves]
                at = lo + cut
                episode = [np.concatenate(xs) for xs in zip(*pending, part)]
                pending, start, begin = [], begin, at
                if whole:
                    yield self._episode(episode, start)
                else:
                    self.left_out.append((s.env, start, at, "cut"))
                whole = True
            if at < hi:
                pending.append([x[at - lo :] for x in leaves])
        if begin < s.end:
            self.left_out.append((s.env, begin, s.end, "running"))

    def _episode(self, leaves: list[np.ndarray], start: int) -> PyTree[np.ndarray]:
        """An episode's steps (its reset step last), checked: it ends by a termination or a
        truncation on its last step before the reset step, and on no earlier one."""
        s, call = self.stream, self.call
        steps = len(leaves[0]) - 1
        done = self._flag(leaves, TERMINATED)[:-1] | self._flag(leaves, TRUNCATED)[:-1]
        if steps == 0:
            raise ValueError(
                f"`{call}`: step {start} of env {s.env} is a reset step (`valid` False) right "
                "after another one or at the env's first step: an episode of no steps."
            )
        if not done[-1]:
            raise ValueError(
                f"`{call}`: step {start + steps} of env {s.env} is a reset step (`valid` False), "
                f"but step {start + steps - 1} before it ends no episode (neither `terminated` "
                "nor `truncated`)."
            )
        early = np.flatnonzero(done[:-1])
        if early.size:
            raise ValueError(
                f"`{call}`: step {start + int(early[0])} of env {s.env} ends an episode "
                "(`terminated` or `truncated`), but the step after it is not a reset step "
                "(`valid` False): the steps are not in the layout of `dx.from_minari`."
            )
        return jax.tree.unflatten(self.treedef, leaves)


def _episode_buffer(minari: Any, steps: dict) -> Any:
    """A Minari `EpisodeBuffer` of an episode's steps (its reset step last)."""
    head = lambda x: x[:-1]  # noqa: E731  what the reset step holds besides o_T and info_T
    return minari.data_collector.EpisodeBuffer(
        observations=steps[OBSERVATION],
        actions=jax.tree.map(head, steps[ACTION]),
        rewards=head(steps[REWARD]),
        terminations=head(steps[TERMINATED]),
        truncations=head(steps[TRUNCATED]),
        infos=steps.get(INFO, {}),
    )


def to_minari(
    source: Dataset | AbstractTrajectoryBuffer,
    dataset_id: str,
    *,
    env: Any = None,
    observation_space: Any = None,
    action_space: Any = None,
    data_format: str | None = None,
    episodes_per_write: int = 64,
    read_length: int = 4096,
    progress: bool = True,
    **metadata: Any,
) -> MinariWritten:
    """Write the episodes of a `Dataset` or a trajectory buffer out as a new Minari dataset
    `dataset_id` (in Minari's dataset root, `MINARI_DATASETS_PATH`), the inverse of
    `from_minari`: a Minari dataset read in and written out is the same, field by field,
    episode by episode.

    The steps must have `from_minari`'s layout (`dx.minari_spec`): each env's stream is a
    run of episodes, each ending with its reset step (`"valid"` `False`, holding the final
    observation and info) after a step that terminates or truncates it. The reset step's
    action and reward are not written (Minari has no place for them). Episodes are written
    in turns over the envs (the first of env 0, of env 1, ..., then the second of each), which
    restores the order `from_minari` read them in.

    What is not written is reported in the result's `left_out`, never dropped in silence: the
    steps of an episode still running at the end of a stream, and, in a stream that does not
    start at step 0 (a buffer that has overwritten its oldest steps, a dataset written from
    one), the steps up to its first reset step, whose episode may have lost its start.

    Steps are read `read_length` per env at a time and written `episodes_per_write` episodes
    at a time; image observations are written without JPEG encoding, so nothing is lost.

    **Arguments:**

    - `env`: the environment (a `gym.Env`, its id or `EnvSpec`) recorded with the dataset; or
    - `observation_space`, `action_space`: the spaces, which `env` otherwise provides. The
        steps' observations and actions must have their structure and shapes.
    - `data_format`: Minari's storage format (`None`: Minari's default, HDF5).
    - `**metadata`: passed to `minari.create_dataset_from_buffers` (`author`,
        `algorithm_name`, `description`, ...); Minari warns about each one left out.

    **Returns:** a `MinariWritten`: the Minari dataset, the episodes written per env, and what
    was left out.

    **Raises:** `ValueError`/`TypeError` naming the field if the steps do not have the layout
    or do not fit the spaces, or naming the step where a stream breaks the layout (an end
    flag not followed by a reset step, a reset step after a step that ends nothing). The
    Minari dataset made so far is removed then.
    """
    call = "to_minari"
    minari = _import("minari", call)
    per_write = check_positive_int(episodes_per_write, f"{call}(episodes_per_write=...)")
    read_length = check_positive_int(read_length, f"{call}(read_length=...)")
    progress = check_bool(progress, f"{call}(progress=...)")
    spec, streams = _streams_of(source, call)
    _check_layout(spec, call)
    if env is not None and (observation_space is None or action_space is None):
        gym = _import("gymnasium", call)
        made = gym.make(env) if isinstance(env, str | gym.envs.registration.EnvSpec) else env
        observation_space = observation_space or made.observation_space
        action_space = action_space or made.action_space
    if observation_space is None or action_space is None:
        raise ValueError(
            f"`{call}`: Minari needs the observation and action spaces; pass `env`, or both "
            "`observation_space` and `action_space`."
        )
    _check_space(observation_space, spec[OBSERVATION], OBSERVATION, call)
    _check_space(action_space, spec[ACTION], ACTION, call)
    out = minari.create_dataset_from_buffers(
        dataset_id,
        [],
        env=env,
        observation_space=observation_space,
        action_space=action_space,
        data_format=data_format,
        jpeg_encoding=False,
        **metadata,
    )
    readers = [_Episodes(s, spec, read_length, call) for s in streams]
    episodes = np.zeros(len(streams), np.int64)
    bar = _progress(None, progress, "to Minari")
    batch: list = []
    try:
        # In turns over the envs: the order `from_minari` assigns episodes in.
        turns = [(r.stream.env, iter(r)) for r in readers]
        while turns:
            alive = []
            for e, it in turns:
                steps = next(it, None)
                if steps is None:
                    continue
                alive.append((e, it))
                batch.append(_episode_buffer(minari, steps))
                episodes[e] += 1
                if len(batch) == per_write:
                    out.update_dataset_from_buffer(batch)
                    if bar is not None:
                        bar.update(len(batch))
                    batch = []
            turns = alive
        if batch:
            out.update_dataset_from_buffer(batch)
    except BaseException:
        shutil.rmtree(out.storage.data_path.parent, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    left_out = [run for r in readers for run in r.left_out]
    return MinariWritten(out, episodes, left_out)
