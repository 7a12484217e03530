"""Saving and loading buffers: one self-describing, self-checking file per buffer.

A file is, in order:

1. a fixed prefix: the magic bytes `DEJAXEQX`, the format version (uint32, little-endian) and
    the length of the header (uint64);
2. the header: UTF-8 JSON describing what was saved (see `_describe`);
3. the payload: the array leaves in flattening order, each in NumPy's `.npy` format, as written
    by `eqx.tree_serialise_leaves`;
4. the SHA-256 digest of everything before it (32 bytes).

Nothing here knows about particular buffer types: the header is derived from the module's
classes, its static fields and its leaves, so every `eqx.Module` buffer (and a batch of them made
with `eqx.filter_vmap`) is covered as soon as it exists.
"""

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import stat
import struct
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol, runtime_checkable, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path
from jaxtyping import PyTree

from ._results import check_results


_T = TypeVar("_T")


@runtime_checkable
class _Writer(Protocol):
    def write(self, data: bytes, /) -> int: ...


@runtime_checkable
class _Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


_MAGIC = b"DEJAXEQX"
# 1: dejax_eqx 0.1. 2: dejax_eqx 0.2, the same bytes, but the fields of `TrajectoryBuffer`,
# `PrioritisedTrajectoryBuffer`, `TrajectoryQueue` and `PrioritisedReplay` moved into new
# submodules, so a version-1 file of one of those no longer matches any `like`. `load` still
# reads a version-1 file that matches `like` (the types whose layout did not change).
_FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sIQ")  # magic, format version, header length in bytes
_DIGEST_SIZE = hashlib.sha256().digest_size  # 32
_CHUNK = 1 << 24  # bytes hashed at a time when verifying a file


