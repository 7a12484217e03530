"""Fault injection for `dx.Dataset`: writers killed (SIGKILL) at chosen and at random points
of `append` and `write`, with and without priorities; a flipped bit in every kind of file; a
deleted or truncated file; two writer processes. After each, every committed step and mass
is compared bit for bit with what was committed, and every damage must be refused with a
message that names the file. The random points come from fixed seeds.

The writer processes are `tests/dataset_writer.py`; its docstring lists the stages a write
can be stopped at.
"""

import functools
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.dataset_writer import (
    appends,
    CHUNK,
    MAX_LENGTH,
    NUM_ENVS,
    STEP,
    steps,
    WINDOW,
    WRITES,
)
from tests.helpers import rotation, SLOW


pytest.importorskip("tensorstore")

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# What each write commits, computed here, in the test process


@jax.jit
def _extend(buf, items, env_ids):
    return buf.extend(items, env_ids)


@jax.jit
def _reprioritise(buf, key, priorities):
    out = buf.sample(key, priorities.shape[0])
    return buf.set_priorities(out.sample.env, out.sample.start, priorities)


@functools.cache
def _buffers(kind: str) -> tuple:
    """The buffer of each write of `kind` (`write` or `prioritised`): steps added to all envs
    or to two of them between writes, and for `prioritised` new priorities for 24 sampled
    windows, the committed ones among them, so that every write changes committed masses."""
    rng = np.random.default_rng(5)
    if kind == "prioritised":
        buf = dx.PrioritisedTrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH, WINDOW)
    else:
        buf = dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH)
    out = []
    for k in range(WRITES):
        ids = np.arange(NUM_ENVS) if k % 2 == 0 else np.array([1, 3])
        length = MAX_LENGTH if k == 3 else 24  # write 3 is large (killed after a delay)
        count = np.asarray(buf.step_count)[ids]
        items = steps(ids[:, None], count[:, None] + np.arange(length))
        buf = _extend(buf, items, jnp.asarray(ids, jnp.int32))
        if kind == "prioritised":
            new = jnp.asarray(rng.uniform(0.1, 5.0, 24), jnp.float32)
            buf = _reprioritise(buf, jax.random.key(k), new)
        out.append(buf)
    return tuple(out)


def _expected(kind: str, commits: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """`(starts, ends, masses)` of the dataset once the first `commits` writes of `kind` are
    committed: `masses[(env, start)]` is each window's mass as of the last write whose
    buffer held it."""
    starts, ends = np.zeros(NUM_ENVS, np.int64), np.zeros(NUM_ENVS, np.int64)
    if kind == "append":
        for ids, length in appends()[:commits]:
            ends[ids] += length
        return starts, ends, {}
    if commits == 0:
        return starts, ends, {}
    buffers = _buffers(kind)
    first = buffers[0].streams
    starts = np.asarray(first.step_count, np.int64) - np.asarray(first.lengths, np.int64)
    ends = np.asarray(buffers[commits - 1].step_count, np.int64)
    masses = {}
    if kind == "prioritised":
        for buf in buffers[:commits]:
            held = jax.tree.map(np.asarray, buf.window_priorities())
            for e, leaf in zip(*np.nonzero(held.held)):
                if held.start[e, leaf] >= starts[e]:
                    masses[int(e), int(held.start[e, leaf])] = np.float32(held.mass[e, leaf])
    return starts, ends, masses


def _check(path: Path, kind: str, commits: int) -> None:
    """The dataset at `path` holds exactly the first `commits` writes of `kind`, bit for bit."""
    starts, ends, masses = _expected(kind, commits)
    ds = dx.Dataset.open(path, STEP)  # a reader: it takes no lock
    np.testing.assert_array_equal(ds.starts, starts)
    np.testing.assert_array_equal(ds.ends, ends)
    for e in range(NUM_ENVS):
        _assert_steps(ds, e, int(starts[e]), int(ends[e]))
        if kind == "prioritised":
            got = ds.priorities(e, int(starts[e]), int(ends[e]))
            at = np.arange(starts[e], ends[e])
            want = np.array([masses.get((e, int(s)), np.nan) for s in at], np.float32)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"env {e}")
            assert got[~np.isnan(got)].tobytes() == want[~np.isnan(want)].tobytes()


def _assert_steps(ds: dx.Dataset, env: int, start: int, end: int, tag: float = 0.5) -> None:
    """`ds` holds steps `start .. end - 1` of env `env`, written by `tag`, bit for bit."""
    got = ds.read(env, start, end)
    want = steps(np.full(end - start, env), np.arange(start, end), tag)
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), (env, key)


