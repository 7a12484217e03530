"""The files of a `Dataset`: its manifest, its zarr arrays, the priority segments and the
writer's lock. `Dataset` (`_dataset.py`) decides what to write; this module knows how it is
laid out on disk, checks what it reads, and turns tensorstore's errors into ours.

Layout of a dataset directory (format 2):

- `manifest.json`: the commit record (see `Manifest`). JSON with sorted keys, one key per
    line, and a `checksum` field: the SHA-256 of the canonical JSON (sorted keys, no spaces)
    of everything else. A reader refuses a manifest whose bytes are not exactly what
    `encode` makes of its contents, so any changed bit is refused.
- `leaves/<i>/`: one zarr v3 array per leaf of a step, `(num_envs, 2**31 - 1, *leaf_shape)`,
    chunked `(1, chunk_length, *leaf_shape)`, every chunk followed by its CRC-32C (zarr's
    `crc32c` codec), which tensorstore checks on every read. Every chunk inside the committed
    range exists (`store_data_equal_to_fill_value`), so a missing one is refused
    (`fill_missing_data_reads: false`), never read as zeros.
- `priorities/<n>/`: a priority segment, written by the prioritised write that committed
    as write number `n`: row `e` holds, densely, the masses of the windows the buffer held
    for env `e`, `first[e], first[e] + period, ...` (`count[e]` of them). A window's mass is
    that of the newest segment holding it. A new write never touches an older segment, so a
    write killed before its commit leaves every committed mass as it was.
- `writer.lock`: the file a writer holds an exclusive OS lock on (`WriterLock`).

The SHA-256 of every array's `zarr.json` is in the manifest (`digests`) and checked before
tensorstore opens the array.

Format 1 (dejax_eqx 0.1) had no checksums: no `checksum` in the manifest, no digests, no
`crc32c` codec, chunks equal to the fill value not stored (so a missing chunk is read as the
fill value, as it always was), and one `priority/` array holding masses at the windows' first
steps, NaN elsewhere. Such a dataset opens and reads (its `priority/` array is read as the
only segment), and refuses writes.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import re
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import PyTree

from ._checks import INT32_MAX
from ._io import replace_atomically


FORMAT = 2
MANIFEST = "manifest.json"
LOCK = "writer.lock"
TIME_AXIS = INT32_MAX  # as many steps as an env's int32 step count can number
_LEGACY_PRIORITY = "priority"  # format 1's one array of masses
_SEGMENT = re.compile(r"priorities/(0|[1-9][0-9]*)")
_PRIORITY_KEYS = {"priority_exponent", "period", "window", "max_priority"}
_LIMITER_KEYS = {"inserts", "samples"}
_OPTIONAL = {"limiter"}  # keys a manifest may leave out
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def tensorstore():
    try:
        import tensorstore
    except ImportError as error:  # pragma: no cover - the tests install it
        raise ImportError(
            "`dejax_eqx.Dataset` needs tensorstore: pip install tensorstore (or the "
            "`datasets` extra of dejax_eqx)."
        ) from error
    return tensorstore


def describe(spec: PyTree[jax.ShapeDtypeStruct]) -> list[dict]:
    return [
        {"path": keystr(path), "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
        for path, leaf in tree_flatten_with_path(spec)[0]
    ]


def leaves_text(leaves: list[dict]) -> str:
    return "{" + ", ".join(f"{x['path']}: {x['dtype']}{tuple(x['shape'])}" for x in leaves) + "}"


# ---------------------------------------------------------------------------------------------
# The manifest


@dataclasses.dataclass
class Manifest:
    num_envs: int
    chunk_length: int
    leaves: list[dict]
    start: list[int]  # per env: the absolute step number of its first stored step
    length: list[int]  # per env: the number of stored steps
    writes: int = 0  # commits so far: names the next priority segment
    # From a PrioritisedTrajectoryBuffer: {"priority_exponent", "period", "window",
    # "max_priority"}; None until one is written.
    priorities: dict | None = None
    # The priority segments, oldest first: {"name", "first", "count"}.
    segments: list[dict] = dataclasses.field(default_factory=list)
    # The SHA-256 of each array's zarr.json, by directory ("leaves/0", "priorities/3").
    digests: dict[str, str] = dataclasses.field(default_factory=dict)
    format: int = FORMAT  # what the file on disk is; only format 2 is ever written
    # The counts of a `RateLimited`'s limiter as of the last write, if it was from one:
    # {"inserts", "samples"}. Optional in the file (absent when None), so that a dataset
    # written without counts has the bytes it had before there were any.
    limiter: dict | None = None

    def body(self) -> dict:
        out = dataclasses.asdict(self)
        if out["limiter"] is None:
            del out["limiter"]
        return out | {"format": FORMAT, "library": importlib.metadata.version("dejax_eqx")}


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(manifest: Manifest) -> bytes:
    """The bytes of `manifest.json`: its body and the body's checksum."""
    return _encode(manifest.body())


