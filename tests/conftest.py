import os

import jax
import pytest
from hypothesis import HealthCheck, settings
from jaxtyping import install_import_hook


# The hook must be in place before anything imports `dejax_eqx`, so that every annotated
# function and module of the package is checked by beartype during the tests.
_hook = install_import_hook("dejax_eqx", "beartype.beartype")

# The tests compile far more than they compute, and LLVM's optimisation of the generated CPU code
# is most of each compilation while buying nothing on test-sized arrays: it is off for the tests
# (and the subprocesses they start). XLA's own graph passes (fusion, layout) still run, so the
# tests check the programs users run; the benchmarks and the library keep XLA's defaults.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = _flags.strip()

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Compilation makes the first run of each example slow: no deadlines. Shapes are drawn from small
# fixed sets (tests/helpers.py) so compiled functions are reused across examples.
# The ci profile is derandomized so that a CI run is reproducible; dev explores new examples on
# every run.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# ci is sized for the README's test command (two processes, a 2-core machine, a few minutes):
# 8 examples and 6 state-machine steps per run; dev 150 and 40.
settings.register_profile("ci", max_examples=8, stateful_step_count=6, derandomize=True, **_common)
settings.register_profile("dev", max_examples=150, stateful_step_count=40, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Compiled executables are cached per process, and a module's shapes are rarely another's: once
# a module is done its executables only hold memory (gigabytes over the whole suite).
@pytest.fixture(autouse=True, scope="module")
def _clear_compilation_caches():
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(config, items):
    """Run the four-device checks first: they are one long subprocess (tests/test_sharding.py),
    which under `pytest -n 2` then overlaps the rest of the suite instead of ending it."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_sharding.py")
