"""`dx.Dataset`: on-disk per-env streams, checked against plain Python histories.

The crash-safety tests kill a writer process (SIGKILL) in the middle of a write and reopen the
dataset: it must read exactly as it did at its previous commit, and take new writes.
"""

import gc
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx import _dataset
from scipy import stats

from .helpers import SLOW


pytest.importorskip("tensorstore")

ROOT = Path(__file__).resolve().parent.parent
STEP = {
    "obs": jnp.zeros(3, jnp.float32),
    "action": jnp.zeros((), jnp.int32),
    "done": jnp.zeros((), jnp.bool_),
}


def _steps(env: np.ndarray, step: np.ndarray) -> dict[str, np.ndarray]:
    """The step numbered `step` of env `env`: every value is a function of the two, so any
    step read back can be checked. Shapes follow `step`."""
    env, step = np.broadcast_arrays(np.asarray(env), np.asarray(step))
    base = (env * 100_000 + step).astype(np.float32)
    return {
        "obs": base[..., None] + np.array([0.0, 0.25, 0.5], np.float32),
        "action": ((env + step) % 5).astype(np.int32),
        "done": (step % 7) == 6,
    }


def _assert_holds(ds: dx.Dataset, env: int, first: int, end: int) -> None:
    got = ds.read(env, first, end)
    want = _steps(np.full(end - first, env), np.arange(first, end))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"env {env}, leaf {k}")


@jax.jit
def _add(buf, steps, env_ids):
    return buf.add(steps, env_ids)


def _async_adds(buf, rng, count: int, per_call: int, num_envs: int):
    """`count` adds of `per_call` random envs each, with the steps `_steps` numbers."""
    for _ in range(count):
        ids = rng.permutation(num_envs)[:per_call].astype(np.int32)
        buf = _add(buf, _steps(ids, np.asarray(buf.step_count)[ids]), ids)
    return buf


@pytest.mark.parametrize("sync", [True, False])
def test_append_and_read_match_the_histories(tmp_path, sync):
    ds = dx.Dataset.create(tmp_path / "d", STEP, num_envs=3, chunk_length=4, sync=sync)
    rng = np.random.default_rng(0)
    ends = np.zeros(3, np.int64)
    for _ in range(20):
        ids = rng.permutation(3)[: rng.integers(1, 4)]
        length = int(rng.integers(0, 9))  # 0 appends nothing; up to two chunks and a bit
        steps = ends[ids][:, None] + np.arange(length)[None, :]
        ds.append(_steps(ids[:, None], steps), env_ids=ids)
        ends[ids] += length
    np.testing.assert_array_equal(ds.ends, ends)
    reopened = dx.Dataset.open(tmp_path / "d", STEP, sync=sync)
    np.testing.assert_array_equal(reopened.lengths, ends)
    for e in range(3):
        _assert_holds(reopened, e, 0, int(ends[e]))
        _assert_holds(reopened, e, 1, 3)  # a range inside one chunk


def test_write_stores_every_step_a_buffer_took_once(tmp_path):
    num_envs, max_length = 4, 6
    buf = dx.TrajectoryBuffer(STEP, num_envs, max_length)
    ds = dx.Dataset.create(tmp_path / "d", buf, num_envs, chunk_length=5)
    rng = np.random.default_rng(1)
    written = 0
    for _ in range(30):
        # Two random envs per add, at most 5 adds between writes: fewer than max_length steps
        # of any env, so nothing is lost.
        buf = _async_adds(buf, rng, int(rng.integers(0, 6)), 2, num_envs)
        written += ds.write(buf)
        np.testing.assert_array_equal(ds.ends, np.asarray(buf.step_count))
    assert written == int(np.asarray(buf.step_count).sum())
    for e in range(num_envs):
        _assert_holds(ds, e, 0, int(ds.ends[e]))


def test_first_write_starts_at_the_oldest_stored_step(tmp_path):
    buf = dx.TrajectoryBuffer(STEP, 2, 4)
    ids = np.arange(2, dtype=np.int32)
    for t in range(7):
        buf = buf.add(_steps(ids, np.full(2, t)), ids)
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    assert ds.write(buf) == 8
    np.testing.assert_array_equal(ds.starts, [3, 3])
    _assert_holds(ds, 1, 3, 7)