def _finish(path: Path, kind: str, commits: int) -> None:
    """Make the writes after the first `commits` in this process, over what a killed writer
    left past the committed end, and check the whole dataset."""
    ds = dx.Dataset.open(path, STEP)  # its lock goes with it, when it is collected
    for k in range(commits, WRITES):
        if kind == "append":
            ids, length = appends()[k]
            at = ds.ends[ids][:, None] + np.arange(length)
            ds.append(steps(ids[:, None], at), env_ids=ids)
        else:
            ds.write(_buffers(kind)[k])
    _check(path, kind, WRITES)


# Prioritised writes keep their committed masses in the default tier (tests/test_dataset.py's
# test_a_failed_prioritised_write_keeps_the_committed_masses); each write's, in the slow tier.
@SLOW
def test_each_prioritised_write_changes_committed_masses():
    # What makes the kill tests of `prioritised` meaningful: every write after the first
    # gives windows the dataset already holds other masses.
    for commits in range(1, WRITES):
        before = _expected("prioritised", commits)[2]
        after = _expected("prioritised", commits + 1)[2]
        assert any(after[k] != v for k, v in before.items() if k in after), commits


# ---------------------------------------------------------------------------------------------
# Writers killed


def _save_buffers(kind: str, directory: Path) -> None:
    directory.mkdir()
    if kind != "append":
        for k, buf in enumerate(_buffers(kind)):
            dx.save(directory / f"{k}.dx", buf)


