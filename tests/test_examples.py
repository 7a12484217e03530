"""The examples run end to end: the DQN demo in its smoke mode, and the quickstart.

They need the `examples` extra. `.ci/run` installs it; elsewhere the tests are skipped without it,
except under CI (`CI` set), where a missing extra fails instead of passing unnoticed.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = f"needs {', '.join(missing)}: pip install -e '.[examples]'"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _run(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    # A fresh interpreter: the examples run as users run them, without the tests' jaxtyping hook
    # or strict promotion settings.
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_dqn_cartpole_smoke(tmp_path):
    _require("gymnax", "optax", "matplotlib", "tqdm")
    result = _run([str(ROOT / "examples" / "dqn_cartpole.py"), "--smoke", "--seed", "3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 3: mean greedy return" in result.stdout
    assert "smoke run: no learning threshold" in result.stdout
    # It says why it stopped, and it evaluated after the prefill and after each of the three
    # 128-step chunks up to its 512-step cap.
    assert "step cap reached: 512 env steps >= 512; stopping" in result.stdout
    assert "learning curve (4 evaluations, 128 env steps apart" in result.stdout
    # The learning curve lands in the working directory.
    png = tmp_path / "dqn_cartpole.png"
    assert png.read_bytes().startswith(b"\x89PNG")


def test_dqn_cartpole_reports_failure(tmp_path):
    # An unreachable bar (an episode pays at most 500) and the smallest budget: the demo must say
    # so and exit non-zero, so that it can serve as an end-to-end check.
    _require("gymnax", "optax", "matplotlib", "tqdm")
    script = str(ROOT / "examples" / "dqn_cartpole.py")
    result = _run([script, "--max-steps", "1", "--target-return", "501"], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED: the mean greedy return did not reach 501 within 1 environment steps" in (
        result.stderr
    )
    assert "step cap reached:" in result.stdout


def test_quickstart(tmp_path):
    result = _run([str(ROOT / "examples" / "quickstart.py")], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buffer updated in place: True" in result.stdout