# ---------------------------------------------------------------------------------------------
# Describing a tree: the header


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _encode(value: Any) -> Any:
    """A JSON value standing for a static field (or another non-array leaf).

    Two values are taken to be the same when their encodings are. Plain data (numbers, strings,
    `None`, lists, tuples and dicts of them) is encoded as itself; a callable by its qualified
    name (the function itself is not saved: on load it comes from `like`); anything else by its
    `repr`, or by its type when the `repr` is the default one, which holds a memory address.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if callable(value):
        named = hasattr(value, "__qualname__") and hasattr(value, "__module__")
        return {"callable": _qualified_name(value if named else type(value))}
    if type(value).__repr__ is object.__repr__:
        return {"object": _qualified_name(type(value))}
    return {"repr": repr(value)}


def _canonical(encoded: Any) -> str:
    return json.dumps(encoded, sort_keys=True)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _statics(tree: PyTree, prefix: str, modules: dict, statics: dict) -> None:
    """Record the class of every module in `tree` and the value of every static field."""
    is_module = lambda x: isinstance(x, eqx.Module)
    for path, node in tree_flatten_with_path(tree, is_leaf=is_module)[0]:
        if not is_module(node):
            continue
        where = prefix + keystr(path)
        modules[where] = _qualified_name(type(node))
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.metadata.get("static", False):
                statics[f"{where}.{field.name}"] = _encode(value)
            else:
                _statics(value, f"{where}.{field.name}", modules, statics)


def _describe(tree: PyTree, call: str) -> dict:
    """The header for `tree`: its module classes, static values and array leaves.

    Array leaves (JAX or NumPy arrays, or `jax.ShapeDtypeStruct`s in a template) are saved.
    Every other leaf is what `eqx.filter_jit` treats as static, and is handled like a static
    field: recorded, compared on load, and taken from `like`.
    """
    modules: dict[str, str] = {}
    statics: dict[str, Any] = {}
    _statics(tree, "", modules, statics)
    values: dict[str, Any] = {}
    leaves = []
    for path, leaf in tree_flatten_with_path(tree)[0]:
        name = keystr(path)
        if not _is_array(leaf):
            values[name] = _encode(leaf)
            continue
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"`{call}`: leaf `{name}` is a tracer; save and load work on concrete arrays, "
                "outside `jax.jit`."
            )
        entry = {"path": name, "shape": list(np.shape(leaf)), "dtype": str(leaf.dtype)}
        if _is_key(leaf):
            # Typed PRNG keys are stored as their raw key data, with the implementation's name.
            impl = leaf if isinstance(leaf, jax.Array) else jnp.zeros((), leaf.dtype)
            entry["key_impl"] = str(jax.random.key_impl(impl))
        leaves.append(entry)
    return {
        "type": _qualified_name(type(tree)),
        "modules": modules,
        "static": statics,
        "values": values,
        "leaves": leaves,
    }


def _differences(expected: dict, found: dict) -> list[str]:
    """Every way the header `found` (from the file) differs from `expected` (from `like`)."""
    if expected["type"] != found["type"]:
        return [f"type: expected {expected['type']} (from `like`), found {found['type']}"]
    out = []
    kinds = [("modules", "module"), ("static", "static value"), ("values", "non-array leaf")]
    for kind, label in kinds:
        want, got = expected[kind], found[kind]
        for where in sorted(want.keys() | got.keys(), key=str):
            if where not in got:
                out.append(f"{label} `{where}`: in `like` but not in the file")
            elif where not in want:
                out.append(f"{label} `{where}`: in the file but not in `like`")
            elif _canonical(want[where]) != _canonical(got[where]):
                out.append(
                    f"{label} `{where}`: expected {_canonical(want[where])} (from `like`), "
                    f"found {_canonical(got[where])}"
                )
    want_leaves = {leaf["path"]: leaf for leaf in expected["leaves"]}
    got_leaves = {leaf["path"]: leaf for leaf in found["leaves"]}
    for where, want in want_leaves.items():
        got = got_leaves.get(where)
        if got is None:
            out.append(f"leaf `{where}`: in `like` but not in the file")
            continue
        for field in ["shape", "dtype"]:
            if want[field] != got[field]:
                w, g = want[field], got[field]
                if field == "shape":
                    w, g = tuple(w), tuple(g)
                out.append(f"leaf `{where}`: expected {field} {w} (from `like`), found {g}")
    out.extend(
        f"leaf `{where}`: in the file but not in `like`"
        for where in got_leaves
        if where not in want_leaves
    )
    if not out and list(want_leaves) != list(got_leaves):
        out.append("the leaves are stored in a different order than `like` flattens to")
    return out


# ---------------------------------------------------------------------------------------------
# Leaves


def _write_leaf(file: _Writer, leaf: Any) -> None:
    """`filter_spec` for `eqx.tree_serialise_leaves`: arrays as `.npy`, other leaves skipped."""
    if not _is_array(leaf):
        return
    if isinstance(leaf, jax.Array) and _is_key(leaf):
        leaf = jax.random.key_data(leaf)
    # For a sharded array this copies every shard to the host: one array in host memory at a
    # time. The `.npy` format stores bfloat16 and other ml_dtypes as raw bytes ("V2"); the
    # header keeps the real dtype.
    np.save(file, np.asarray(leaf), allow_pickle=False)


def _storage_spec(leaf: Any) -> Any:
    """What `_write_leaf` writes for a template leaf, as a shape/dtype struct."""
    if not _is_array(leaf):
        return leaf
    if _is_key(leaf):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


def _read_leaf(file: _Reader, spec: Any) -> Any:
    """The inverse of `_write_leaf`, for a leaf whose template is `spec`."""
    if not isinstance(spec, jax.ShapeDtypeStruct):
        return spec
    array = np.load(file, allow_pickle=False)
    if array.dtype != spec.dtype and array.dtype.kind == "V":
        array = array.view(spec.dtype)
    if array.shape != spec.shape or array.dtype != spec.dtype:
        # The header said otherwise, and both are covered by the checksum: a bug, not bad luck.
        raise ValueError(
            f"the payload holds a {array.dtype}{list(array.shape)} array where the header "
            f"promised {spec.dtype}{list(spec.shape)}"
        )
    # A copy, on the default device: `jnp.asarray` may share an aligned NumPy array's memory
    # (jax 0.5.3 on CPU does), and a donated leaf that XLA cannot reuse is copied whole, with no
    # warning, at the first jitted step after `load`.
    return jnp.array(array)


# ---------------------------------------------------------------------------------------------
# Files


class _HashingWriter:
    """A write-only file wrapper that hashes everything written through it."""

    def __init__(self, file: _Writer):
        self._file = file
        self._hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        return self._file.write(data)

    def digest(self) -> bytes:
        return self._hash.digest()


def _new_file_mode(path: str) -> int:
    """The permissions `open(path, "w")` would leave (`mkstemp` makes files owner-only)."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0)  # the only portable way to read the umask is to set it
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable. Windows cannot open a directory (and NTFS journals the
    # rename), so there is nothing to do there.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(
    path: str | os.PathLike, write: Callable[[BinaryIO], object], *, sync: bool = True
) -> None:
    """Write the file at `path` all at once: readers see the old file or the new one, never
    a part of the new one.

    `write` writes the contents to a temporary file in the same directory, which is then
    flushed, `fsync`ed, given the permissions `open(path, "w")` would give it (those of the
    file it replaces, or the umask's for a new one) and renamed over `path`; the directory
    is `fsync`ed last, so that the rename itself survives a crash. If anything fails or is
    interrupted before the rename, the temporary file is removed and `path` is left as it
    was (absent, or the previous file).

    **Arguments:**

    - `path`: the file to write. An existing file is replaced.
    - `write`: called once with the temporary file, open for writing in binary mode. A text
        payload is written encoded: `lambda f: f.write(text.encode())`. Its return value is
        ignored.
    - `sync`: whether to `fsync` the file and the directory. Without it the rename is still
        atomic for readers, but a crash of the machine may leave the old file, or an empty
        or partly written new one.

    **Raises:** whatever `write` raises, and any `OSError` from the file system, after
    removing the temporary file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            if sync:
                os.fsync(file.fileno())
        os.chmod(temp, _new_file_mode(path))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if sync:
        _fsync_directory(directory)


def save(path: str | os.PathLike, buffer: PyTree) -> None:
    """Save a buffer to a file, atomically.

    Works for every buffer type, and for a batch of buffers made with `eqx.filter_vmap`
    (sharded or not). The file records the buffer's type, its static fields (capacities and
    other configuration) and the path, shape and dtype of every array, followed by the arrays
    themselves bit for bit and a checksum; see the "Save and load" docs page for the format.

    The write is atomic: the data goes to a temporary file in the same directory, which is
    flushed and `fsync`ed, then renamed over `path` (`replace_atomically`). If anything fails
    midway, `path` is left as it was (absent, or the previous save), and the temporary file is
    removed.

    Static fields that are functions (such as a user's `cluster_fn`) are recorded by their
    qualified name only: the function itself is not saved. `load` takes it from `like` and
    checks the name.

    **Arguments:**

    - `path`: where to write. Any name; an existing file is replaced.
    - `buffer`: the buffer (any `eqx.Module` of arrays). Arrays sharded over several devices
        are gathered to the host one leaf at a time; they must all be addressable from this
        process (in a multi-process run, save each process's part).

    **Raises:** `TypeError` inside `jax.jit` (the leaves must be concrete arrays), `ValueError`
    for an array spread over several processes, and any `OSError` from the file system.

    !!! Example

        ```python
        import os, tempfile
        import jax.numpy as jnp
        import dejax_eqx as dx

        buf = dx.UniformReplay({"obs": jnp.zeros(3)}, max_size=100)
        buf = buf.add_batch({"obs": jnp.ones((5, 3))})
        path = os.path.join(tempfile.mkdtemp(), "replay.dx")
        dx.save(path, buf)
        loaded = dx.load(path, like=dx.UniformReplay({"obs": jnp.zeros(3)}, max_size=100))
        assert int(loaded.size) == 5
        ```
    """
    call = "dx.save"
    check_results(buffer, call)  # a `throw=False` buffer's fault is refused
    header = _describe(buffer, call)  # every check happens before the disk is touched
    for path_, leaf in tree_flatten_with_path(buffer)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"`{call}`: leaf `{keystr(path_)}` spans devices of several processes; save "
                "each process's part instead (see the multi-host section of the sharding docs)."
            )
    header.update(
        written_by={
            name: importlib.metadata.version(name) for name in ["dejax_eqx", "jax", "equinox"]
        }
    )
    header_bytes = json.dumps(header, sort_keys=True, allow_nan=False).encode()

    def write(file: BinaryIO) -> None:
        out = _HashingWriter(file)
        out.write(_PREFIX.pack(_MAGIC, _FORMAT_VERSION, len(header_bytes)))
        out.write(header_bytes)
        eqx.tree_serialise_leaves(out, buffer, filter_spec=_write_leaf)
        file.write(out.digest())

    replace_atomically(path, write)


def _corrupt(call: str, detail: str) -> ValueError:
    return ValueError(f"`{call}`: {detail}; nothing was loaded.")


def _format_1_mismatch(call: str, name: str, differences: list[str]) -> ValueError:
    return ValueError(
        f"`{call}`: {name!r} was written by dejax_eqx 0.1 (format 1) and does not match "
        "`like`. The layout of `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`, "
        "`TrajectoryQueue` and `PrioritisedReplay` changed in dejax_eqx 0.2, so this version "
        "cannot load their 0.1 files. To carry a `TrajectoryBuffer` or "
        "`PrioritisedTrajectoryBuffer` over, load it with dejax_eqx 0.1, write it to a "
        "`dx.Dataset` with `Dataset.write`, and `Dataset.load` it with this version (datasets "
        "carry over unchanged); for a `TrajectoryQueue`, whose unread steps a dataset does not "
        "keep, read them with dejax_eqx 0.1 and add them to a new queue. To carry a "
        "`PrioritisedReplay` over, load it with dejax_eqx 0.1 and add its items, with their "
        "priorities, to a new one. The file differs from `like` in:\n"
        + "\n".join(f"  - {d}" for d in differences)
    )


def load(path: str | os.PathLike, like: _T) -> _T:
    """Load a buffer saved by `dx.save`.

    `like` supplies everything that is not data: the buffer's type, its static fields, the
    structure of its arrays, and any function-valued fields. It can be a freshly made buffer
    of the same configuration, or, to avoid allocating its arrays, the same made with
    `eqx.filter_eval_shape`. The file must match it exactly: same type, same static fields,
    same leaves with the same shapes and dtypes.

    Every array comes back as a `jax.Array` on the default device, whatever the layout it was
    saved from (a buffer saved from arrays sharded over four devices loads onto one). To
    shard it again, `jax.device_put` it, as when it was first made.

    The whole file is checked against its checksum before anything is read from it, so a
    truncated or corrupted file raises an error and never yields a partly filled buffer.

    Files written by dejax_eqx 0.1 (format 1) load when they match `like`: the bytes are laid
    out as before, and only the fields of `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`,
    `TrajectoryQueue` and `PrioritisedReplay` changed. A 0.1 file that does not match, as one
    of those four cannot, is refused with directions for carrying it over.

    **Arguments:**

    - `path`: a file written by `dx.save`.
    - `like`: a buffer (or batch of buffers, or `eqx.filter_eval_shape` of one) of the
        configuration that was saved.

    **Returns:** the saved buffer, of the same type as `like`.

    **Raises:** `ValueError` if the file is not a dejax_eqx save, is truncated or corrupted,
    has a format version this version cannot read, or does not match `like` (the message
    lists each differing field: type, static value, or leaf path with expected and found shape
    or dtype; for a 0.1 file it also says how to carry it over). `OSError` from the file
    system (`FileNotFoundError`, ...).
    """
    call = "dx.load"
    expected = _describe(like, call)
    name = os.fspath(path)
    with open(name, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(_PREFIX.size)
        head = prefix[: len(_MAGIC)]
        if head != _MAGIC[: len(head)]:
            raise ValueError(
                f"`{call}`: {name!r} is not a file written by `dx.save` (it does not start "
                f"with {_MAGIC!r})."
            )
        if size < _PREFIX.size + _DIGEST_SIZE:
            raise _corrupt(call, f"{name!r} is truncated: it has only {size} bytes")
        file.seek(0)
        digest = hashlib.sha256()
        remaining = size - _DIGEST_SIZE
        while remaining:
            chunk = file.read(min(_CHUNK, remaining))
            digest.update(chunk)
            remaining -= len(chunk)
        if digest.digest() != file.read(_DIGEST_SIZE):
            raise _corrupt(
                call,
                f"{name!r} is truncated or corrupted: the SHA-256 checksum of its {size} bytes "
                "does not match the one stored at its end",
            )
        _, version, header_size = _PREFIX.unpack(prefix)
        if version not in (1, _FORMAT_VERSION):
            raise ValueError(
                f"`{call}`: {name!r} has format version {version}; this version of dejax_eqx "
                f"reads versions 1 and {_FORMAT_VERSION} only."
            )
        file.seek(_PREFIX.size)
        try:
            found = json.loads(file.read(header_size))
            differences = _differences(expected, found)
        except (ValueError, KeyError, TypeError) as e:  # checksummed, but not by `dx.save`
            raise _corrupt(call, f"{name!r} has an unreadable header ({e!r})") from e
        if differences and version == 1:
            raise _format_1_mismatch(call, name, differences)
        if differences:
            raise ValueError(
                f"`{call}`: {name!r} does not match `like`:\n"
                + "\n".join(f"  - {d}" for d in differences)
            )
        # Read leaf by leaf (what `eqx.tree_serialise_leaves` wrote, in flattening order), so
        # that a payload that disagrees with its checksummed header is reported as it is, with
        # the leaf's path.
        flat, treedef = tree_flatten_with_path(like)
        leaves = []
        for key_path, leaf in flat:
            try:
                leaves.append(_read_leaf(file, _storage_spec(leaf)))
            except Exception as e:
                raise _corrupt(
                    call,
                    f"{name!r} has an inconsistent payload at leaf `{keystr(key_path)}`: {e}",
                ) from e
        tree = jax.tree.unflatten(treedef, leaves)
        if file.tell() != size - _DIGEST_SIZE:
            raise _corrupt(call, f"{name!r} has unexpected bytes after its last array")

    # Typed PRNG keys were stored as their key data. Loaded arrays are exactly the leaves that
    # are JAX arrays now (the others came from `like`), in the header's order.
    impls = iter([leaf.get("key_impl") for leaf in found["leaves"]])

    def restore(x):
        if not isinstance(x, jax.Array):
            return x
        impl = next(impls)
        return x if impl is None else jax.random.wrap_key_data(x, impl=impl)

    return jax.tree.map(restore, tree)
