"""A random-access source of a `Dataset`'s windows, for grain (`RandomAccessDataSource`).

grain's protocol is structural (`__len__`, `__getitem__`, and `__repr__` for its
checkpoints), so nothing here imports grain. Workers get the source by pickling: it carries
the dataset's path, step spec, window and the steps it enumerated, and each process opens the
dataset again on its first read.
"""

import os
import threading
from typing import Any, cast

import jax
import numpy as np
from jaxtyping import PyTree

from ._checks import pick_leaf
from ._dataset import Dataset, dataset_of
from ._dataset_files import TIME_AXIS
from ._sequences import whole_windows
from ._windows import as_window, Window


class WindowSource:
    """The windows of a `Dataset` as a random-access source of records, for grain's
    `MapDataset.source` or `DataLoader(data_source=...)`: grain's deterministic,
    checkpointable, multi-process shuffling over offline data.

    Record `i` is the `i`-th window the window law admits, counted env by env, then start by
    start: on each env, every start on a multiple of `window.period` (absolute step numbers)
    whose window holds all `W = burn_in + sequence_length + bootstrap` steps (a strict
    window) or at least `burn_in + 1` (a window that is not strict; the steps past the env's
    last are masked). These are the windows `TrajectoryBuffer.sample` draws from with the same
    window (and, strict, `Dataset.sample`), and they are masked alike at episode ends.

    The windows are those of the steps the dataset held when the source was made: a dataset
    that grows later keeps the source's length, so a sampler's indices keep their meaning.

    A record is a dict of NumPy arrays with `SequenceSample`'s fields for one window:
    `"items"` (the steps, leaves `(W, *leaf_shape)`, with the dataset's dtypes, masked steps
    zero), `"mask"` and `"learn"` (bool `(W,)`), `"env"` and `"start"` (int32 scalars: the
    window's stamp). grain batches them into `(batch, W, ...)`.

    The source pickles without the open dataset (its path, spec and window, and the envs'
    step ranges); each process opens the dataset by path on its first read.

    !!! Example

        ```python
        import tempfile
        import grain
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(3), "done": jnp.zeros((), bool)}
        dataset = dx.Dataset.create(tempfile.mkdtemp() + "/d", step, num_envs=2)
        dataset.append({"obs": np.ones((2, 40, 3), np.float32), "done": np.zeros((2, 40), bool)})
        source = dx.WindowSource(dataset, dx.Window(8, period=4, strict=True))
        assert len(source) == 2 * 9  # starts 0, 4, ..., 32 of each env
        batches = grain.MapDataset.source(source).shuffle(seed=0).batch(6)
        assert batches[0]["items"]["obs"].shape == (6, 8, 3)
        ```
    """

    def __init__(self, dataset: Dataset | str | os.PathLike, window: Window, *, like: Any = None):
        """**Arguments:**

        - `dataset`: a `Dataset`, or the path of one (then `like` is its step prototype or a
            buffer, as for `Dataset.open`).
        - `window`: a `dx.Window`, checked against the steps (its `done` leaves).

        **Raises:** as `Dataset.open`, `TypeError` for a `window` that is not a `Window`,
        `ValueError` for one whose `done` does not name bool leaves of the steps.
        """
        call = "WindowSource"
        opened = dataset_of(dataset)
        if opened is None:
            if like is None:
                raise TypeError(
                    f"`{call}`: a dataset given by path needs `like` (its step prototype, or a "
                    "buffer), as `Dataset.open` does."
                )
            opened = Dataset.open(cast(str | os.PathLike, dataset), like)
        elif like is not None:
            raise ValueError(f"`{call}(like=...)` is for a dataset given by path; leave it out.")
        dataset = opened
        window = as_window(window, {}, f"{call}(window=...)")
        window.check(dataset.item_spec, TIME_AXIS, call)
        window.refuse_episode_starts(call)
        self._path = dataset.path
        self._spec = dataset.item_spec
        self._window = window
        self._ends = dataset.ends.copy()
        law = window.law
        need = law.size if law.strict else law.min_real
        self._first, self._number = whole_windows(dataset.starts, self._ends, need, law.period)
        self._cumulative = np.cumsum(self._number)
        self._dataset: Dataset | None = dataset
        self._lock = threading.Lock()

    @property
    def window(self) -> Window:
        return self._window

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as the dataset's."""
        return self._spec

    def __len__(self) -> int:
        return int(self._cumulative[-1]) if self._cumulative.size else 0

    def __repr__(self) -> str:
        # grain's checkpoints record this: it names the data and the enumeration.
        return (
            f"WindowSource({str(self._path)!r}, {self._window!r}, windows={len(self)}, "
            f"ends={self._ends.tolist()})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_dataset"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _open(self) -> Dataset:
        with self._lock:
            if self._dataset is None:
                self._dataset = Dataset.open(self._path, self._spec)
            return self._dataset

    def stamp(self, index: int) -> tuple[int, int]:
        """`(env, start)` of record `index`: the window's env and first step."""
        n = len(self)
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"`WindowSource`: an index must be an int, got {index!r}.")
        if not -n <= index < n:
            raise IndexError(f"`WindowSource`: index {index} is out of range for {n} windows.")
        index = int(index) % n
        env = int(np.searchsorted(self._cumulative, index, side="right"))
        before = int(self._cumulative[env] - self._number[env])
        return env, int(self._first[env] + (index - before) * self._window.period)

    def __getitem__(self, index: int) -> dict[str, Any]:
        env, start = self.stamp(index)
        w = self._window
        stop = min(start + w.size, int(self._ends[env]))
        read = self._open().read(env, start, stop)
        real = stop - start

        def padded(x: np.ndarray) -> np.ndarray:
            out = np.zeros((w.size, *x.shape[1:]), x.dtype)
            out[:real] = x
            return out

        items = jax.tree.map(padded, read)
        t = np.arange(w.size)
        mask = t < real
        if w.done:
            ends = np.logical_or.reduce([np.asarray(pick_leaf(items, d)) for d in w.done]) & mask
            mask &= ~episode_cut(ends, w.burn_in, w.episode_ends)

        def zeroed(x: np.ndarray) -> np.ndarray:
            return np.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, np.zeros_like(x))

        learning = (t >= w.burn_in) & (t < w.burn_in + w.sequence_length)
        return {
            "items": jax.tree.map(zeroed, items),
            "mask": mask,
            "learn": mask & learning,
            "env": np.int32(env),
            "start": np.int32(start),
        }


def episode_cut(ends: np.ndarray, burn_in: int, policy: str) -> np.ndarray:
    """NumPy's form of the `episode_ends` policy for one window (`_windows._cut`, which
    `mask_windows` applies to a batch on the device; the tests hold the two equal): the steps
    after the first end at or past the learning part, and (`"within"`) those up to the last
    end inside the burn-in."""
    t = np.arange(ends.shape[0])
    late = ends & (t >= burn_in)
    cut = np.cumsum(late) > late
    if policy == "within":
        early = ends & (t < burn_in)
        cut |= np.cumsum(early[::-1])[::-1] > 0
    return cut
