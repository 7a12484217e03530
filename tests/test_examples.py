"""The examples run end to end: the DQN demos in their smoke modes, and the quickstart.

They need the `examples` extra. `.ci/run` installs it; elsewhere the tests are skipped without it,
except under CI (`CI` set), where a missing extra fails instead of passing unnoticed.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = f"needs {', '.join(missing)}: pip install -e '.[examples,offline]'"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _run(args: list[str], cwd: pathlib.Path, timeout: float = 600) -> subprocess.CompletedProcess:
    # A fresh interpreter: the examples run as users run them, without the tests' jaxtyping hook
    # or strict promotion settings.
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


# The examples' runs, half a minute of a 2-core machine or more each, are in CI's slow tier
# (tests/helpers.py) but for the quickstart: the default tier runs it and the R2D2 example's
# targets against a reference (below).
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_multi_process_dqn_smoke(tmp_path):
    # The launcher starts two processes of a `jax.distributed` program on this machine, each
    # with its own actors and replay shard; both run to the step cap and stop together.
    _require("gymnax", "optax")
    script = str(ROOT / "examples" / "multi_process_dqn.py")
    # Well above the smoke run's 15-25 s: the launcher stops the processes itself at 120 s.
    result = _run([script, "--smoke", "--seed", "3", "--max-seconds", "60"], tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 processes x 1 devices: one GlobalReplay of 2 UniformReplay shards" in result.stdout
    assert "step cap reached: 512 env steps >= 512; stopping" in result.stdout
    # The learner ran in both processes on the same batches: the same parameters.
    assert "q-network bit-identical on all 2 devices: True" in result.stdout
    # Per step, only the replay's sample crosses processes: the shards' sizes (one 32-bit word
    # each: a uniform law's summary) and the batch of 32 transitions of 11 32-bit words; no
    # gradient.
    assert "total: 1,416 bytes per training step" in result.stdout
    assert "smoke run: no learning threshold" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
)
def test_multi_process_actors_smoke(tmp_path):
    # Two processes of a `jax.distributed` program, each with an actor thread and a learner
    # thread around its own `ReplayService` over one GlobalReplay, under one global
    # samples-per-insert law: both run to the step cap and stop together.
    _require("gymnax", "optax")
    script = str(ROOT / "examples" / "multi_process_actors.py")
    # Well above the smoke run's 20-35 s: the launcher stops the processes itself at 150 s.
    result = _run([script, "--smoke", "--seed", "3", "--max-seconds", "60"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 processes x 1 devices: one GlobalReplay of 2 UniformReplay shards" in result.stdout
    assert "step cap reached" in result.stdout
    # The replicated learners sampled the same batches and made the same updates.
    assert "q-network bit-identical on all 2 devices: True" in result.stdout
    # The achieved samples per insert, over both processes, lies in the law's window.
    (spi,) = [line for line in result.stdout.splitlines() if line.startswith("samples per insert")]
    assert "(target 16, window [" in spi and " 0 rows sampled" not in spi
    assert spi.endswith("within the window: True")
    # Every process counted its own inserts; exchanged, they are the transitions stored.
    counted = r"the services counted ([\d,]+) inserts for ([\d,]+) transitions"
    ((inserts, transitions),) = re.findall(counted, result.stdout)
    assert inserts == transitions
    assert "smoke run: no learning threshold" in result.stdout


def test_quickstart(tmp_path):
    result = _run([str(ROOT / "examples" / "quickstart.py")], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buffer updated in place: True" in result.stdout


def _load_example(name: str):
    """Import `examples/<name>.py` in this process (for its functions, not its `main`)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_targets(cfg, items, mask, q_online, q_target):
    """The R2D2 example's n-step double-Q targets, one step at a time in NumPy."""
    b, length, n, g, eps = cfg.burn_in, cfg.sequence_length, cfg.n_step, cfg.gamma, cfg.rescale_eps

    def h(x):
        return np.sign(x) * (np.sqrt(abs(x) + 1) - 1) + eps * x

    def h_inv(x):
        return np.sign(x) * (((np.sqrt(1 + 4 * eps * (abs(x) + 1 + eps)) - 1) / (2 * eps)) ** 2 - 1)

    term, trunc, reward = items["terminated"], items["truncated"], items["reward"]
    target = np.zeros((mask.shape[0], length))
    valid = np.zeros((mask.shape[0], length), bool)
    for row in range(mask.shape[0]):
        for t in range(length):
            p = b + t  # the window position of the step the target is for
            ret, discount, boot = 0.0, g**n, p + n
            for i in range(1, n + 1):
                ret += g ** (i - 1) * reward[row, p + i]
                if term[row, p + i] or trunc[row, p + i]:
                    discount, boot = (0.0 if term[row, p + i] else g**i), p + i
                    break
            valid[row, t] = mask[row, p] and not (term[row, p] or trunc[row, p]) and mask[row, boot]
            action = np.argmax(q_online[row, boot - b])
            target[row, t] = h(ret + discount * h_inv(q_target[row, boot - b, action]))
    return target, valid