def _kill(tmp_path: Path, kind: str, stop: str, kill_at) -> tuple[Path, int]:
    """Run the writer, SIGKILL it when `kill_at(line)` says so; the dataset's path and how
    many writes it reported committed."""
    path, buffers = tmp_path / "d", tmp_path / "buffers"
    _save_buffers(kind, buffers)
    command = [sys.executable, "-m", "tests.dataset_writer", str(path), kind, stop, str(buffers)]
    with subprocess.Popen(
        command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as writer:
        assert writer.stdout is not None
        done = 0
        try:
            for line in writer.stdout:  # to its end if the writer kills itself
                done += line.startswith("done")
                if kill_at(line.strip()):
                    writer.send_signal(signal.SIGKILL)
                    break
            done += writer.stdout.read().count("done")  # what it printed before it died
        finally:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    return path, done


# Each write stopped where it blocks (`tests/dataset_writer.py`): the dataset must be exactly
# as its previous commit left it.
STAGES = [
    ("append", "rename:1"),
    ("write", "steps:2"),
    ("prioritised", "steps:1"),
    ("prioritised", "segment:2"),
    ("prioritised", "commit:3"),
    ("prioritised", "rename:2"),
]


@pytest.mark.parametrize("kind, stop", rotation(STAGES, 1, keep=1, several=True))
def test_a_writer_killed_at_a_stage_leaves_its_previous_commit(tmp_path, kind, stop):
    stage, k = stop.split(":")
    path, done = _kill(tmp_path, kind, stop, lambda line: line == f"at {stage}")
    assert done == int(k)
    assert (path / "writer.lock").exists()  # the killed writer held it; the OS released it
    _check(path, kind, int(k))
    _finish(path, kind, int(k))


# Killed at a random point (seeded): the N-th line the package executes in write 3, the
# large one, so before, during or after its chunks, its segment or its commit, while
# tensorstore's threads write. `LINES`: about the lines a write 3 executes (237, 191 and 345
# when this was written); a point past its end kills the writer after its commit.
LINES = {"append": 230, "write": 190, "prioritised": 340}
RANDOM = [("append", 0), ("write", 2), ("prioritised", 3), ("prioritised", 4)]


# A writer killed at a stage runs in the default tier (above); at random points, in the slow
# tier.
@SLOW
@pytest.mark.parametrize("kind, seed", RANDOM)
def test_a_writer_killed_at_a_random_point_leaves_a_commit(tmp_path, kind, seed):
    line = int(np.random.default_rng(seed).integers(1, LINES[kind]))
    path, done = _kill(tmp_path, kind, f"line:3:{line}", lambda text: text == "done 3")
    ends = dx.Dataset.open(path, STEP).ends
    commits = next((j for j in (done, done + 1) if (ends == _expected(kind, j)[1]).all()), None)
    assert commits is not None and commits >= 3, (done, line)
    _check(path, kind, commits)
    _finish(path, kind, commits)


# ---------------------------------------------------------------------------------------------
# Two writer processes


def _contend(path: Path, mode: str) -> list[tuple[float, list[str]]]:
    writers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dataset_writer", str(path), "contend", tag, mode],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("0.25", "0.75")
    ]
    try:
        for w in writers:  # both have opened the dataset before either appends
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        for w in writers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        outputs = [w.communicate(timeout=120)[0] for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait()
    assert [w.returncode for w in writers] == [0, 0]
    return [(tag, out.splitlines()) for tag, out in zip((0.25, 0.75), outputs)]


# Two writer processes at once: CI's slow tier, as the runs across real processes
# (tests/helpers.py); the lock is taken and refused in process in the default tier
# (tests/test_dataset.py's test_two_dataset_objects_on_one_path_take_turns).
@SLOW
@pytest.mark.parametrize("mode", ["hold", "retry"])
def test_two_writer_processes_lose_nothing(tmp_path, mode):
    # `hold`: each keeps one Dataset for its 40 appends: one takes the lock, the other is
    # refused at its first append. `retry`: each opens the dataset for every append and tries
    # again when refused (the lock, or a commit it has not seen): all 80 appends are kept.
    path = tmp_path / "d"
    dx.Dataset.create(path, STEP, NUM_ENVS, chunk_length=CHUNK, sync=False)  # no lock: no write
    results = _contend(path, mode)
    committed = []
    for tag, lines in results:
        appended = [list(map(int, x.split()[1:])) for x in lines if x.startswith("appended")]
        committed += [(tag, x[:NUM_ENVS], x[NUM_ENVS]) for x in appended]
        refused = [x for x in lines if x.startswith("refused")]
        for x in refused:
            assert "another writer holds" in x or "changed since this Dataset read" in x, x
        if mode == "retry":
            assert len(appended) == 40
    if mode == "hold":
        counts = sorted(sum(x.startswith("appended") for x in lines) for _, lines in results)
        assert counts == [0, 40]
    ds = dx.Dataset.open(path, STEP)
    total = sum(length for _, _, length in committed)
    np.testing.assert_array_equal(ds.lengths, [total] * NUM_ENVS)
    for tag, starts, length in committed:  # each where its writer put it, bit for bit
        for e in range(NUM_ENVS):
            _assert_steps(ds, e, starts[e], starts[e] + length, tag)


# ---------------------------------------------------------------------------------------------
# Damaged files


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A dataset with every kind of file: the prioritised writes, so leaves and segments."""
    path = tmp_path_factory.mktemp("source") / "d"
    ds = dx.Dataset.create(path, STEP, NUM_ENVS, chunk_length=CHUNK, sync=False)
    for buf in _buffers("prioritised"):
        ds.write(buf)
    return path


@pytest.fixture
def dataset(source, tmp_path) -> Path:
    path = tmp_path / "d"
    shutil.copytree(source, path)
    return path


def _flip(file: Path, bit: int) -> bytes:
    """Flip bit `bit` of `file`; its old bytes."""
    data = file.read_bytes()
    damaged = bytearray(data)
    damaged[bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(damaged))
    return data


def _chunks(path: Path, array: str) -> list[Path]:
    return sorted(x for x in (path / array).rglob("*") if x.is_file() and x.name != "zarr.json")


def _read_all(path: Path, what: str) -> None:
    """Read every committed step (`steps`) or every stored mass (`masses`), each env whole."""
    ds = dx.Dataset.open(path, STEP)
    for e in range(NUM_ENVS):
        start, end = int(ds.starts[e]), int(ds.ends[e])
        ds.read(e, start, end) if what == "steps" else ds.priorities(e, start, end)


def _raised(read, *args) -> ValueError | None:
    try:
        read(*args)
    except ValueError as error:
        return error
    return None


def test_a_flipped_bit_in_any_chunk_is_refused_naming_it(dataset):
    rng = np.random.default_rng(0)
    ds = dx.Dataset.open(dataset, STEP)
    segments = json.loads((dataset / "manifest.json").read_text())["segments"]
    arrays = [f"leaves/{i}" for i in range(3)] + [s["name"] for s in segments]
    refused = 0
    for array in arrays:
        read = ds.read if array.startswith("leaves") else ds.priorities
        for file in _chunks(dataset, array):
            e = int(file.relative_to(dataset / array).parts[1])
            start, end = int(ds.starts[e]), int(ds.ends[e])
            name = str(file.relative_to(dataset))
            # A random bit of every chunk, and its last bit (in the CRC-32C).
            size = file.stat().st_size * 8
            for bit in {int(rng.integers(size)), size - 1}:
                data = _flip(file, bit)
                error = _raised(read, e, start, end)
                file.write_bytes(data)
                if error is None:
                    # Never read: every window of this chunk of an older segment is in a
                    # newer one (and reads exactly: `_check` below).
                    assert array not in (arrays[:3] + [arrays[-1]]), name
                    continue
                # A changed bit fails the checksum, or (bool) the decoding before it.
                assert "is damaged: its checksum" in str(error) or "decoded" in str(error)
                assert repr(name) in str(error) and repr(str(dataset)) in str(error)
                refused += 1
    assert refused > 300
    # One more read path: a sample draws windows through the same checks.
    file = _chunks(dataset, "leaves/0")[0]
    data = _flip(file, 3)
    with pytest.raises(ValueError, match="checksum") as error:
        ds.sample(jax.random.key(0), 512, dx.Window(2, strict=True))
    assert repr(str(file.relative_to(dataset))) in str(error.value)
    file.write_bytes(data)
    _check(dataset, "prioritised", WRITES)


@SLOW
def test_a_flipped_bit_in_the_manifest_is_refused(dataset):
    # A random bit of every byte: the checksum, the digits of every start and length, keys.
    rng = np.random.default_rng(2)
    file = dataset / "manifest.json"
    data = file.read_bytes()
    for byte in range(len(data)):
        _flip(file, 8 * byte + int(rng.integers(8)))
        with pytest.raises(ValueError, match="manifest.json") as error:
            dx.Dataset.open(dataset, STEP)
        assert "damaged" in str(error.value) or "format" in str(error.value), byte
        file.write_bytes(data)
    _check(dataset, "prioritised", WRITES)


def test_a_flipped_bit_in_any_array_metadata_is_refused(dataset):
    rng = np.random.default_rng(1)
    for file in sorted(dataset.rglob("zarr.json")):
        data = file.read_bytes()
        for bit in rng.choice(len(data) * 8, 24, replace=False):
            _flip(file, int(bit))
            with pytest.raises(ValueError, match="is damaged: its SHA-256") as error:
                dx.Dataset.open(dataset, STEP)
            assert repr(str(file)) in str(error.value)
            file.write_bytes(data)
    _check(dataset, "prioritised", WRITES)


def test_a_deleted_or_truncated_chunk_is_refused_naming_it(dataset):
    newest = json.loads((dataset / "manifest.json").read_text())["segments"][-1]["name"]
    for array, what in [("leaves/0", "steps"), ("leaves/2", "steps"), (newest, "masses")]:
        file = _chunks(dataset, array)[1]
        name = repr(str(file.relative_to(dataset)))
        data = file.read_bytes()
        file.unlink()
        with pytest.raises(ValueError, match="the chunk is missing") as error:
            _read_all(dataset, what)
        assert name in str(error.value)
        file.write_bytes(data[:-5])
        with pytest.raises(ValueError, match="damaged") as error:
            _read_all(dataset, what)
        assert name in str(error.value)
        file.write_bytes(data)
    _check(dataset, "prioritised", WRITES)


def test_an_append_into_a_deleted_chunk_is_refused(dataset):
    # Env 1 ends inside a chunk: tensorstore would fill the missing chunk's committed steps
    # with zeros while writing the new ones into it.
    ds = dx.Dataset.open(dataset, STEP)
    one = np.array([1])
    ds.append(steps(one[:, None], ds.ends[1] + np.arange(3)[None, :]), env_ids=one)
    length = int(ds.lengths[1])
    assert length % CHUNK
    file = dataset / f"leaves/2/c/1/{length // CHUNK}/0"  # leaf 2, `obs`, has one axis
    manifest = (dataset / "manifest.json").read_bytes()
    data = file.read_bytes()
    file.unlink()
    with pytest.raises(ValueError, match="the chunk is missing") as error:
        ds.append(steps(one[:, None], ds.ends[1] + np.arange(3)[None, :]), env_ids=one)
    assert repr(str(file.relative_to(dataset))) in str(error.value)
    assert (dataset / "manifest.json").read_bytes() == manifest and not file.exists()
    file.write_bytes(data)
    ds.append(steps(one[:, None], ds.ends[1] + np.arange(3)[None, :]), env_ids=one)
    starts, ends, _ = _expected("prioritised", WRITES)
    _assert_steps(ds, 1, int(starts[1]), int(ends[1]) + 6)
    ds.close()


def test_missing_files_are_refused_naming_them(dataset):
    for name in ["leaves/1/zarr.json", "priorities/0/zarr.json"]:
        file = dataset / name
        data = file.read_bytes()
        file.unlink()
        with pytest.raises(ValueError, match="is missing") as error:
            dx.Dataset.open(dataset, STEP)
        assert repr(str(file)) in str(error.value)
        file.write_bytes(data)
    (dataset / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a dataset"):
        dx.Dataset.open(dataset, STEP)