def test_write_refuses_lost_steps_and_writes_nothing(tmp_path):
    buf = dx.TrajectoryBuffer(STEP, 3, 4)
    ds = dx.Dataset.create(tmp_path / "d", STEP, 3)
    all_envs = np.arange(3, dtype=np.int32)
    buf = buf.add(_steps(all_envs, np.zeros(3, int)), all_envs)
    ds.write(buf)
    manifest = (tmp_path / "d" / "manifest.json").read_text()
    one = np.array([1], np.int32)
    for t in range(1, 7):  # 6 new steps of env 1, of which the buffer keeps 4
        buf = buf.add(_steps(one, np.array([t])), one)
    with pytest.raises(ValueError) as error:
        ds.write(buf)
    assert str(error.value) == (
        "`Dataset.write`: env 1 took 6 steps since the previous write, but the buffer holds "
        "only its last 4 (max_length = 4): 2 steps were overwritten before they could be "
        "written. Nothing was written. Write at least every 4 steps of each env (1 env(s) "
        "lost steps)."
    )
    assert (tmp_path / "d" / "manifest.json").read_text() == manifest
    np.testing.assert_array_equal(dx.Dataset.open(tmp_path / "d", STEP).lengths, [1, 1, 1])


def test_write_refuses_a_buffer_it_does_not_follow(tmp_path):
    buf = dx.TrajectoryBuffer(STEP, 2, 8)
    ids = np.arange(2, dtype=np.int32)
    for t in range(3):
        buf = buf.add(_steps(ids, np.full(2, t)), ids)
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    ds.write(buf)
    with pytest.raises(ValueError, match="env 0 of the buffer has taken 0 steps, fewer than"):
        ds.write(dx.TrajectoryBuffer(STEP, 2, 8))
    with pytest.raises(ValueError, match="the buffer has 3 envs, the dataset 2"):
        ds.write(dx.TrajectoryBuffer(STEP, 3, 8))
    with pytest.raises(ValueError, match=r"the buffer's steps are \{\['obs'\]: float32\(3,\)\}"):
        ds.write(dx.TrajectoryBuffer({"obs": STEP["obs"]}, 2, 8))


WINDOW = dx.Window(3, burn_in=1, bootstrap=1, period=2, strict=True)


def _prioritised(num_envs=3, max_length=12):
    return dx.PrioritisedTrajectoryBuffer(STEP, num_envs, max_length, WINDOW)


@jax.jit
def _reprioritise(buf, key, priorities):
    out = buf.sample(key, priorities.shape[0])
    return buf.set_priorities(out.sample.env, out.sample.start, priorities)


@jax.jit
def _sample16(buf, key):
    return buf.sample(key, 16)


def _prioritised_buffers(num_envs=3, max_length=12) -> list:
    """A prioritised buffer fed asynchronously, priorities set between writes: the buffer of
    each of 9 writes."""
    buf = _prioritised(num_envs, max_length)
    rng = np.random.default_rng(2)
    buf = _async_adds(buf, rng, 12, 2, num_envs)
    out = []
    for i in range(8):
        new = jnp.asarray(rng.uniform(0.1, 4.0, 6), jnp.float32)
        buf = _reprioritise(buf, jax.random.key(i), new)
        out.append(buf)
        buf = _async_adds(buf, rng, 5, 2, num_envs)
    return [*out, buf]


def _prioritised_history(tmp_path, num_envs=3, max_length=12):
    """The dataset of `_prioritised_buffers`' writes, and the last buffer."""
    buffers = _prioritised_buffers(num_envs, max_length)
    ds = dx.Dataset.create(tmp_path / "d", STEP, num_envs, chunk_length=4)
    for buf in buffers:
        ds.write(buf)
    return buffers[-1], ds


def _stored_masses(buffers: list, starts: np.ndarray) -> dict:
    """Per `(env, start)`, a window's mass as of the last of `buffers` (written in order to a
    dataset whose envs start at `starts`) that held it."""
    out = {}
    for buf in buffers:
        held = jax.tree.map(np.asarray, buf.window_priorities())
        for e, leaf in zip(*np.nonzero(held.held)):
            if held.start[e, leaf] >= starts[e]:
                out[int(e), int(held.start[e, leaf])] = np.float32(held.mass[e, leaf])
    return out


