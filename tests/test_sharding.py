"""Sharding over several devices, and saving from them: checked on 4 CPU devices.

The checks live in `four_devices.py` and run in one subprocess, because
`--xla_force_host_platform_device_count` only takes effect before JAX starts and this process
has already started it with one device. This file runs that subprocess once, then checks here,
on one device, what it saved from four.
"""

import os
import subprocess
import sys
from pathlib import Path

import dejax_eqx as dx
import equinox as eqx
import jax
import numpy as np
import pytest


ROOT = Path(__file__).parent.parent


# four_devices.py runs docs/sharding.md and examples/sharding_*.py, written for JAX 0.7+. On
# 0.5.3, besides the missing names, the experimental shard_map has no replication rule for
# equinox's error check and explicit mesh axes reject a select of mixed shardings.
@pytest.mark.skipif(
    not hasattr(jax.sharding, "reshard"),
    reason="sharding needs JAX 0.7+ (jax.shard_map, jax.sharding.reshard, explicit mesh axes)",
)
def test_four_device_checks_pass_and_their_files_load_onto_one_device(
    tmp_path_factory, pytestconfig
):
    # One test, not two sharing a fixture: under `pytest -n 2` the two could land on both
    # workers, and each would run the subprocess.
    result, out = _run_four_devices(tmp_path_factory, pytestconfig)
    report = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, report
    assert " passed" in result.stdout and "skipped" not in result.stdout, report
    _check_buffers_saved_from_four_devices_load_onto_one(out)


def _run_four_devices(tmp_path_factory, pytestconfig):
    out = tmp_path_factory.mktemp("four_devices")
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "DEJAX_EQX_FOUR_DEVICE_OUT": str(out)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "four_devices.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--basetemp={out / 'tmp'}",
    ]
    profile = pytestconfig.getoption("hypothesis_profile", None)
    if profile is not None:
        command.append(f"--hypothesis-profile={profile}")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    return result, out


def _check_buffers_saved_from_four_devices_load_onto_one(out):
    assert jax.device_count() == 1
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import sharding_anakin
    finally:
        sys.path.pop(0)
    like = eqx.filter_vmap(lambda: dx.UniformReplay(sharding_anakin.ITEM, 37), axis_size=4)()
    loaded = dx.load(out / "sharded.dx", like=like)
    expected = np.load(out / "expected.npz")
    leaves = jax.tree.leaves(loaded)
    assert len(leaves) == len(expected.files)
    for i, leaf in enumerate(leaves):
        assert leaf.sharding.device_set == {jax.devices()[0]}
        want = expected[f"arr_{i}"]
        assert (leaf.shape, leaf.dtype) == (want.shape, want.dtype)
        assert np.asarray(leaf).tobytes() == want.tobytes()
    sizes = eqx.filter_vmap(lambda buffer: buffer.size)(loaded)
    assert np.asarray(sizes).tolist() == [37] * 4