def _encode(body: dict) -> bytes:
    checksum = hashlib.sha256(_canonical(body)).hexdigest()
    return (json.dumps(body | {"checksum": checksum}, indent=1, sort_keys=True) + "\n").encode()


def _bad(call: str, file: Path, detail: str) -> ValueError:
    return ValueError(f"`{call}`: {str(file)!r} is damaged or not a dataset manifest: {detail}.")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and math.isfinite(x)


def _ints(value: Any, key: str, n: int, call: str, file: Path) -> list[int]:
    if not (isinstance(value, list) and len(value) == n and all(_is_int(x) for x in value)):
        raise _bad(call, file, f"`{key}` must be a list of {n} ints, one per env, got {value!r}")
    negative = [e for e, x in enumerate(value) if x < 0]
    if negative:
        e = negative[0]
        raise _bad(call, file, f"env {e}'s `{key}` is {value[e]}; it must be >= 0")
    return value


def parse_manifest(data: bytes, file: Path, call: str) -> Manifest:
    """The manifest in `data`, the bytes of `file`, checked whole: its checksum (format 2),
    its types, and what must hold between its fields. Raises a `ValueError` naming `file`."""
    if not data:
        raise _bad(call, file, "it is empty")
    try:
        raw = json.loads(data)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise _bad(call, file, f"it is not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise _bad(call, file, f"it holds a JSON {type(raw).__name__}, not an object")
    if "checksum" in raw:  # before anything else: a changed bit anywhere is reported as such
        body = {k: v for k, v in raw.items() if k != "checksum"}
        try:
            expected = hashlib.sha256(_canonical(body)).hexdigest()
        except ValueError:  # NaN or infinity, which the writer never writes
            expected = None
        if raw["checksum"] != expected:
            raise _bad(call, file, "its SHA-256 checksum does not match its contents")
        if data != _encode(body):
            raise _bad(call, file, "its bytes are not those dejax_eqx writes for its contents")
    version = raw.get("format")
    if not _is_int(version) or version not in (1, FORMAT):
        raise ValueError(
            f"`{call}`: {str(file)!r} has format {version!r}; this version reads formats 1 "
            f"and {FORMAT}."
        )
    if version == FORMAT and "checksum" not in raw:
        raise _bad(call, file, "it has no checksum")
    keys = {f.name for f in dataclasses.fields(Manifest)} | {"library"}
    if version == 1:
        keys -= {"segments", "digests", *_OPTIONAL}
    else:
        keys |= {"checksum"}
    missing, unknown = sorted(keys - raw.keys() - _OPTIONAL), sorted(raw.keys() - keys)
    if missing or unknown:
        what = f"it lacks {missing}" if missing else f"it has unknown keys {unknown}"
        raise _bad(call, file, what)
    if not isinstance(raw["library"], str):
        raise _bad(call, file, f"`library` must be a string, got {raw['library']!r}")
    fields = {k: raw[k] for k in keys - {"library", "checksum"} if k in raw}
    _check_fields(types.SimpleNamespace(**fields), call, file)  # before trusting their types
    manifest = Manifest(**fields)
    if version == 1:
        manifest.segments = _legacy_segments(manifest)
    return manifest


def _check_fields(m: Any, call: str, file: Path) -> None:
    for key in ("num_envs", "chunk_length"):
        value = getattr(m, key)
        if not _is_int(value) or not 1 <= value <= INT32_MAX:
            raise _bad(call, file, f"`{key}` must be an int in [1, 2**31 - 1], got {value!r}")
    if not _is_int(m.writes) or m.writes < 0:
        raise _bad(call, file, f"`writes` must be an int >= 0, got {m.writes!r}")
    start = _ints(m.start, "start", m.num_envs, call, file)
    length = _ints(m.length, "length", m.num_envs, call, file)
    over = [e for e in range(m.num_envs) if start[e] + length[e] > INT32_MAX]
    if over:
        e = over[0]
        raise _bad(call, file, f"env {e} ends at step {start[e] + length[e]}, past 2**31 - 1")
    if not isinstance(m.leaves, list) or not m.leaves:
        raise _bad(call, file, f"`leaves` must be a non-empty list, got {m.leaves!r}")
    for i, leaf in enumerate(m.leaves):
        if not _is_leaf(leaf):
            raise _bad(
                call,
                file,
                f"leaf {i} must be {{path: a string, shape: a list of ints >= 0, dtype: a "
                f"NumPy dtype name}}, got {leaf!r}",
            )
    _check_priorities(m, call, file)
    _check_limiter(vars(m).get("limiter"), call, file)
    if m.format == FORMAT:
        _check_segments(m, call, file)
        names = [f"leaves/{i}" for i in range(len(m.leaves))] + [s["name"] for s in m.segments]
        ok = isinstance(m.digests, dict) and set(m.digests) == set(names)
        if not ok or not all(_is_digest(x) for x in m.digests.values()):
            raise _bad(call, file, f"`digests` must map {names} to SHA-256 digests")


def _is_leaf(leaf: Any) -> bool:
    if not (isinstance(leaf, dict) and set(leaf) == {"path", "shape", "dtype"}):
        return False
    shape, dtype = leaf["shape"], leaf["dtype"]
    if not isinstance(leaf["path"], str) or not isinstance(shape, list):
        return False
    if not all(_is_int(x) and x >= 0 for x in shape) or not isinstance(dtype, str):
        return False
    try:
        return np.dtype(dtype).name == dtype and np.dtype(dtype).kind in "biufc"
    except TypeError:
        return False


def _is_digest(x: Any) -> bool:
    return isinstance(x, str) and re.fullmatch(r"[0-9a-f]{64}", x) is not None


def _check_priorities(m: Any, call: str, file: Path) -> None:
    p = m.priorities
    if p is None:
        return
    ok = isinstance(p, dict) and set(p) == _PRIORITY_KEYS
    ok = ok and _is_real(p["priority_exponent"]) and _is_real(p["max_priority"])
    ok = ok and _is_int(p["period"]) and _is_int(p["window"])
    if not ok or p["period"] < 1 or p["window"] < 1 or p["max_priority"] < 0:
        raise _bad(
            call,
            file,
            "`priorities` must be null or {priority_exponent: a finite number, period: an "
            f"int >= 1, window: an int >= 1, max_priority: a finite number >= 0}}, got {p!r}",
        )


def _check_limiter(counts: Any, call: str, file: Path) -> None:
    if counts is None:
        return
    ok = isinstance(counts, dict) and set(counts) == _LIMITER_KEYS
    if not ok or not all(_is_int(x) and 0 <= x < 2**63 for x in counts.values()):
        raise _bad(
            call,
            file,
            "`limiter` must be absent or {inserts: an int in [0, 2**63), samples: an int in "
            f"[0, 2**63)}}, got {counts!r}",
        )


def _check_segments(m: Any, call: str, file: Path) -> None:
    if not isinstance(m.segments, list):
        raise _bad(call, file, f"`segments` must be a list, got {m.segments!r}")
    if m.segments and m.priorities is None:
        raise _bad(call, file, "it lists priority segments but no `priorities`")
    names = set()
    for s in m.segments:
        ok = isinstance(s, dict) and set(s) == {"name", "first", "count"}
        if not ok or not isinstance(s["name"], str) or not _SEGMENT.fullmatch(s["name"]):
            raise _bad(call, file, f"a segment must be {{name, first, count}}, got {s!r}")
        if s["name"] in names:
            raise _bad(call, file, f"segment {s['name']!r} is listed twice")
        names.add(s["name"])
        assert m.priorities is not None
        first = _ints(s["first"], "first", m.num_envs, call, file)
        count = _ints(s["count"], "count", m.num_envs, call, file)
        period, size = m.priorities["period"], m.priorities["window"]
        for e in range(m.num_envs):
            last_end = first[e] + (count[e] - 1) * period + size
            inside = m.start[e] <= first[e] and last_end <= m.start[e] + m.length[e]
            if count[e] and (first[e] % period or not inside):
                raise _bad(
                    call,
                    file,
                    f"segment {s['name']!r} holds windows of env {e} that are not whole "
                    "windows of its stored steps",
                )


def _legacy_segments(m: Manifest) -> list[dict]:
    """Format 1's priority array, read as one segment (masses at steps, NaN elsewhere)."""
    if m.priorities is None:
        return []
    return [{"name": _LEGACY_PRIORITY, "first": m.start, "count": m.length}]


def digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def check_digest(path: Path, name: str, expected: str, call: str) -> None:
    file = path / name / "zarr.json"
    try:
        found = digest(file)
    except FileNotFoundError:
        raise ValueError(f"`{call}`: {str(file)!r} is missing.") from None
    if found != expected:
        raise ValueError(
            f"`{call}`: {str(file)!r} is damaged: its SHA-256 is not the one "
            f"{MANIFEST} records for it."
        )


# ---------------------------------------------------------------------------------------------
# tensorstore: specs, errors


def _metadata(shape: list[int], chunk: list[int], dtype: str, fill: Any = None) -> dict:
    out: dict[str, Any] = {
        "shape": shape,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "data_type": dtype,  # zarr v3 names dtypes as NumPy does
        "codecs": _CODECS,
    }
    return out if fill is None else out | {"fill_value": fill}


def _spec(path: Path, name: str, **options: Any) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}, **options}