def _assert_masses(ds: dx.Dataset, masses: dict) -> None:
    """`ds` holds exactly `masses` (NaN at every other step), bit for bit."""
    for e in range(ds.num_envs):
        start, end = int(ds.starts[e]), int(ds.ends[e])
        got = ds.priorities(e, start, end)
        want = np.array([masses.get((e, s), np.nan) for s in range(start, end)], np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"env {e}")
        assert got[~np.isnan(got)].tobytes() == want[~np.isnan(want)].tobytes(), f"env {e}"


@SLOW
def test_prioritised_buffer_comes_back_with_its_priorities(tmp_path):
    buf, ds = _prioritised_history(tmp_path)
    like = eqx.filter_eval_shape(_prioritised)
    loaded = dx.Dataset.open(ds.path, like).load(like)
    assert float(loaded.max_priority) == float(buf.max_priority) == ds.max_priority
    np.testing.assert_array_equal(loaded.tree.leaves, buf.tree.leaves)
    np.testing.assert_array_equal(loaded.tree.total, buf.tree.total)
    np.testing.assert_array_equal(loaded.step_count, buf.step_count)
    np.testing.assert_array_equal(loaded.streams.lengths, buf.streams.lengths)
    # The same draws, windows and weights as the buffer that was written.
    for k in range(3):
        a, b = _sample16(loaded, jax.random.key(k)), _sample16(buf, jax.random.key(k))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)
    # What the dataset holds for a window is its sum-tree mass as of the last write.
    env, start = 1, int(ds.ends[1] - buf.window.size)
    start -= start % buf.window.period
    mass = ds.priorities(env, start, start + 1)[0]
    leaf = env * buf.leaves_per_env + (start // buf.window.period) % buf.leaves_per_env
    assert mass == np.float32(buf.tree.leaves[leaf])
    assert np.isnan(ds.priorities(env, start + 1, start + 2)[0])  # not a window start


def test_load_keeps_the_newest_steps_and_defaults_missing_priorities(tmp_path):
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2, chunk_length=3)
    ids = np.arange(2)
    ds.append(_steps(ids[:, None], np.arange(10)[None, :]))  # 10 steps each, no priorities
    small = ds.load(dx.TrajectoryBuffer(STEP, 2, 4))
    reference = dx.TrajectoryBuffer(STEP, 2, 4)
    for t in range(10):
        reference = reference.add(_steps(ids, np.full(2, t)), ids.astype(np.int32))
    reference = reference.reset_online_queue()  # a loaded buffer's online queue is empty
    for x, y in zip(jax.tree.leaves(small), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(x, y)
    loaded = ds.load(_prioritised(2, 8))
    # Windows of 5 steps every 2 among steps 2 .. 9: starts 2, 4, each at max_priority 1.
    assert float(loaded.tree.total) == 4.0 and int(loaded.num_windows) == 4
    with pytest.raises(ValueError, match="the buffer has 3 envs, the dataset 2"):
        ds.load(dx.TrajectoryBuffer(STEP, 3, 4))


def test_a_queue_is_written_and_loaded_as_its_streams(tmp_path):
    # A queue's streams keep the steps it popped until they are overwritten: `write` takes
    # every step it took once, and `load` gives a queue with its streams and nothing unread.
    queue = dx.TrajectoryQueue(STEP, 2, 4)
    ds = dx.Dataset.create(tmp_path / "d", queue, 2, chunk_length=3)
    ids = np.arange(2)
    written = 0
    for k in range(3):
        queue = queue.extend(_steps(ids[:, None], 3 * k + np.arange(3)[None, :]))
        written += ds.write(queue)
        _, queue = queue.pop(3)
    assert written == 18
    np.testing.assert_array_equal(ds.starts, [0, 0])
    np.testing.assert_array_equal(ds.ends, [9, 9])
    for e in range(2):
        _assert_holds(ds, e, 0, 9)
    loaded = dx.Dataset.open(ds.path, STEP).load(dx.TrajectoryQueue(STEP, 2, 4))
    assert isinstance(loaded, dx.TrajectoryQueue)
    assert loaded.unread.tolist() == [0, 0] and loaded.step_count.tolist() == [9, 9]
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(queue)):
        np.testing.assert_array_equal(x, y)
    # It goes on from there: new steps are numbered after the loaded ones and read once.
    loaded = loaded.extend(_steps(ids[:, None], 9 + np.arange(2)[None, :]))
    chunk, loaded = loaded.pop(2)
    want = _steps(ids[:, None], 9 + np.arange(2)[None, :])
    for k in want:
        np.testing.assert_array_equal(chunk[k], want[k])
    assert loaded.step_count.tolist() == [11, 11] and loaded.unread.tolist() == [0, 0]