def test_r2d2_targets_match_a_step_by_step_reference():
    _require("envpool", "optax", "matplotlib", "tqdm")
    r2d2 = _load_example("r2d2_envpool")
    cfg = r2d2.Config(burn_in=2, sequence_length=6, n_step=3)
    batch, window = 64, cfg.burn_in + cfg.sequence_length + cfg.n_step
    rng = np.random.default_rng(0)
    ends = rng.random((batch, window))
    items = {
        "reward": rng.standard_normal((batch, window)).astype(np.float32),
        "terminated": ends < 0.1,
        "truncated": (ends >= 0.1) & (ends < 0.2),
    }
    # Windows that run past their env's newest step: a real prefix, then masked steps.
    mask = np.arange(window)[None, :] < rng.integers(cfg.burn_in + 1, window + 1, (batch, 1))
    q_online, q_target = (
        rng.standard_normal((batch, window - cfg.burn_in, 2)).astype(np.float32) * 5
        for _ in range(2)
    )
    target, valid = r2d2.n_step_targets(
        cfg,
        {k: jnp.asarray(v) for k, v in items.items()},
        jnp.asarray(mask),
        jnp.asarray(q_online),
        jnp.asarray(q_target),
    )
    expected_target, expected_valid = _reference_targets(cfg, items, mask, q_online, q_target)
    np.testing.assert_array_equal(np.asarray(valid), expected_valid)
    # Every branch is exercised: terminations, truncations, full n-step returns, masked ends.
    assert 0 < expected_valid.sum() < expected_valid.size
    np.testing.assert_allclose(np.asarray(target), expected_target, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_r2d2_envpool_smoke(tmp_path):
    _require("envpool", "optax", "matplotlib", "tqdm")
    script = str(ROOT / "examples" / "r2d2_envpool.py")
    result = _run([script, "--smoke", "--seed", "3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    # The contract: the last line reports the greedy return, env steps and wall time.
    assert (
        lines[-1].startswith("seed 3: greedy return ")
        and "over 4 episodes after 1536" in (lines[-1])
    )
    assert "stale priority updates dropped" in result.stdout
    assert (tmp_path / "r2d2_envpool.png").read_bytes().startswith(b"\x89PNG")
    result = _run([script, "--smoke", "--throughput"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for variant in ("no buffer call", "jax.jit add", "eqx.filter_jit add", "raw scatter"):
        assert variant in result.stdout


@pytest.mark.slow
def test_sebulba_cartpole_smoke(tmp_path):
    # Actor threads, a learner thread and the main thread's evaluations through a
    # `ReplayService`: it runs to its step cap, shuts every thread down and draws the figure.
    _require("envpool", "optax", "matplotlib")
    script = str(ROOT / "examples" / "sebulba_cartpole.py")
    result = _run([script, "--smoke", "--seed", "3"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step cap reached" in result.stdout
    assert "smoke run: no learning threshold" in result.stdout
    # The learner sampled (the counts are reported) and the target ratio was stated.
    (counts,) = [line for line in result.stdout.splitlines() if "rows sampled" in line]
    assert "target 16" in counts and " 0 rows sampled" not in counts
    assert (tmp_path / "sebulba_cartpole.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_her_bitflip_smoke(tmp_path):
    _require("optax", "matplotlib")
    script = str(ROOT / "examples" / "her_bitflip.py")
    result = _run(
        [script, "--smoke", "--seeds", "0", "--compare", "--out", str(tmp_path)], tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "HER final success per seed:" in result.stdout
    assert "DQN final success per seed:" in result.stdout
    assert (tmp_path / "her_bitflip.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_offline_to_online_smoke(tmp_path):
    # A behaviour DQN, its Minari dataset, `dx.load_minari`, and DQN from a `dx.Mixture` of the
    # offline and online buffers, at tiny sizes: it runs end to end and draws the figure.
    _require("gymnax", "optax", "matplotlib", "minari", "gymnasium")
    script = str(ROOT / "examples" / "offline_to_online.py")
    result = _run([script, "--smoke", "--seeds", "0", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "behaviour DQN: greedy return" in result.stdout
    # Exact counts under a traced fraction: round(32 f) offline rows for f = 0.5 (1 - u / 8),
    # u = 0..7, then 0: 16 + 14 + ... + 2 = 72 over the 16 updates; none with the fraction 0.
    (mixed,) = [line for line in result.stdout.splitlines() if line.startswith("seed 0 mixed:")]
    (online,) = [line for line in result.stdout.splitlines() if line.startswith("seed 0 online")]
    assert "; 72 offline rows" in mixed and "; 0 offline rows" in online
    assert "smoke run: no learning threshold" in result.stdout
    assert (tmp_path / "offline_to_online.png").read_bytes().startswith(b"\x89PNG")
