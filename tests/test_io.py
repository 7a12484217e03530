"""`dx.save` / `dx.load`: bit-exact round trips, mismatched templates, damaged files, atomicity."""

import hashlib
import io
import json
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import dejax_eqx as dx
import dejax_eqx._io as dx_io
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from .helpers import assert_bits_equal, random_bits_batch, rotation, SPECS
from .registry import BUFFER_TYPES, BufferType, BY_NAME, make_batch, stack


# ---------------------------------------------------------------------------------------------
# The round trips (here, and on four devices in `test_sharding.py`) run over every buffer type of
# `tests/registry.py`: its `make` (also the template for `load`) and its `step`, one random
# operation that changes the contents. Each is also run as a batch of independent buffers (what
# `eqx.filter_vmap` makes), built by stacking.
#
# Few shapes, so that compiled operations are reused across examples: capacities 1 and 4, batches
# that fill part of a buffer or wrap around it, and item specs with every dtype that must survive
# bit for bit (bfloat16, float32 with NaN payloads, bool, uint32, int8).
MAX_SIZES = [1, 4]
SPEC_NAMES = ["nested", "tuple", "namedtuple"]
BUFFER_CASES = BUFFER_TYPES


def batch_step(case: BufferType, batch, spec, rng, copies: int):
    """`case.step` applied to every buffer of a batch, each with its own random items."""
    rows = [jax.tree.map(lambda x: x[i], batch) for i in range(copies)]
    return stack([case.step(row, spec, rng) for row in rows])


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("io")


def on_default_device(tree) -> bool:
    return all(
        leaf.sharding.device_set == {jax.devices()[0]}
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    )