# Prioritised datasets: their masses are committed and kept in the default tier
# (tests/test_dataset_faults.py, test_a_failed_prioritised_write_keeps_the_committed_masses),
# loaded back in the slow one (above, and this refusal).
@SLOW
def test_load_refuses_other_priority_settings(tmp_path):
    _, ds = _prioritised_history(tmp_path)
    other = dx.PrioritisedTrajectoryBuffer(STEP, 3, 12, WINDOW, priority_exponent=0.5)
    with pytest.raises(ValueError, match=r"`like`'s priority_exponent is 0.5, but .* with 0.6"):
        ds.load(other)


def test_sample_draws_stored_whole_windows_uniformly(tmp_path):
    # Envs of different spans; windows of 5 steps (1 + 3 + 1) starting on multiples of 3.
    # The first write starts each env at its oldest stored step: env 1 at step 4.
    spans = {0: (0, 14), 1: (4, 18), 2: (0, 3)}  # env 2 holds no whole window
    buf = dx.TrajectoryBuffer(STEP, 3, 14)
    for e, (_, end) in spans.items():
        row = np.array([e], np.int32)
        buf = buf.extend(_steps(row[:, None], np.arange(end)[None, :]), row)
    ds = dx.Dataset.create(tmp_path / "d", STEP, 3, chunk_length=4)
    ds.write(buf)
    np.testing.assert_array_equal(ds.starts, [0, 4, 0])
    admissible = [(e, s) for e, (a, b) in spans.items() for s in range(a, b - 4) if s % 3 == 0]
    assert admissible == [(0, 0), (0, 3), (0, 6), (0, 9), (1, 6), (1, 9), (1, 12)]
    draws = 4000
    s = ds.sample(
        jax.random.key(0),
        draws,
        dx.Window(
            3,
            burn_in=1,
            bootstrap=1,
            period=3,
            episode_ends="truncate",
            done="done",
            strict=True,
        ),
    )
    env, start = np.asarray(s.env), np.asarray(s.start)
    for b in range(0, draws, 97):  # every drawn window is the stored one
        want = _steps(np.full(5, env[b]), start[b] + np.arange(5))
        mask = np.asarray(s.mask[b])
        # "truncate": cut after the first episode end at or past the learning part.
        ends = np.flatnonzero(want["done"][1:]) + 1
        keep = np.arange(5) <= (ends[0] if ends.size else 4)
        np.testing.assert_array_equal(mask, keep)
        np.testing.assert_array_equal(np.asarray(s.items["obs"][b])[mask], want["obs"][mask])
        assert not np.asarray(s.items["obs"][b])[~mask].any()
    counts = np.array([np.sum((env == e) & (start == s_)) for e, s_ in admissible])
    assert counts.sum() == draws
    # Uniform over the 5 admissible windows: chi-square, false-failure rate 1e-6.
    statistic, _ = stats.chisquare(counts)
    assert statistic < stats.chi2.ppf(1 - 1e-6, df=len(admissible) - 1)


def test_sample_errors(tmp_path):
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    ds.append(_steps(np.arange(2)[:, None], np.arange(4)[None, :]))
    with pytest.raises(ValueError, match="no env holds a whole window of 5 steps"):
        ds.sample(jax.random.key(0), 2, dx.Window(5, strict=True))
    # The window's options are checked by `Window`, once, when it is made.
    with pytest.raises(ValueError, match=r"`Window\(episode_ends='truncate'\)` needs `done`"):
        dx.Window(2, episode_ends="truncate", strict=True)
    with pytest.raises(ValueError, match="a dataset is sampled in whole windows"):
        ds.sample(jax.random.key(0), 2, dx.Window(2))
    within = dx.Window(2, episode_ends="within", done="finished", strict=True)
    with pytest.raises(ValueError, match="`Dataset.sample`.*the step has no leaf 'finished'"):
        ds.sample(jax.random.key(0), 2, within)


