"""The envpool async example runs (a short version), when envpool is installed."""

import importlib.util
import pathlib

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
