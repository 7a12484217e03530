"""The envpool async example runs (a short version), when envpool is installed; and, in the
slow tier, the R2D2 example's smoke run with `--stored-state`."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest


pytest.importorskip("envpool")

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "envpool_async.py"


# gymnasium warns that envpool's CartPole observation bounds are stored as float32.
@pytest.mark.filterwarnings("ignore:.*precision lowered:UserWarning")
def test_envpool_async_example(capsys):
    spec = importlib.util.spec_from_file_location("envpool_async", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(num_envs=6, batch_size=4, num_recvs=60, learn_every=10, max_length=32)
    # 240 steps over 6 envs: 40 each, kept up to max_length.
    assert summary["steps"] == 240 and summary["learner_steps"] == 6
    assert summary["lengths"].tolist() == [32] * 6
    assert 0 < summary["valid_fraction_online"] <= 1 and 0 < summary["valid_fraction"] <= 1
    out = capsys.readouterr().out
    assert "fraction of valid steps" in out and "per-env replay lengths" in out
    assert np.isfinite(summary["episode_ends_per_batch"])


@pytest.mark.slow
def test_r2d2_envpool_stored_state_smoke(tmp_path):
    # The zero-state smoke run is tests/test_examples.py's; this is R2D2's other strategy.
    for module in ("optax", "matplotlib", "tqdm"):
        pytest.importorskip(module)
    script = str(EXAMPLE.parent / "r2d2_envpool.py")
    result = subprocess.run(
        [sys.executable, script, "--smoke", "--stored-state", "--seed", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("seed 3: greedy return ") and "over 4 episodes after 1536" in last
    counts = re.search(r"stored state: (\d+) of (\d+) write-back entries dropped as stale", last)
    assert counts is not None, last
    # Every learner step after the first writes back the states after the burn-in.
    assert int(counts[2]) > 0 and 0 <= int(counts[1]) <= int(counts[2])
    assert (tmp_path / "r2d2_envpool.png").read_bytes().startswith(b"\x89PNG")