def test_bad_input_is_refused_with_its_reason(tmp_path):
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    with pytest.raises(FileExistsError, match="already exists"):
        dx.Dataset.create(tmp_path / "d", STEP, 2)
    with pytest.raises(FileNotFoundError, match="is not a dataset"):
        dx.Dataset.open(tmp_path, STEP)
    with pytest.raises(ValueError, match=r"holds steps \{\['action'\]: int32\(\), .* describes"):
        dx.Dataset.open(tmp_path / "d", {"obs": STEP["obs"]})
    steps = _steps(np.arange(2)[:, None], np.arange(3)[None, :])
    with pytest.raises(TypeError, match=r"leaf `\['obs'\]` has dtype float64, expected float32"):
        ds.append({**steps, "obs": steps["obs"].astype(np.float64)})
    with pytest.raises(ValueError, match="an env id occurs more than once"):
        ds.append(steps, env_ids=np.array([1, 1]))
    with pytest.raises(ValueError, match="an env id is out of range"):
        ds.append(steps, env_ids=np.array([0, 2]))
    with pytest.raises(ValueError, match="without `env_ids` there must be steps for every env"):
        ds.append(jax.tree.map(lambda x: x[:1], steps))
    assert ds.lengths.tolist() == [0, 0]  # nothing was written by the refused calls
    ds.append(steps)
    with pytest.raises(ValueError, match=r"steps 1 .. 3 of env 0 are not all stored; it holds"):
        ds.read(0, 1, 4)
    with pytest.raises(ValueError, match="env 2 is out of range"):
        ds.read(2, 0, 1)
    _resign(tmp_path / "d", lambda body: body.update(format=99))
    with pytest.raises(ValueError, match="has format 99; this version reads formats 1 and 2"):
        dx.Dataset.open(tmp_path / "d", STEP)


def _resign(path: Path, change) -> None:
    """Rewrite the manifest of the dataset at `path` with `change(body)` applied and a valid
    checksum, as a writer with a bug would: what the checks of its fields must catch. The
    checksum is the SHA-256 of the canonical JSON of everything else."""
    file = path / "manifest.json"
    body = json.loads(file.read_text())
    body.pop("checksum", None)  # (format 1 has none)
    change(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["checksum"] = hashlib.sha256(canonical).hexdigest()
    file.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def _set(key, value):
    return lambda body: body.update({key: value})


def _set_in(key, index, value):
    return lambda body: body[key].__setitem__(index, value)


# Manifests that a checksum does not catch (a writer's bug, an edit re-signed): each is refused
# on opening, with a message naming the file.
BAD_FIELDS = [
    (_set_in("length", 0, -1), "env 0's `length` is -1"),
    (_set("length", [5]), "`length` must be a list of 2 ints, one per env, got [5]"),
    (_set("start", [0, "1"]), "`start` must be a list of 2 ints"),
    (_set_in("start", 1, -3), "env 1's `start` is -3"),
    (_set("start", [2**31 - 1, 0]), "ends at step"),
    (_set_in("length", 0, True), "`length` must be a list of 2 ints"),
    (_set("num_envs", 0), "`num_envs` must be an int in"),
    (_set("chunk_length", 2.5), "`chunk_length` must be an int in"),
    (_set("writes", -1), "`writes` must be an int >= 0"),
    (_set("leaves", []), "`leaves` must be a non-empty list"),
    (_set_in("leaves", 0, {"path": "x", "shape": [-1], "dtype": "int32"}), "leaf 0 must be"),
    (_set_in("leaves", 0, {"path": "x", "shape": [], "dtype": "object"}), "leaf 0 must be"),
    (_set("priorities", {"period": 2}), "`priorities` must be null or"),
    (lambda b: b.pop("start"), "it lacks ['start']"),
    (_set("extra", 1), "it has unknown keys ['extra']"),
    (_set("library", 2), "`library` must be a string"),
    (_set("digests", {}), "`digests` must map"),
    (_set("segments", [{"name": "priorities/0"}]), "it lists priority segments but no"),
]


@pytest.mark.parametrize("change, message", BAD_FIELDS)
def test_a_manifest_with_bad_fields_is_refused_naming_it(tmp_path, change, message):
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    ds.append(_steps(np.arange(2)[:, None], np.arange(3)[None, :]))
    _resign(tmp_path / "d", change)
    with pytest.raises(ValueError) as error:
        dx.Dataset.open(tmp_path / "d", STEP)
    assert repr(str(tmp_path / "d" / "manifest.json")) in str(error.value)
    assert message in str(error.value)


# An error edge of reading: the slow tier.
@SLOW
def test_a_segment_outside_the_stored_steps_is_refused(tmp_path):
    _, ds = _prioritised_history(tmp_path)
    segment = lambda body: body["segments"][-1]["count"].__setitem__(0, 1000)  # noqa: E731
    _resign(ds.path, segment)
    with pytest.raises(ValueError, match="holds windows of env 0 that are not whole windows"):
        dx.Dataset.open(ds.path, STEP)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "it is empty"),
        (b'{"format": 2, "num_en', "it is not valid JSON"),
        (b"[1, 2]", "it holds a JSON list, not an object"),
        (b"{}", "has format None"),
        (b'{"format": 2}', "it has no checksum"),
        (b"\xff\xfe", "it is not valid JSON"),
    ],
)
def test_an_unreadable_manifest_is_refused_naming_it(tmp_path, content, message):
    dx.Dataset.create(tmp_path / "d", STEP, 2)
    (tmp_path / "d" / "manifest.json").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        dx.Dataset.open(tmp_path / "d", STEP)
    assert repr(str(tmp_path / "d" / "manifest.json")) in str(error.value)


