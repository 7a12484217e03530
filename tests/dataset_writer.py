"""The writer processes of the fault-injection tests of `dx.Dataset`
(tests/test_dataset_faults.py), and what they write.

    python -m tests.dataset_writer PATH KIND STOP BUFFERS

makes a dataset at PATH and makes the writes `plan(KIND)` describes, one after the other,
printing `begin K` before write K and `done K` after its commit, then `finished`, and waits
to be killed. KIND is `append` (steps given directly, to a few envs at a time), `write` (a
`TrajectoryBuffer`'s steps) or `prioritised` (a `PrioritisedTrajectoryBuffer`'s steps and
window masses, priorities set between writes). The buffers are read from `BUFFERS/K.dx`,
where the test saved them (computing them here would compile for seconds). STOP is `none`,
`STAGE:K`: write K blocks at STAGE, printing `at STAGE`, until the process is killed, or
`line:K:N`: the process kills itself (SIGKILL) at the N-th line that the package's code
executes during write K (while tensorstore's threads may be writing), a reproducible point
anywhere inside the write:

- `steps`: after the steps' chunks, before the priority segment and the manifest;
- `segment`: after the priority segment, before the manifest;
- `commit`: everything but the manifest (`_dataset._BEFORE_COMMIT`);
- `rename`: half of the new manifest is in its temporary file, not renamed over the old.

    python -m tests.dataset_writer PATH contend TAG MODE

is one of two writers of the same dataset (`contend`): 40 appends of tagged steps to every
env. MODE `hold`: one `Dataset` for all of them, stopping at the first refusal; `retry`:
each append through a new `Dataset` (`with ... as ds`), retried while refused. It prints
`ready` once its first `Dataset` is open, waits for a line on stdin, and prints
`appended ENV_START LENGTH` for each committed append and `refused MESSAGE` for each
refusal.
"""

import os
import signal
import sys
from pathlib import Path

import dejax_eqx as dx
import equinox as eqx
import jax.numpy as jnp
import numpy as np


NUM_ENVS = 4
CHUNK = 8
STEP = {
    "obs": jnp.zeros(3, jnp.float32),
    "action": jnp.zeros((), jnp.int32),
    "done": jnp.zeros((), jnp.bool_),
}
WINDOW = dx.Window(3, burn_in=1, bootstrap=1, period=2, strict=True)
MAX_LENGTH = 64
WRITES = 5  # of each kind


def steps(env, step, tag: float = 0.5) -> dict[str, np.ndarray]:
    """The step numbered `step` of env `env` (`tag` marks the writer that wrote it): every
    value is a function of them, so any step read back can be checked. Shapes follow
    `step`."""
    env, step = np.broadcast_arrays(np.asarray(env), np.asarray(step))
    base = (env * 100_000 + step).astype(np.float32)
    return {
        "obs": base[..., None] + np.array([0.0, 0.25, tag], np.float32),
        "action": ((env + step) % 5).astype(np.int32),
        "done": (step % 7) == 6,
    }


def appends() -> list[tuple[np.ndarray, int]]:
    """`append`'s writes: `(env_ids, T)`, a few envs at a time, ends off the chunks; write 3
    is large (so that a kill after a random delay lands inside it)."""
    rng = np.random.default_rng(11)
    out = []
    for k in range(WRITES):
        ids = np.sort(rng.permutation(NUM_ENVS)[: rng.integers(1, NUM_ENVS + 1)])
        out.append((ids, 600 if k == 3 else int(rng.integers(1, 3 * CHUNK))))
    return out


def like(kind: str):
    if kind == "prioritised":
        return eqx.filter_eval_shape(
            lambda: dx.PrioritisedTrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH, WINDOW)
        )
    return eqx.filter_eval_shape(lambda: dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH))


def _block(stage: str) -> None:
    print(f"at {stage}", flush=True)
    _wait_to_be_killed()


def _wait_to_be_killed() -> None:
    while True:
        signal.pause()


def _kill_at_line(k: int, n: int, current: list[int]) -> None:
    """SIGKILL this process at the `n`-th line executed in the package's own files during
    write `k` (counted by a trace function, so the point is the same on every run)."""
    package = str(Path(dx.__file__).parent)
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def trace(frame, event, arg):
        if current[0] == k and frame.f_code.co_filename.startswith(package):
            return local
        return None

    sys.settrace(trace)


def _stop_at(stop: str, current: list[int]) -> None:
    """Install the hook that blocks write `K` at `STAGE` (`stop` is `STAGE:K`)."""
    from dejax_eqx import _dataset

    stage, k = stop.split(":")
    due = lambda: current[0] == int(k)  # noqa: E731
    if stage == "commit":
        _dataset._BEFORE_COMMIT = lambda _: due() and _block(stage)
        return
    from dejax_eqx import _dataset_files  # the other stages are inside its functions

    if stage in ("steps", "segment"):
        name = "write" if stage == "steps" else "write_segment"
        original = getattr(_dataset_files.Files, name)

        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            if due():
                _block(stage)
            return out

        setattr(_dataset_files.Files, name, wrapped)
    elif stage == "rename":
        replace = _dataset_files.replace_atomically

        def half(path, write, *, sync=True):
            if not due():
                return replace(path, write, sync=sync)

            def write_half(file):
                class Half:
                    def write(self, data):
                        file.write(data[: len(data) // 2])
                        file.flush()
                        _block(stage)

                write(Half())

            return replace(path, write_half, sync=sync)

        _dataset_files.replace_atomically = half
    else:
        raise ValueError(stop)


def _write(path: str, kind: str, stop: str, buffers: str) -> None:
    current = [-1]
    if stop.startswith("line:"):
        _, k, n = stop.split(":")
        _kill_at_line(int(k), int(n), current)
    elif stop != "none":
        _stop_at(stop, current)
    ds = dx.Dataset.create(path, STEP, NUM_ENVS, chunk_length=CHUNK, sync=False)
    plan = appends()
    template = like(kind)
    for k in range(WRITES):
        buffer = None if kind == "append" else dx.load(Path(buffers) / f"{k}.dx", template)
        current[0] = k
        print(f"begin {k}", flush=True)
        if kind == "append":
            ids, length = plan[k]
            ends = ds.ends[ids]
            ds.append(steps(ids[:, None], ends[:, None] + np.arange(length)), env_ids=ids)
        else:
            assert buffer is not None
            ds.write(buffer)
        print(f"done {k}", flush=True)
    print("finished", flush=True)
    _wait_to_be_killed()


def _contend(path: str, tag: float, mode: str) -> None:
    length = 5 + int(tag * 4)  # the two writers append different lengths
    ds: dx.Dataset | None = dx.Dataset.open(path, STEP, sync=False)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(40):
        while True:
            try:
                if mode == "retry":
                    ds = dx.Dataset.open(path, STEP, sync=False)
                assert ds is not None  # dropped below only in "retry" mode, which reopens it
                try:
                    at = ds.ends
                    envs = np.arange(NUM_ENVS)[:, None]
                    ds.append(steps(envs, at[:, None] + np.arange(length), tag))
                finally:
                    if mode == "retry":
                        ds = None  # releases its lock (as `close()` would)
                print("appended", " ".join(map(str, at)), length, flush=True)
                break
            except RuntimeError as error:
                print("refused", str(error).replace("\n", " "), flush=True)
                if mode == "hold":
                    return
                os.sched_yield()  # and try again


if __name__ == "__main__":
    if sys.argv[2] == "contend":
        _contend(sys.argv[1], float(sys.argv[3]), sys.argv[4])
    else:
        _write(*sys.argv[1:5])