def store_error(error: Exception, path: Path, call: str) -> Exception:
    """tensorstore's error, as ours: a `ValueError` for damage (a failed checksum, a chunk
    that is missing, truncated or cannot be decoded), an `OSError` for anything else; both
    name the dataset and, where tensorstore says it, the file."""
    text = str(error)
    match = re.search(r'local file "([^"]+)"(?:: )?(.*)', text)
    where = f"the dataset {str(path)!r}"
    if match:
        file = Path(match.group(1))
        name = file.relative_to(path) if file.is_relative_to(path) else file
        where = f"{str(name)!r} of the dataset {str(path)!r}"
    if text.startswith("DATA_LOSS") and "Digest mismatch" in text:
        return ValueError(
            f"`{call}`: {where} is damaged: its checksum (CRC-32C) does not match its bytes, "
            "which changed after they were written."
        )
    if text.startswith("NOT_FOUND") and "is missing" in text:
        return ValueError(
            f"`{call}`: {where} is damaged: the chunk is missing, though it holds committed data."
        )
    if match and text.startswith(("DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT")):
        detail = match.group(2).split(" [")[0]  # without tensorstore's spec
        return ValueError(f"`{call}`: {where} is damaged: it cannot be decoded ({detail}).")
    return OSError(f"`{call}`: tensorstore failed on {where}: {text}")