def test_a_manifest_not_byte_for_byte_as_written_is_refused(tmp_path):
    # The same contents and a valid checksum, in other bytes (an editor's re-indentation, or
    # `1e-05` for `1E-05`): refused, so that no changed bit passes.
    dx.Dataset.create(tmp_path / "d", STEP, 2)
    file = tmp_path / "d" / "manifest.json"
    file.write_text(json.dumps(json.loads(file.read_text()), indent=2, sort_keys=True))
    with pytest.raises(ValueError, match="its bytes are not those dejax_eqx writes"):
        dx.Dataset.open(tmp_path / "d", STEP)


def test_unclear_input_is_refused_with_its_reason(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a dataset directory"):
        dx.Dataset.open(tmp_path / "file", STEP)
    # Arguments are checked before anything is made on disk: the call can be made again.
    # (Under the tests' type-checking hook, the annotation refuses it first.)
    with pytest.raises(TypeError, match=r"`Dataset.create\(sync=...\)` must be a bool|'sync'"):
        dx.Dataset.create(tmp_path / "d", STEP, 2, sync="no")  # pyright: ignore[reportArgumentType]
    assert not (tmp_path / "d").exists()
    with pytest.raises(TypeError, match=r"`Dataset.create\(path=...\)` must be a str|'path'"):
        dx.Dataset.create(None, STEP, 2)  # pyright: ignore[reportArgumentType]
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2, sync=True)
    ds.append(_steps(np.arange(2)[:, None], np.arange(10)[None, :]))
    for bad in [1.0, None, "3", True, np.float32(2), jnp.asarray(2.0), np.array([1, 2])]:
        with pytest.raises(TypeError, match=r"`Dataset.read\(start=...\)` must be an int|'start'"):
            ds.read(0, bad, 5)
    with pytest.raises(TypeError, match=r"`Dataset.read\(env=...\)` must be an int|'env'"):
        ds.read(True, 0, 5)
    with pytest.raises(TypeError, match=r"`Dataset.priorities\(stop=...\)` must be an int|'stop'"):
        ds.priorities(0, 0, 5.0)
    # What `sample` returns names steps to read: JAX integer scalars are ints.
    s = ds.sample(jax.random.key(0), 1, dx.Window(3, strict=True))
    got = ds.read(s.env[0], s.start[0], s.start[0] + 3)
    np.testing.assert_array_equal(got["obs"], s.items["obs"][0])
    buf = dx.TrajectoryBuffer(STEP, 2, 8)
    with pytest.raises(
        TypeError, match="the buffer's leaves are traced: a dataset is written on the host"
    ):
        eqx.filter_jit(ds.write)(buf)
    steps = _steps(np.arange(2)[:, None], 10 + np.arange(2)[None, :])
    with pytest.raises(TypeError, match="`Dataset.append`: the steps are traced"):
        jax.jit(ds.append)(steps)
    abstract = eqx.filter_eval_shape(dx.TrajectoryBuffer, STEP, 2, 8)
    with pytest.raises(TypeError, match="include a ShapeDtypeStruct, not an array: an abstract"):
        ds.write(abstract)
    assert ds.lengths.tolist() == [10, 10]


