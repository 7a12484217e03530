"""The global buffers across real processes: `multi_process.py`'s checks, run in 2 processes
of 2 CPU devices each on 127.0.0.1 (the real `jax.distributed` runtime, CPU collectives over
gloo), and orbax checkpoints and datasets written by 2 processes read by 1 process of 4
devices, and the other way round.

Three launches: 1 process (of 4 devices) saves; 2 processes run every check, restore that and
save; 1 process restores that. Every launch is bounded in time: a check that fails in one process
can leave the other waiting in a collective.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from .helpers import SLOW
from .multi_process import CHECKS


ROOT = Path(__file__).parent.parent
TIMEOUT_S = 240  # per launch; a launch takes about 20 s on 2 idle cores

pytestmark = [
    pytest.mark.skipif(
        not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
    ),
    # Real processes (minutes of a 2-core machine): in CI's `pytest -m slow`; the same
    # buffers on 4 devices of one process are in the default run (tests/test_global.py,
    # tests/test_layers.py, tests/test_sharding.py).
    SLOW,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, processes: int, devices: int, checks: list[str]) -> dict[int, str]:
    """Run `checks` in `processes` processes; returns each process's output."""
    port = _free_port()
    # The processes inherit the tests' XLA flags (conftest.py: compile fast); each adds its
    # own device count.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "tests.multi_process", "--processes", str(processes)]
    command += ["--devices", str(devices), "--port", str(port), "--out", str(out)]
    command += ["--checks", ",".join(checks)]
    logs = {i: out / f"launch-{processes}p-{i}.log" for i in range(processes)}
    files = [logs[i].open("w") for i in range(processes)]
    running = [
        subprocess.Popen(
            [*command, "--id", str(i)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        )
        for i, f in enumerate(files)
    ]
    try:
        for process in running:
            process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
        for f in files:
            f.close()
    return {i: logs[i].read_text() + f"\n[exit {running[i].returncode}]" for i in logs}


RUN_CHECKS = [name for name in CHECKS if name not in ("save", "datasets", "restore")]
SAVE = ["save", "datasets"]


# One test, not several sharing a fixture: under `pytest -n 2` they could land on both workers,
# and each would launch the processes.
def test_global_buffers_across_processes_and_checkpoints_across_topologies(tmp_path):
    one = _launch(tmp_path, 1, 4, SAVE)
    _passed(one, SAVE)
    two = _launch(tmp_path, 2, 2, [*RUN_CHECKS, "restore", *SAVE])  # restores what 1 saved
    _passed(two, [*RUN_CHECKS, "restore", *SAVE])
    again = _launch(tmp_path, 1, 4, ["restore"])  # restores what 2 processes saved
    _passed(again, ["restore"])


def _passed(logs: dict[int, str], names: list[str]) -> None:
    for i, log in logs.items():
        for name in names:
            if f"process {i}: {name} passed" not in log:
                pytest.fail(f"{name!r} did not pass in process {i} of {len(logs)}:\n{log[-6000:]}")
