import atexit
import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
from typing import Any

import jax
import pytest
from hypothesis import HealthCheck, settings
from jaxtyping import install_import_hook


# The hook must be in place before anything imports `dejax_eqx`, so that every annotated
# function and module of the package is checked by beartype during the tests.
_hook = install_import_hook("dejax_eqx", "beartype.beartype")

# The tests compile far more than they compute, so two code-generation settings favour compile
# time, for the tests (and the subprocesses they start) only:
# - LLVM's optimisation of the generated CPU code is off: it is most of a compilation and buys
#   nothing on test-sized arrays;
# - fusions are emitted by XLA's older LLVM emitters, not its MLIR fusion emitters: measured on
#   tests/test_transforms.py and tests/test_trajectory.py, 84 s instead of 147 s.
# XLA's graph passes (fusion, layout, buffer assignment, so in-place updates) still run as
# usual, so the tests check the programs users run. Outside the tests XLA's defaults stay: the
# README's demo, and in CI (`.ci/run`) flashbax's own tests and the benchmarks' quick run.
_TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0"}
# XLA in jax 0.11 no longer knows the emitter flag, and an unknown flag aborts the process with
# nothing printed: set it only where it exists (measured on jax 0.5.3 to 0.10.2).
if jax.__version_info__ < (0, 11):
    _TEST_XLA_FLAGS["xla_cpu_use_fusion_emitters"] = "false"
_flags = os.environ.get("XLA_FLAGS", "")
for _name, _value in _TEST_XLA_FLAGS.items():
    if _name not in _flags:
        _flags += f" --{_name}={_value}"
os.environ["XLA_FLAGS"] = _flags.strip()

# Four CPU devices in every test process, as equinox's tests give theirs two: the global buffers
# and the sharding checks run on a mesh of them in process (tests/test_layers.py,
# tests/test_sharding.py). Everything else runs on the first, as on a machine of one.
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# One compilation cache on disk for every process of a test run (the xdist workers and the
# subprocesses they start inherit the directory through the environment): a program is
# compiled once per run, not again in the other worker, nor after the memory releases below
# drop the in-memory caches.
if "DEJAX_EQX_TEST_COMPILATION_CACHE" not in os.environ:
    os.environ["DEJAX_EQX_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="dejax_eqx_jit_")
    atexit.register(shutil.rmtree, os.environ["DEJAX_EQX_TEST_COMPILATION_CACHE"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["DEJAX_EQX_TEST_COMPILATION_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Compilation makes the first run of each example slow: no deadlines. Shapes are drawn from small
# fixed sets (tests/helpers.py) so compiled functions are reused across examples.
# The ci profile is derandomized so that a CI run is reproducible; dev explores new examples on
# every run.
_common: dict[str, Any] = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# ci is sized for the README's test command (two processes, a 2-core machine, a few minutes):
# 8 examples and 6 state-machine steps per run; dev 150 and 40.
settings.register_profile("ci", max_examples=8, stateful_step_count=6, derandomize=True, **_common)
settings.register_profile("dev", max_examples=150, stateful_step_count=40, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Memory. Compiled executables are cached per process, and they and the compilations' scratch
# hold most of a test process's memory: without care a worker grows past 2 GiB, and the
# README's test command must stay under 3 GB for both workers together. Two releases:
# - after each module, whose shapes are rarely another's: drop the compilation caches;
# - after any test that leaves the process above `_RSS_BUDGET`: the same, mid-module. Programs
#   that later tests share are then compiled again, so this must stay rare: clearing after
#   every test kept a worker under 0.8 GiB, but two heavy modules took 1.7-1.9 times as long.
# Each release then hands the freed heap back to the system (glibc's `malloc_trim`): glibc keeps
# freed pages otherwise. Measured after tests/test_transforms.py: 1,381 MiB resident with the
# caches dropped, 430 MiB after the trim.
_RSS_BUDGET = 1 << 30
_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None  # glibc only


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except OSError:  # no procfs: never over budget
        return 0


def _release_memory() -> None:
    jax.clear_caches()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(autouse=True, scope="module")
def _release_after_module():
    yield
    _release_memory()


@pytest.fixture(autouse=True)
def _release_when_over_budget():
    yield
    if _resident_bytes() > _RSS_BUDGET:
        _release_memory()


# The test that is one long run of subprocesses: the processes of a `jax.distributed` program.
_FIRST = ("tests/test_multi_process.py",)


def pytest_collection_modifyitems(config, items):
    """Run the long subprocess test first (`_FIRST`): under `pytest -n 2` it then overlaps the
    rest of the suite instead of ending it."""
    rank = {path: i for i, path in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(_FIRST)))