@pytest.mark.parametrize("copies", rotation([None, 3], 0, keep=1), ids=["single", "batch-of-3"])
@pytest.mark.parametrize("case", rotation(BUFFER_CASES, 1, keep=1), ids=lambda c: c.name)
@given(
    spec_name=st.sampled_from(SPEC_NAMES),
    max_size=st.sampled_from(MAX_SIZES),
    num_steps=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_bit_exact(save_dir, case, copies, spec_name, max_size, num_steps, seed):
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    if copies is None:
        make = lambda: case.make(spec, max_size)
        step = lambda buf, rng: case.step(buf, spec, rng)
    else:
        make = lambda: make_batch(case.make, spec, max_size, copies)
        step = lambda buf, rng: batch_step(case, buf, spec, rng, copies)
    buf = make()
    for _ in range(num_steps):
        buf = step(buf, rng)
    path = save_dir / f"{case.name}.dx"
    dx.save(path, buf)
    loaded = dx.load(path, like=make())
    # Contents, sizes and cursors, static fields, dtypes and weak types, all bit for bit.
    assert_bits_equal(loaded, buf)
    assert on_default_device(loaded)
    # The loaded buffer carries on exactly like the original.
    step_seed = int(rng.integers(2**32))
    after = step(buf, np.random.default_rng(step_seed))
    assert_bits_equal(step(loaded, np.random.default_rng(step_seed)), after)


@pytest.mark.parametrize("case", rotation(BUFFER_CASES, 7, keep=3), ids=lambda c: c.name)
def test_load_into_a_shape_only_template(tmp_path, case):
    # `eqx.filter_eval_shape` builds the template without allocating its arrays.
    spec = SPECS["dict"]
    buf = case.step(case.make(spec, 8), spec, np.random.default_rng(0))
    dx.save(tmp_path / "buf.dx", buf)
    like = eqx.filter_eval_shape(case.make, spec, 8)
    assert_bits_equal(dx.load(tmp_path / "buf.dx", like=like), buf)
    batch = stack([buf, buf])
    dx.save(tmp_path / "batch.dx", batch)
    like = eqx.filter_eval_shape(make_batch, case.make, spec, 8, 2)
    assert_bits_equal(dx.load(tmp_path / "batch.dx", like=like), batch)


def test_nan_payloads_survive(tmp_path):
    spec = {
        "f32": jax.ShapeDtypeStruct((2,), jnp.float32),
        "bf16": jax.ShapeDtypeStruct((), jnp.bfloat16),
    }
    f32 = np.array([0x7FC00001, 0xFF800001], np.uint32).view(np.float32)  # quiet, signalling
    bf16 = np.array([0x7F81, 0xFFC3, 0x7FC1, 0xFF80], np.uint16).view(jnp.bfloat16)
    buf = dx.UniformReplay(spec, 4).add_batch({"f32": np.stack([f32, f32]), "bf16": bf16[:2]})
    # XLA's CPU scatter canonicalises bfloat16 NaNs (it computes in float32), so the bfloat16
    # payloads are put in place directly: this test is about the file, not about `add`.
    buf = eqx.tree_at(lambda b: b.storage.data["bf16"], buf, jnp.asarray(bf16))
    assert (np.asarray(buf.storage.data["f32"][:2]).view(np.uint32) == f32.view(np.uint32)).all()
    assert (np.asarray(buf.storage.data["bf16"]).view(np.uint16) == bf16.view(np.uint16)).all()
    dx.save(tmp_path / "nan.dx", buf)
    loaded = dx.load(tmp_path / "nan.dx", like=dx.UniformReplay(spec, 4))
    assert_bits_equal(loaded, buf)


def test_typed_prng_keys_round_trip(tmp_path):
    # Buffers take keys as arguments and never store them, but a user's items may hold some.
    item = {"key": jax.random.key(0), "x": jnp.zeros((), jnp.float32)}
    keys = jax.random.split(jax.random.key(1), 3)
    buf = dx.UniformReplay(item, 4).add_batch({"key": keys, "x": jnp.arange(3.0)})
    dx.save(tmp_path / "keys.dx", buf)
    for like in [dx.UniformReplay(item, 4), eqx.filter_eval_shape(dx.UniformReplay, item, 4)]:
        loaded = dx.load(tmp_path / "keys.dx", like=like)
        assert_bits_equal(loaded, buf)
        assert jax.random.key_impl(loaded.storage.data["key"]) == jax.random.key_impl(keys)
    # A key of another implementation is another dtype.
    rbg = {"key": jax.random.key(0, impl="rbg"), "x": jnp.zeros((), jnp.float32)}
    with pytest.raises(ValueError, match=r"leaf `\.storage\.data\['key'\]`: expected dtype"):
        dx.load(tmp_path / "keys.dx", like=dx.UniformReplay(rbg, 4))


def test_loaded_buffer_is_donated_in_place(tmp_path):
    # Loaded arrays are ordinary device buffers that XLA can reuse: with "warn" donation and
    # `filterwarnings = error`, a buffer that could not be reused fails the test.
    item = {"obs": jnp.zeros(3, jnp.float32)}
    dx.save(tmp_path / "b.dx", dx.UniformReplay(item, 16).add_batch({"obs": jnp.ones((4, 3))}))
    buf = dx.load(tmp_path / "b.dx", like=dx.UniformReplay(item, 16))
    step = eqx.filter_jit(lambda items, b: b.add_batch(items), donate="warn-except-first")
    pointer = buf.storage.data["obs"].unsafe_buffer_pointer()
    new = step({"obs": jnp.zeros((2, 3))}, buf)
    assert buf.storage.data["obs"].is_deleted()
    assert new.storage.data["obs"].unsafe_buffer_pointer() == pointer
    assert int(new.size) == 6


# ---------------------------------------------------------------------------------------------
# Static fields that are functions, and other non-array leaves (the seam ClusteredReplay uses).


def _cluster_by_sign(item):
    return (item["x"] > 0).astype(jnp.int32)


def _cluster_by_parity(item):
    return (item["x"] % 2).astype(jnp.int32)


class _WithFunction(eqx.Module):
    """Stands in for a buffer with a user callable as a static field (ClusteredReplay)."""

    inner: dx.UniformReplay
    cluster_fn: Callable = eqx.field(static=True)
    label: str  # a non-array leaf: compared like a static field, taken from `like`


def _with_function(fn, label="a"):
    return _WithFunction(dx.UniformReplay({"x": jnp.zeros(())}, 4), fn, label)


def test_static_functions_are_compared_by_name_and_taken_from_like(tmp_path):
    buf = _with_function(_cluster_by_sign)
    buf = eqx.tree_at(lambda b: b.inner, buf, buf.inner.add_batch({"x": jnp.arange(3.0)}))
    dx.save(tmp_path / "f.dx", buf)
    loaded = dx.load(tmp_path / "f.dx", like=_with_function(_cluster_by_sign))
    assert loaded.cluster_fn is _cluster_by_sign
    assert_bits_equal(loaded, buf)
    with pytest.raises(ValueError, match="_cluster_by_sign") as info:
        dx.load(tmp_path / "f.dx", like=_with_function(_cluster_by_parity))
    assert "static value `.cluster_fn`" in str(info.value)
    assert "tests.test_io._cluster_by_parity" in str(info.value)
    with pytest.raises(
        ValueError, match=r'non-array leaf `\.label`: expected "b" \(from `like`\), found "a"'
    ):
        dx.load(tmp_path / "f.dx", like=_with_function(_cluster_by_sign, label="b"))


# ---------------------------------------------------------------------------------------------
# Templates that do not match: each error names the field, with expected and found values.

_ITEM = {"obs": jnp.zeros(3, jnp.float32), "action": jnp.zeros((), jnp.int32)}


@pytest.fixture
def saved(tmp_path):
    buf = dx.UniformReplay(_ITEM, 8).add_batch({"obs": jnp.ones((5, 3)), "action": jnp.arange(5)})
    path = tmp_path / "replay.dx"
    dx.save(path, buf)
    return path, buf


@pytest.mark.parametrize(
    "like, message",
    [
        (
            lambda: dx.CircularBuffer(_ITEM, 8),
            r"type: expected dejax_eqx\._storage\.CircularBuffer \(from `like`\), "
            r"found dejax_eqx\._uniform\.UniformReplay",
        ),
        (
            lambda: dx.UniformReplay(_ITEM, 16),
            r"static value `\.storage\.max_size`: expected 16 \(from `like`\), found 8\n"
            r".*leaf `\.storage\.data\['action'\]`: expected shape \(16,\) \(from `like`\), "
            r"found \(8,\)",
        ),
        (
            lambda: dx.UniformReplay({**_ITEM, "reward": jnp.zeros(())}, 8),
            r"leaf `\.storage\.data\['reward'\]`: in `like` but not in the file",
        ),
        (
            lambda: dx.UniformReplay({"obs": _ITEM["obs"]}, 8),
            r"leaf `\.storage\.data\['action'\]`: in the file but not in `like`",
        ),
        (
            lambda: dx.UniformReplay({**_ITEM, "obs": jnp.zeros(4)}, 8),
            r"leaf `\.storage\.data\['obs'\]`: expected shape \(8, 4\) \(from `like`\), "
            r"found \(8, 3\)",
        ),
        (
            lambda: dx.UniformReplay({**_ITEM, "obs": jnp.zeros(3, jnp.bfloat16)}, 8),
            r"leaf `\.storage\.data\['obs'\]`: expected dtype bfloat16 \(from `like`\), "
            r"found float32",
        ),
        (
            lambda: eqx.filter_vmap(lambda: dx.UniformReplay(_ITEM, 8), axis_size=2)(),
            r"leaf `\.storage\.head`: expected shape \(2,\) \(from `like`\), found \(\)",
        ),
    ],
    ids=["type", "capacity", "missing-leaf", "extra-leaf", "shape", "dtype", "vmapped"],
)
def test_mismatched_template_names_the_field(saved, like, message):
    path, _ = saved
    with pytest.raises(ValueError, match=r"does not match `like`:\n(.|\n)*" + message):
        dx.load(path, like=like())


# ---------------------------------------------------------------------------------------------
# Damaged files: every truncation and every single-byte corruption is refused.


def _small_file(tmp_path):
    spec = SPECS["nested"]
    buf = dx.UniformReplay(spec, 3).add_batch(random_bits_batch(spec, 2, np.random.default_rng(0)))
    path = tmp_path / "small.dx"
    dx.save(path, buf)
    return path, path.read_bytes(), dx.UniformReplay(spec, 3)


def test_every_truncation_is_refused(tmp_path):
    path, data, like = _small_file(tmp_path)
    assert len(data) > 1000  # prefix, header, four arrays, checksum
    for size in reversed(range(len(data))):  # every proper prefix of the file
        os.truncate(path, size)
        with pytest.raises(ValueError, match="truncated") as info:
            dx.load(path, like=like)
        assert "nothing was loaded" in str(info.value)


def test_every_single_byte_corruption_is_refused(tmp_path):
    path, data, like = _small_file(tmp_path)
    rng = np.random.default_rng(0)
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset in range(len(data)):
            flip = int(rng.integers(1, 256))  # any change of the byte, not one pattern
            os.pwrite(fd, bytes([data[offset] ^ flip]), offset)
            message = "not a file written by" if offset < 8 else "truncated or corrupted"
            with pytest.raises(ValueError, match=message):
                dx.load(path, like=like)
            os.pwrite(fd, data[offset : offset + 1], offset)
        os.pwrite(fd, b"\0", len(data))  # one byte appended
        with pytest.raises(ValueError, match="truncated or corrupted"):
            dx.load(path, like=like)
    finally:
        os.close(fd)


def _rewrite(data: bytes, *, version=None, header=None, payload_suffix=b"") -> bytes:
    """A file with some part replaced and a valid checksum: what a bug, not bad luck, makes."""
    magic, old_version, header_size = struct.unpack("<8sIQ", data[:20])
    old_header = data[20 : 20 + header_size]
    payload = data[20 + header_size : -32]
    new_header = old_header if header is None else json.dumps(header(json.loads(old_header)))
    new_header = new_header.encode() if isinstance(new_header, str) else new_header
    body = (
        struct.pack("<8sIQ", magic, old_version if version is None else version, len(new_header))
        + new_header
        + payload
        + payload_suffix
    )
    return body + hashlib.sha256(body).digest()


def test_unreadable_files_with_valid_checksums(tmp_path):
    path, data, like = _small_file(tmp_path)
    damaged = tmp_path / "damaged.dx"

    for version in [0, 3]:
        damaged.write_bytes(_rewrite(data, version=version))
        with pytest.raises(
            ValueError, match=f"format version {version}; .* reads versions 1 and 2 only"
        ):
            dx.load(damaged, like=like)

    damaged.write_bytes(_rewrite(data, payload_suffix=b"extra"))
    with pytest.raises(ValueError, match="unexpected bytes after its last array"):
        dx.load(damaged, like=like)

    # A header that matches the template but not the arrays that follow it.
    def claim_bigger(header):
        for leaf in header["leaves"]:
            if leaf["path"] == ".storage.data['c']":
                leaf["shape"] = [3, 2]
        return header

    damaged.write_bytes(_rewrite(data, header=claim_bigger))
    spec = {**SPECS["nested"], "c": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(ValueError, match="inconsistent payload"):
        dx.load(damaged, like=dx.UniformReplay(spec, 3))

    damaged.write_bytes(_rewrite(data, header=lambda h: {"leaves": 1}))
    with pytest.raises(ValueError, match="unreadable header"):
        dx.load(damaged, like=like)


def test_not_a_save_file(tmp_path):
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(ValueError, match="not a file written by `dx.save`"):
        dx.load(npy, like=dx.UniformReplay(_ITEM, 8))
    with pytest.raises(FileNotFoundError):
        dx.load(tmp_path / "missing.dx", like=dx.UniformReplay(_ITEM, 8))


# ---------------------------------------------------------------------------------------------
# Files of format 1 (dejax_eqx 0.1): the bytes are laid out as in format 2, so one whose header
# matches `like` loads; one that does not is refused with directions for carrying it over
# (the trajectory buffers and `PrioritisedReplay` changed their fields in 0.2).

# Types whose fields did not change in 0.2: their format-1 files are format-2 files but for the
# version number.
UNCHANGED_IN_0_2 = ["UniformReplay", "CircularBuffer", "ClusteredReplay(UniformReplay)", "SumTree"]

# A real file of dejax_eqx 0.1 (1152 bytes). Made with the code of commit ea5f5c8, the last
# to write format 1, checked out with `git worktree add /tmp/dejax_old ea5f5c8` and run with
# `PYTHONPATH=/tmp/dejax_old` and this repository's `.venv` python:
#
#     buf = dx.TrajectoryBuffer({"obs": jnp.zeros(2, jnp.float32)}, num_envs=2, max_length=4)
#     buf = buf.add({"obs": jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.float32)})
#     buf = buf.add({"obs": jnp.asarray([[5.0, 6.0], [7.0, 8.0]], jnp.float32)})
#     dx.save("tests/data/trajectory_buffer_format1.dx", buf)
FORMAT_1_TRAJECTORY_BUFFER = Path(__file__).parent / "data" / "trajectory_buffer_format1.dx"


def _version_and_header(data: bytes) -> tuple[int, dict]:
    _, version, header_size = struct.unpack("<8sIQ", data[:20])
    return version, json.loads(data[20 : 20 + header_size])


def _assert_format_1_refusal(message: str, path) -> None:
    """The refusal of a format-1 file that does not match `like`: what, why, what to do, and
    the differences."""
    assert message.startswith(f"`dx.load`: {str(path)!r} was written by dejax_eqx 0.1 (format 1)")
    for phrase in [
        "does not match `like`",
        "The layout of `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`, `TrajectoryQueue` "
        "and `PrioritisedReplay` changed in dejax_eqx 0.2",
        "load it with dejax_eqx 0.1, write it to a `dx.Dataset` with `Dataset.write`, and "
        "`Dataset.load` it with this version (datasets carry over unchanged)",
        "`PrioritisedReplay` over, load it with dejax_eqx 0.1 and add its items, with their "
        "priorities, to a new one",
    ]:
        assert phrase in message
    assert "\n  - " in message  # the differences, one per line, as for any mismatch


@pytest.mark.parametrize("name", UNCHANGED_IN_0_2)
def test_format_1_file_of_an_unchanged_type_loads(tmp_path, name):
    case = BY_NAME[name]
    spec = SPECS["dict"]
    buf = case.step(case.make(spec, 4), spec, np.random.default_rng(0))
    path = tmp_path / "buf.dx"
    dx.save(path, buf)
    assert _version_and_header(path.read_bytes())[0] == 2
    path.write_bytes(_rewrite(path.read_bytes(), version=1))
    assert_bits_equal(dx.load(path, like=case.make(spec, 4)), buf)


def test_format_1_file_that_does_not_match_is_refused_with_directions(tmp_path):
    path, data, _ = _small_file(tmp_path)
    path.write_bytes(_rewrite(data, version=1))
    with pytest.raises(ValueError) as info:
        dx.load(path, like=dx.UniformReplay(SPECS["nested"], 4))
    _assert_format_1_refusal(str(info.value), path)
    assert str(info.value).endswith(
        "in:\n  - static value `.storage.max_size`: expected 4 (from `like`), found 3"
        "\n  - leaf `.storage.data['a'][0]`: expected shape (4, 2) (from `like`), found (3, 2)"
        "\n  - leaf `.storage.data['a'][1]['b']`: expected shape (4,) (from `like`), found (3,)"
        "\n  - leaf `.storage.data['c']`: expected shape (4, 1) (from `like`), found (3, 1)"
    )


def test_format_1_trajectory_buffer_is_refused_with_directions():
    # Depends only on the file being of format 1 and differing from `like`: the message lists
    # the differences, whatever the 0.2 fields are.
    path = FORMAT_1_TRAJECTORY_BUFFER
    version, header = _version_and_header(path.read_bytes())
    assert version == 1 and header["type"] == "dejax_eqx._trajectory.TrajectoryBuffer"
    like = dx.TrajectoryBuffer({"obs": jnp.zeros(2, jnp.float32)}, num_envs=2, max_length=4)
    with pytest.raises(ValueError) as info:
        dx.load(path, like=like)
    _assert_format_1_refusal(str(info.value), path)


# ---------------------------------------------------------------------------------------------
# Atomic saves: a save that fails at any point leaves the previous file as it was.


class InjectedFailure(OSError):
    pass


def _old_and_new(tmp_path):
    old = dx.UniformReplay(_ITEM, 8).add_batch({"obs": jnp.ones((2, 3)), "action": jnp.arange(2)})
    new = old.add_batch({"obs": jnp.full((5, 3), 7.0), "action": jnp.arange(5)})
    path = tmp_path / "replay.dx"
    dx.save(path, old)
    return path, path.read_bytes(), old, new


def _assert_untouched(path, before, old):
    assert sorted(os.listdir(path.parent)) == [path.name]  # no temporary file left behind
    assert path.read_bytes() == before
    assert_bits_equal(dx.load(path, like=dx.UniformReplay(_ITEM, 8)), old)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("error", [InjectedFailure, KeyboardInterrupt])
def test_failure_while_writing_leaves_previous_file(tmp_path, monkeypatch, fraction, error):
    # The serialiser writes part of the real payload, then fails (a full disk, a Ctrl-C).
    path, before, old, new = _old_and_new(tmp_path)
    real = eqx.tree_serialise_leaves
    calls = []

    def partial_write(file, tree, *args, **kwargs):
        payload = io.BytesIO()
        real(payload, tree, *args, **kwargs)
        data = payload.getvalue()
        file.write(data[: int(len(data) * fraction)])
        calls.append(len(data))
        raise error("injected failure while writing")

    monkeypatch.setattr(eqx, "tree_serialise_leaves", partial_write)
    with pytest.raises(error, match="injected"):
        dx.save(path, new)
    assert calls  # the failure really happened inside `save`
    _assert_untouched(path, before, old)


def test_failure_inside_the_real_serialiser(tmp_path, monkeypatch):
    # `np.save` fails on the third array: two leaves are already in the temporary file.
    path, before, old, new = _old_and_new(tmp_path)
    real = np.save
    count = []

    def failing_save(file, array, *args, **kwargs):
        count.append(None)
        if len(count) == 3:
            raise InjectedFailure("no space left on device (injected)")
        real(file, array, *args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(Exception) as info:
        dx.save(path, new)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    assert any(isinstance(e, InjectedFailure) for e in chain)  # Equinox names the leaf on top
    monkeypatch.undo()
    _assert_untouched(path, before, old)


@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_failure_after_writing_leaves_previous_file(tmp_path, monkeypatch, stage):
    path, before, old, new = _old_and_new(tmp_path)

    def fail(*args, **kwargs):
        raise InjectedFailure(f"injected failure in {stage}")

    monkeypatch.setattr(os, stage, fail)
    with pytest.raises(InjectedFailure, match=stage):
        dx.save(path, new)
    monkeypatch.undo()
    _assert_untouched(path, before, old)


def test_save_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    path, _, _, new = _old_and_new(tmp_path)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace(source, destination):
        events.append("replace")
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dx.save(path, new)
    assert events == ["fsync file", "replace", "fsync directory"]


def test_successful_save_replaces_the_file(tmp_path):
    path, before, old, new = _old_and_new(tmp_path)
    os.chmod(path, 0o640)
    dx.save(path, new)
    assert sorted(os.listdir(tmp_path)) == [path.name]
    assert os.stat(path).st_mode & 0o777 == 0o640  # an existing file keeps its permissions
    assert_bits_equal(dx.load(path, like=dx.UniformReplay(_ITEM, 8)), new)
    fresh = tmp_path / "fresh.dx"
    dx.save(str(fresh), new)  # str paths too; a new file gets the umask's permissions
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fresh).st_mode & 0o777 == 0o666 & ~umask


def test_save_goes_through_replace_atomically(tmp_path, monkeypatch):
    calls = []
    real = dx_io.replace_atomically

    def recording(path, write, **kwargs):
        calls.append((path, kwargs))
        real(path, write, **kwargs)

    monkeypatch.setattr(dx_io, "replace_atomically", recording)
    dx.save(tmp_path / "b.dx", dx.UniformReplay(_ITEM, 8))
    assert calls == [(tmp_path / "b.dx", {})]  # with `sync`, the default


def test_replace_atomically_writes_a_text_payload_without_syncing(tmp_path, monkeypatch):
    # What `_dataset.py` does with its manifest: text, encoded by the caller, and `sync=False`.
    path = tmp_path / "manifest.json"
    fsyncs = []
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
    for text in [json.dumps({"a": 1}), json.dumps({"é": [2]}, ensure_ascii=False, indent=1)]:
        dx_io.replace_atomically(str(path), lambda f: f.write(text.encode()), sync=False)
        assert path.read_text(encoding="utf-8") == text
    assert fsyncs == []
    assert sorted(os.listdir(tmp_path)) == [path.name]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("error", [InjectedFailure, KeyboardInterrupt])
def test_replace_atomically_failure_leaves_previous_file(tmp_path, error):
    path = tmp_path / "manifest.json"
    path.write_text("previous")

    def failing(file):
        file.write(b"half of the new con")
        raise error("injected failure while writing")

    with pytest.raises(error, match="injected"):
        dx_io.replace_atomically(path, failing)
    assert sorted(os.listdir(tmp_path)) == [path.name]
    assert path.read_text() == "previous"


def test_save_inside_jit_is_refused(tmp_path):
    buf = dx.UniformReplay(_ITEM, 8)
    with pytest.raises(TypeError, match="is a tracer"):
        eqx.filter_jit(lambda b: dx.save(tmp_path / "x.dx", b))(buf)
    assert os.listdir(tmp_path) == []