def test_two_dataset_objects_on_one_path_take_turns(tmp_path):
    path = tmp_path / "d"
    first = dx.Dataset.create(path, STEP, 2, chunk_length=4)
    second = dx.Dataset.open(path, STEP)
    reader = dx.Dataset.open(path, STEP)
    ids = np.arange(2)[:, None]
    first.append(_steps(ids, np.arange(5)[None, :]))  # takes the lock
    with pytest.raises(RuntimeError, match="another writer holds .* Nothing was written"):
        second.append(_steps(ids, np.arange(5)[None, :]))
    first.close()
    # The lock is free, but `second` has not seen `first`'s commit: it would write over it.
    with pytest.raises(RuntimeError, match="changed since this Dataset read or committed it"):
        second.append(_steps(ids, np.arange(5)[None, :]))
    with dx.Dataset.open(path, STEP) as third:
        third.append(_steps(ids, 5 + np.arange(5)[None, :]))
    # Released on leaving the `with`, and when a writer is garbage collected.
    fourth = dx.Dataset.open(path, STEP)
    fourth.append(_steps(ids, 10 + np.arange(2)[None, :]))
    del fourth
    gc.collect()
    first = dx.Dataset.open(path, STEP)
    first.append(_steps(ids, 12 + np.arange(2)[None, :]))
    assert reader.lengths.tolist() == [0, 0]  # readers take no lock, and see their commit
    assert dx.Dataset.open(path, STEP).lengths.tolist() == [14, 14]
    for e in range(2):
        _assert_holds(dx.Dataset.open(path, STEP), e, 0, 14)