def wait(futures: list, path: Path, call: str) -> list:
    """The results of tensorstore futures; its errors as ours (`store_error`)."""
    try:
        return [f.result() for f in futures]
    except ValueError as error:  # tensorstore's errors are ValueErrors
        raise store_error(error, path, call) from None


class Files:
    """The arrays of a dataset: the leaves (opened now), the priority segments (opened when
    first read), and the reads and writes of their chunks."""

    def __init__(self, path: Path, manifest: Manifest, sync: bool, call: str):
        ts = tensorstore()
        self._path = path
        self._context = ts.Context({"file_io_sync": sync})
        self._legacy = manifest.format == 1
        self._segments: dict[str, Any] = {}
        names = [f"leaves/{i}" for i in range(len(manifest.leaves))]
        self._leaf_ndims = [len(x["shape"]) for x in manifest.leaves]
        self._chunk = manifest.chunk_length
        for name, expected in manifest.digests.items():  # the segments' too: all damage
            check_digest(path, name, expected, call)  # to metadata is found on opening
        opened = [ts.open(self._read_spec(name), context=self._context) for name in names]
        self.leaves = wait(opened, path, call)

    def _read_spec(self, name: str) -> dict:
        if self._legacy:  # format 1 left chunks equal to the fill value unwritten
            return _spec(self._path, name, open=True)
        options = {"fill_missing_data_reads": False, "store_data_equal_to_fill_value": True}
        return _spec(self._path, name, open=True, **options)

    @staticmethod
    def create(path: Path, manifest: Manifest) -> dict[str, str]:
        """Make the leaf arrays of a new dataset; their `zarr.json` digests."""
        ts = tensorstore()
        out = {}
        for i, leaf in enumerate(manifest.leaves):
            chunk = [1, manifest.chunk_length, *leaf["shape"]]
            shape = [manifest.num_envs, TIME_AXIS, *leaf["shape"]]
            metadata = _metadata(shape, chunk, leaf["dtype"])
            ts.open(_spec(path, f"leaves/{i}", metadata=metadata, create=True)).result()
            out[f"leaves/{i}"] = digest(path / f"leaves/{i}" / "zarr.json")
        return out

    def read(self, env: int, lo: int, hi: int, call: str) -> list[np.ndarray]:
        """Positions `lo .. hi - 1` of env `env`'s row of every leaf."""
        return wait([a[env, lo:hi].read() for a in self.leaves], self._path, call)

    def read_points(self, rows: np.ndarray, offsets: np.ndarray, call: str) -> list[np.ndarray]:
        return wait([a.vindex[rows, offsets].read() for a in self.leaves], self._path, call)

    def write(self, lengths: np.ndarray, per_env: dict[int, list[np.ndarray]], call: str) -> None:
        """Write each env's new steps past its committed end (`lengths`), all chunks
        concurrently. A chunk that holds committed steps and is missing is refused first:
        tensorstore would fill it with the fill value before writing the new steps into it."""
        for e in per_env:
            if lengths[e] % self._chunk:
                self._check_chunk(e, int(lengths[e]) // self._chunk, call)
        futures = []
        for e, leaves in per_env.items():
            at = int(lengths[e])
            for array, x in zip(self.leaves, leaves):
                futures.append(array[e, at : at + x.shape[0]].write(x))
        wait(futures, self._path, call)

    def _check_chunk(self, env: int, k: int, call: str) -> None:
        for i, ndim in enumerate(self._leaf_ndims):
            key = "/".join([f"leaves/{i}", "c", str(env), str(k), *["0"] * ndim])
            if not (self._path / key).is_file():
                raise ValueError(
                    f"`{call}`: {key!r} of the dataset {str(self._path)!r} is damaged: the "
                    f"chunk is missing, though it holds committed steps of env {env}. Nothing "
                    "was written."
                )

    def write_segment(
        self, name: str, windows: dict[int, np.ndarray], num_envs: int, call: str
    ) -> str:
        """Make the priority segment `name` holding `windows[e]` (masses, densely) for each
        env listed; any uncommitted array of that name left by a killed write is replaced.
        Returns its `zarr.json` digest."""
        ts = tensorstore()
        width = max(x.size for x in windows.values())
        chunk = [1, min(width, self._chunk)]
        metadata = _metadata([num_envs, width], chunk, "float32", "NaN")
        options = {"create": True, "delete_existing": True, "metadata": metadata}
        spec = _spec(self._path, name, store_data_equal_to_fill_value=True, **options)
        (array,) = wait([ts.open(spec, context=self._context)], self._path, call)
        wait([array[e, : x.size].write(x) for e, x in windows.items()], self._path, call)
        return digest(self._path / name / "zarr.json")

    def masses(self, manifest: Manifest, env: int, starts: np.ndarray, call: str) -> np.ndarray:
        """The stored mass of the window of env `env` starting at each of `starts`: that of
        the newest segment holding it; NaN where none does."""
        out = np.full(starts.shape, np.nan, np.float32)
        todo = np.ones(starts.shape, bool)
        stride = 1 if self._legacy else (manifest.priorities or {}).get("period", 1)
        for segment in reversed(manifest.segments):
            first, count = segment["first"][env], segment["count"][env]
            index = (starts - first) // stride
            held = todo & ((starts - first) % stride == 0) & (index >= 0) & (index < count)
            if held.any():
                array = self._segment(segment["name"], call)
                (out[held],) = wait([array[env].vindex[index[held]].read()], self._path, call)
            todo &= ~held
        return out

    def _segment(self, name: str, call: str) -> Any:
        if name not in self._segments:  # its digest was checked on opening
            # In format 1, a chunk without a mass was never written, and reads as NaN.
            opened = [tensorstore().open(self._read_spec(name), context=self._context)]
            (self._segments[name],) = wait(opened, self._path, call)
        return self._segments[name]


# ---------------------------------------------------------------------------------------------
# The writer's lock


def _try_lock(fd: int) -> bool:
    """An exclusive, non-blocking OS lock on the open file `fd`: whether it was taken."""
    if sys.platform == "win32":  # pragma: no cover - not tested here
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    # flock, not lockf: flock locks conflict between two open files of one process too, so
    # two Dataset objects in one process exclude each other.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class WriterLock:
    """An exclusive OS lock on a dataset's `writer.lock`, held until `release()`, until this
    object is garbage collected, or until its process ends (the OS releases it then, also
    after `SIGKILL`)."""

    def __init__(self, path: Path, call: str):
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        if not _try_lock(fd):
            os.close(fd)
            raise RuntimeError(
                f"`{call}`: another writer holds {str(path)!r}: a Dataset object, in this "
                "process or another, has written to it and is not closed. One writer at a "
                "time: `close()` the other, or let its process end. Nothing was written."
            )
        self._release = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._release()


class Writer:
    """What makes a `Dataset` a safe writer: the lock, taken at its first write and held
    until `close()`, and the manifest's bytes as this writer last read or committed them,
    checked before each write and each commit so that a writer that has not seen the last
    commit never writes over it."""

    def __init__(self, path: Path, raw: bytes, sync: bool, version: int):
        self._path = path
        self._raw = raw
        self._sync = sync
        self._version = version  # of the dataset as opened
        self._lock: WriterLock | None = None

    def begin(self, call: str) -> None:
        """Before the first byte of a write: refuse a format-1 dataset, take the lock, and
        check that the manifest on disk is the one this writer knows."""
        if self._version != FORMAT:
            raise ValueError(
                f"`{call}`: {str(self._path)!r} is a format-{self._version} dataset "
                "(dejax_eqx 0.1), without checksums: it opens and reads, and takes no new "
                "steps. Copy it into a new dataset to go on writing: "
                "`Dataset.create(new_path, step, num_envs).write(old.load(like))` with a "
                "`like` whose max_length holds every env's steps."
            )
        if self._lock is None:
            self._lock = WriterLock(self._path, call)
        self._check_unchanged(call)

    def _check_unchanged(self, call: str) -> None:
        if (self._path / MANIFEST).read_bytes() != self._raw:
            self.close()  # this writer can never write again: let another take the lock
            raise RuntimeError(
                f"`{call}`: {str(self._path / MANIFEST)!r} changed since this Dataset read or "
                "committed it: another writer committed to the dataset. Nothing was written; "
                "open the dataset again to write to it."
            )

    def commit(self, manifest: Manifest, call: str) -> None:
        self._check_unchanged(call)
        self._raw = commit(self._path, manifest, self._sync)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def commit(path: Path, manifest: Manifest, sync: bool) -> bytes:
    """Replace the manifest atomically (`replace_atomically`: the fsyncs only with `sync`);
    the bytes written."""
    data = encode(manifest)
    replace_atomically(path / MANIFEST, lambda f: f.write(data), sync=sync)
    return data