def test_a_failed_prioritised_write_keeps_the_committed_masses(tmp_path, monkeypatch):
    # The case: one window at priority 1, then a write that fails before its commit,
    # from a buffer that gave it priority 5: the committed mass stays 1.
    buffers = _prioritised_buffers()
    ds = dx.Dataset.create(tmp_path / "d", STEP, 3, chunk_length=4)
    for buf in buffers[:4]:
        ds.write(buf)
    committed = _stored_masses(buffers[:4], ds.starts)
    assert _stored_masses(buffers[:5], ds.starts) != committed  # write 4 changes some

    def fail(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(_dataset, "_BEFORE_COMMIT", fail)
    with pytest.raises(KeyboardInterrupt):
        ds.write(buffers[4])
    monkeypatch.setattr(_dataset, "_BEFORE_COMMIT", None)
    ds.close()
    reopened = dx.Dataset.open(tmp_path / "d", STEP)
    _assert_masses(reopened, committed)
    for buf in buffers[4:]:  # and the writes go on from there
        reopened.write(buf)
    _assert_masses(reopened, _stored_masses(buffers, reopened.starts))


FORMAT1 = ROOT / "tests" / "data" / "dataset_format1"


# Datasets of the previous format: the slow tier.
@SLOW
def test_a_format1_dataset_opens_reads_and_refuses_writes(tmp_path):
    # tests/data/dataset_format1 was written by the format-1 `Dataset` (dejax_eqx 0.1's
    # format, without checksums) from `_prioritised_buffers()`: 3 envs in chunks of 4 steps,
    # `done`'s all-False chunks not stored (format 1 reads them as the fill value).
    path = tmp_path / "old"
    shutil.copytree(FORMAT1, path)
    assert not (path / "leaves/1/c/0/0").exists()
    buffers = _prioritised_buffers()
    ds = dx.Dataset.open(path, STEP)
    np.testing.assert_array_equal(ds.ends, buffers[-1].step_count)
    for e in range(3):
        _assert_holds(ds, e, 0, int(ds.ends[e]))
    _assert_masses(ds, _stored_masses(buffers, ds.starts))
    loaded = ds.load(_prioritised())
    np.testing.assert_array_equal(loaded.tree.leaves, buffers[-1].tree.leaves)
    manifest = (path / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="is a format-1 dataset .* takes no new steps"):
        ds.write(buffers[-1])
    with pytest.raises(ValueError, match=r"Copy it into a new dataset .*\.write\(old\.load"):
        ds.append(_steps(np.arange(3)[:, None], ds.ends[:, None]))
    assert (path / "manifest.json").read_bytes() == manifest
    assert not (path / "writer.lock").exists()
    # The way on: a copy, through a buffer that holds every step.
    new = dx.Dataset.create(tmp_path / "new", STEP, 3)
    new.write(ds.load(dx.PrioritisedTrajectoryBuffer(STEP, 3, 64, WINDOW)))
    np.testing.assert_array_equal(new.starts, ds.starts)
    np.testing.assert_array_equal(new.ends, ds.ends)
    for e in range(3):
        _assert_holds(new, e, 0, int(ds.ends[e]))
        old = ds.priorities(e, 0, int(ds.ends[e]))
        np.testing.assert_array_equal(
            new.priorities(e, 0, int(ds.ends[e]))[~np.isnan(old)], old[~np.isnan(old)]
        )


# ---------------------------------------------------------------------------------------------
# Crash safety: a writer killed with SIGKILL in the middle of a write


_WRITER = """
import sys
import numpy as np
import dejax_eqx as dx
from dejax_eqx import _dataset
from tests.test_dataset import STEP, _steps

path, chunks, per_write, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ds = dx.Dataset.create(path, STEP, 4, chunk_length=chunks)
envs = np.arange(4)[:, None]
for k in range(1000):
    if k == 3 and stop_at == "before-commit":
        def block(_):
            print("data written", flush=True)
            sys.stdin.readline()  # until killed
        _dataset._BEFORE_COMMIT = block
    print(f"begin {k}", flush=True)
    ds.append(_steps(envs, k * per_write + np.arange(per_write)[None, :]))
"""


def _kill_writer(tmp_path, chunks: int, per_write: int, stop_at: str, line: str) -> Path:
    path = tmp_path / "d"
    command = [sys.executable, "-c", textwrap.dedent(_WRITER), str(path), str(chunks)]
    with subprocess.Popen(
        [*command, str(per_write), stop_at],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout is not None
        try:
            for got in writer.stdout:
                if got.strip() == line:
                    writer.send_signal(signal.SIGKILL)
                    break
            else:
                pytest.fail(f"the writer ended without printing {line!r}")
        finally:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    return path


def _check_after_crash(path: Path, possible: list[int], per_write: int) -> None:
    ds = dx.Dataset.open(path, STEP)
    length = int(ds.lengths[0])
    assert ds.lengths.tolist() == [length] * 4 and length in possible
    for e in range(4):
        _assert_holds(ds, e, 0, length)
    # The next write goes where the killed one left its uncommitted steps, and replaces them.
    envs = np.arange(4)[:, None]
    ds.append(_steps(envs, length + np.arange(per_write)[None, :]))
    reopened = dx.Dataset.open(path, STEP)
    for e in range(4):
        _assert_holds(reopened, e, 0, length + per_write)


# A writer process killed: CI's slow tier, as the runs across real processes; writers killed
# at a stage and at a random point run in the default tier (tests/test_dataset_faults.py).
@SLOW
def test_a_writer_killed_before_its_commit_leaves_the_previous_end(tmp_path):
    # Every chunk of write 3 is on disk (in chunks shared with committed steps, too); only
    # the manifest is not: the dataset still ends after write 2.
    path = _kill_writer(tmp_path, 4, 6, "before-commit", "data written")
    assert not list(path.glob(".manifest.json.*"))
    # Write 3's steps are on disk past the committed end, where no read reaches them.
    ds = dx.Dataset.open(path, STEP)
    past_end = ds._files.leaves[0][2, 18:24].read().result()
    np.testing.assert_array_equal(past_end, _steps(np.full(6, 2), np.arange(18, 24))["action"])
    _check_after_crash(path, [18], 6)


@SLOW
def test_a_writer_killed_as_a_large_write_starts_leaves_a_readable_dataset(tmp_path):
    # Killed as write 2 starts, 8,000 steps of 4 envs in 64-step chunks: the dataset ends
    # after write 1, or, if write 2 finished in the moment before the kill, after it.
    path = _kill_writer(tmp_path, 64, 8_000, "run", "begin 2")
    _check_after_crash(path, [16_000, 24_000], 8_000)
