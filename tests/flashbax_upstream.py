"""flashbax 0.1.3's own tests, unchanged, against `dejax_eqx.compat.flashbax`.

The flashbax wheel ships its tests (`flashbax/conftest.py`, `flashbax/buffers/conftest.py`,
`flashbax/buffers/*_test.py`). This module copies them, byte for byte, into a directory beside a
shim package named `flashbax` whose two `__init__.py` files, written here, bind `flashbax`,
`flashbax.buffers`, `flashbax.buffers.<module>` and `flashbax.utils` to the compatibility layer.
Then it runs pytest on that directory in a subprocess: the wheel's root conftest calls
`chex.set_n_cpu_devices(2)`, which only works before JAX starts, and neither our
`tests/conftest.py` nor the settings in `pyproject.toml` must apply to flashbax's tests.

Two selections: `all`, every test in scope (about an hour, by hand), and `ci`, the same but with
two large parametrised sweeps cut to a fixed subset (see `ci_subset`), which `.ci/run` runs as
a step of its own (several minutes: too long for the README's test command).
`tests/test_flashbax_upstream.py` checks the pinned files and the selections.

    python -m tests.flashbax_upstream [--all] [-n N] [--keep DIR] [--target MODULE | --reference]

`--reference` runs the shim over a copy of the installed flashbax itself, renamed, to check this
harness and to time flashbax's own implementation.
"""

import argparse
import ast
import functools
import hashlib
import importlib.util
import itertools
import math
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


TARGET = "dejax_eqx.compat.flashbax"
# The name under which `--reference` installs its copy of flashbax into the shim's directory.
REFERENCE = "_flashbax_reference"

# The files as flashbax 0.1.3's wheel has them (SHA-256), relative to site-packages.
# TESTS are copied into the shim's directory; SOURCES only by `--reference`.
TESTS = {
    "flashbax/conftest.py": "72a3bea663d6b327f6bea70ac653cdbef58f675f1a28c673c853e5a3f5628685",
    "flashbax/buffers/conftest.py": (
        "35a1d70015fbf603be2d05b861cf68579b16e8d6ee2330db3dc08526710aed0d"
    ),
    "flashbax/buffers/flat_buffer_test.py": (
        "a8c674b365e124c747f201b8ec28a5c6a128914e4f30daa4526cd73b0ff73f8c"
    ),
    "flashbax/buffers/item_buffer_test.py": (
        "003539a2ac9facd5134568eeae3865a20585484f329779eeb47aa50502032091"
    ),
    "flashbax/buffers/trajectory_buffer_test.py": (
        "2d9efb85fd89a9a08d8b0a9f17e9b7382a9c151cf8976c76882766f9e100817f"
    ),
    "flashbax/buffers/prioritised_flat_buffer_test.py": (
        "761d75a37453e3da1bb38313a99b4d09b524815f3ac52cbf30bc7bb0aea45b3c"
    ),
    "flashbax/buffers/prioritised_item_buffer_test.py": (
        "8fda6ce7be8e3e6c3f58ac441bbe26d28368c50f6194a25c23416e4ac21af1d9"
    ),
    "flashbax/buffers/prioritised_trajectory_buffer_test.py": (
        "56c2bf7b4d57349de6e150550d8a9ff246b2291b4dc5cb86612b8972aa242f05"
    ),
    "flashbax/buffers/trajectory_queue_test.py": (
        "76a1c1e1e53cfb84b2b346b48b05457182d271c7d092c22df21e6e80632c0fd3"
    ),
    "flashbax/buffers/mixer_test.py": (
        "bba7eeeb35df7c0d2157fc825de55c728913d3a6dbad19ad54705e39fe33b6ac"
    ),
}
SOURCES = {
    "flashbax/__init__.py": "7f3e96a0ac126230ecde87b469f4e65c405d876de2d26c437f055c569b6826dd",
    "flashbax/utils.py": "203d67494cfe78d672088b60e3e8fddf48137c7d14aaed4c3632c40dfdc58d2a",
    "flashbax/buffers/__init__.py": (
        "e1325a331348271ee55ce44057af4bbbb102b57564d8761d86f619c73c87ed02"
    ),
    "flashbax/buffers/flat_buffer.py": (
        "99e83e4c14fcfcfe43fe58362806d74b2d947b9be071535c085bb2c5cdce1d2f"
    ),
    "flashbax/buffers/item_buffer.py": (
        "ecb6e562549ea61ba429282bf8ff54606a03a8ca8cbba03985b15d7491579d20"
    ),
    "flashbax/buffers/trajectory_buffer.py": (
        "65caf7d1fd319b93a9f69baa5d78a5286d686da8235cee3d210a894ac56ce543"
    ),
    "flashbax/buffers/prioritised_trajectory_buffer.py": (
        "507ded395fa05b6c3dfa62fb4e4f04304d7eead8ab3703e4371e1a81daca2b32"
    ),
    "flashbax/buffers/prioritised_flat_buffer.py": (
        "3baafff3deeab81aa8ff2186c60592b6e0c357304bc1e4e2387499e55b274973"
    ),
    "flashbax/buffers/prioritised_item_buffer.py": (
        "c04ea313ac99c98990b23b8c4bc674c6c217583319079dcda2057beb367e4507"
    ),
    "flashbax/buffers/trajectory_queue.py": (
        "3a18c62841c68df2eacb0ffdce5aefec654898e53a81a7dcb5c705b60570b10e"
    ),
    "flashbax/buffers/mixer.py": (
        "2020107acb4a28a5a0c9b2a8725328f091898cfb4063c64d01a6890ca9416680"
    ),
    "flashbax/buffers/sum_tree.py": (
        "a82a08f8f1e4e0b2f7fc6878b4a768ab09c78b6aee7ccb0c34dccf963ce844db"
    ),
}
TEST_FILES = [path for path in TESTS if path.endswith("_test.py")]

# flashbax's buffer modules, bound by the shim under `flashbax.buffers.<name>`.
MODULES = (
    "flat_buffer",
    "item_buffer",
    "trajectory_buffer",
    "prioritised_trajectory_buffer",
    "prioritised_flat_buffer",
    "prioritised_item_buffer",
    "trajectory_queue",
    "mixer",
    "sum_tree",
)

# The wheel's tests that the compatibility layer does not take on, by node id, and why. The
# first three files are not copied; the three tests are left out of the selection.
OUT_OF_SCOPE = {
    # The sum tree's internals (`sum_tree.init`/`set_batch`/`sample`...): the layer keeps only
    # the few functions the buffer tests use as helpers (`sum_tree.get`).
    "flashbax/buffers/sum_tree_test.py": "the sum tree's internals",
    # `add_dim_to_args` and other private helpers of flashbax's own implementation.
    "flashbax/utils_test.py": "flashbax's private helpers",
    # Vault (on-disk storage through tensorstore) is not part of the layer.
    "flashbax/vault/vault_test.py": "Vault",
    # These three call the private helper `_calculate_new_item_indices` directly.
    "flashbax/buffers/prioritised_trajectory_buffer_test.py::test_human_case_1": "private helper",
    "flashbax/buffers/prioritised_trajectory_buffer_test.py::test_human_case_2": "private helper",
    "flashbax/buffers/prioritised_trajectory_buffer_test.py::test_human_case_3": "private helper",
}


# The wheel's tests that fail against the layer on purpose, where flashbax silently goes on with
# garbage and the layer raises instead (docs/migration-flashbax.md lists these differences): the
# reason, and a text the failure's message must hold. The harness checks that each fails, and
# with that message: one that passes, or fails otherwise, is a failure of the run.
DOCUMENTED_FAILURES = {
    "flashbax/buffers/prioritised_flat_buffer_test.py::test_adjust_priorities": (
        "it samples a prioritised flat buffer holding one step per row, so no pair of steps "
        "yet: flashbax draws from its all-zero sum tree and returns a padding leaf (an index "
        "past the capacity) with probability 0/0 = NaN, whose priority the test then sets",
        "`PrioritisedTrajectoryBuffer.sample`: no window is admissible yet",
    ),
}


def _prioritised_sweep_checks(case: dict[str, int]) -> bool:
    # The test's own rule: unless the capacity rounded down to a multiple of the period exceeds
    # both lengths, it returns at once, having checked nothing.
    capacity = case["max_length_time_axis"] - case["max_length_time_axis"] % case["period"]
    return capacity > case["add_length"] and capacity > case["sample_sequence_length"]


# The two parametrised sweeps that make up most of the hour of `all` (240 and 480 cases, a few
# seconds each: 12 adds, each followed by 2048 eager checks of a sample). `ci` runs a subset of
# each, drawn from the cases that the predicate says check something.
SWEEPS: dict[str, Callable[[dict[str, int]], bool]] = {
    "flashbax/buffers/trajectory_buffer_test.py::"
    "test_sample_doesnt_sample_prev_broken_trajectories": lambda case: True,
    "flashbax/buffers/prioritised_trajectory_buffer_test.py::"
    "test_prioritised_sample_doesnt_sample_prev_broken_trajectories": _prioritised_sweep_checks,
}
# Cases of each sweep in `ci` (so twice this in all); at least 5 to cover every value.
CI_CASES_PER_SWEEP = 12


def site_packages() -> Path:
    """The directory holding the installed `flashbax` package, found without importing it."""
    spec = importlib.util.find_spec("flashbax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("flashbax is not installed: `pip install flashbax==0.1.3`.")
    return Path(next(iter(spec.submodule_search_locations))).parent


def check_files() -> None:
    """Refuse to go on unless every pinned file is there and as flashbax 0.1.3 has it."""
    root = site_packages()
    wrong = []
    for path, digest in {**TESTS, **SOURCES}.items():
        file = root / path
        if not file.is_file():
            wrong.append(f"{path}: missing")
        elif hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            wrong.append(f"{path}: not as in flashbax 0.1.3's wheel")
    if wrong:
        raise RuntimeError(f"The installed flashbax ({root}) is not 0.1.3's: {'; '.join(wrong)}.")


@functools.cache
def parametrisations(path: str) -> dict[str, list[tuple[str, list]]]:
    """Each test function of a copied file, with its `pytest.mark.parametrize` decorators
    (argument name and values) from the bottom one up, the order of the parts of pytest's ids."""
    tree = ast.parse((site_packages() / path).read_text())
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            params = []
            for decorator in reversed(node.decorator_list):
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith(
                    "mark.parametrize"
                ):
                    name = ast.literal_eval(decorator.args[0])
                    values = ast.literal_eval(decorator.args[1])
                    # pytest's id of an int is its str; other ids are not reproduced here.
                    assert "," not in name and all(type(v) is int for v in values), node.name
                    params.append((name, values))
            functions[node.name] = params
    return functions


def cases(node: str) -> dict[str, dict[str, int]]:
    """The node id of every case of a parametrised test function, with its arguments."""
    path, name = node.split("::")
    params = parametrisations(path)[name]
    names = [name for name, _ in params]
    return {
        f"{node}[{'-'.join(map(str, values))}]": dict(zip(names, values))
        for values in itertools.product(*(values for _, values in params))
    }


def ci_subset(node: str, size: int = CI_CASES_PER_SWEEP) -> list[str]:
    """A fixed subset of a sweep's cases, in rounds: each round takes, one at a time, the case
    that brings the most argument values not yet taken in that round, until it has every value of
    every argument, then the next round starts afresh. Ties go to the first case in the order of
    the SHA-256 of the node ids, an arbitrary order that no JAX, pytest or Python version changes.
    From 5 cases on (the most values an argument has) every value is in."""
    candidates = {case: args for case, args in cases(node).items() if SWEEPS[node](args)}
    order = sorted(candidates, key=lambda case: hashlib.sha256(case.encode()).hexdigest())
    chosen: list[str] = []
    covered: set[tuple[str, int]] = set()
    while len(chosen) < min(size, len(order)):
        remaining = [case for case in order if case not in chosen]
        best = max(remaining, key=lambda case: len(candidates[case].items() - covered))
        if not candidates[best].items() - covered:
            covered = set()  # the round is complete
            continue
        chosen.append(best)
        covered |= candidates[best].items()
    return sorted(chosen)


def select(mode: str) -> list[str]:
    """The node ids pytest is given: whole test functions, and sweep cases in `ci`."""
    if mode not in ("all", "ci"):
        raise ValueError(f"`select(mode=...)` must be 'all' or 'ci', got {mode!r}.")
    selected = []
    for path in TEST_FILES:
        for name in parametrisations(path):
            node = f"{path}::{name}"
            if node in OUT_OF_SCOPE:
                continue
            selected += ci_subset(node) if mode == "ci" and node in SWEEPS else [node]
    return selected


def count(selected: list[str]) -> int:
    """How many test cases pytest runs for these node ids."""
    total = 0
    for node in selected:
        path, name = node.split("::")
        if "[" in name:
            total += 1
        else:
            total += math.prod(len(values) for _, values in parametrisations(path)[name])
    return total


_SHIM = '''\
"""`flashbax`, bound to `{target}` for flashbax 0.1.3's own tests.

Written by tests/flashbax_upstream.py; the conftests and tests beside it are the wheel's.
"""

import importlib
import sys

import jax


TARGET = "{target}"

# The wheel's mixer_test.py calls `jax.tree_map`, which JAX has since removed: the tests' own
# rot, not the layer's. Nothing else is patched.
jax.tree_map = jax.tree.map

_target = importlib.import_module(TARGET)
globals().update(
    {{k: v for k, v in vars(_target).items() if not k.startswith("_") and k != "buffers"}}
)
utils = sys.modules[__name__ + ".utils"] = importlib.import_module(TARGET + ".utils")
# The shim's own `buffers`, which holds the wheel's tests.
buffers = importlib.import_module(__name__ + ".buffers")
'''

_SHIM_BUFFERS = '''\
"""`flashbax.buffers` and its modules, bound to `{target}.buffers` (see ../__init__.py)."""

import importlib
import sys

from flashbax import TARGET


_buffers = importlib.import_module(TARGET + ".buffers")
globals().update({{k: v for k, v in vars(_buffers).items() if not k.startswith("_")}})
MODULES = ({modules}
)
for _name in MODULES:
    _module = importlib.import_module(f"{{TARGET}}.buffers.{{_name}}")
    globals()[_name] = sys.modules[f"{{__name__}}.{{_name}}"] = _module
'''


def build(directory: Path, target: str = TARGET, reference: bool = False) -> None:
    """Write the shim and copy the wheel's tests into `directory` (new or empty). With
    `reference`, also copy flashbax itself there as `_flashbax_reference` and bind the shim to it:
    the copy's own imports are renamed, nothing else."""
    check_files()
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty.")
    root = site_packages()
    if reference:
        target = REFERENCE
        for path in SOURCES:
            text = (root / path).read_text()
            text = re.sub(r"^from flashbax\b", f"from {REFERENCE}", text, flags=re.M)
            assert not re.search(r"^\s*(from|import) flashbax\b", text, re.M), path
            copy = directory / REFERENCE / Path(path).relative_to("flashbax")
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(text)
    for path in TESTS:
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_bytes((root / path).read_bytes())
    (directory / "flashbax/__init__.py").write_text(_SHIM.format(target=target))
    (directory / "flashbax/buffers/__init__.py").write_text(
        _SHIM_BUFFERS.format(target=target, modules="".join(f'\n    "{name}",' for name in MODULES))
    )
    # An ini file of its own makes the directory pytest's rootdir and keeps every setting of
    # ours (pyproject.toml's filterwarnings=error, testpaths, addopts) away from these tests.
    (directory / "pytest.ini").write_text("[pytest]\n")


@dataclass
class Outcome:
    mode: str
    expected: int  # the cases selected
    passed: int
    reported: int  # the cases pytest reported on
    failures: list[str] = field(default_factory=list)  # node id: first line of the message
    documented: list[str] = field(default_factory=list)  # DOCUMENTED_FAILURES that failed so
    times: dict[str, float] = field(default_factory=dict, repr=False)  # node id: seconds
    returncode: int = 0
    seconds: float = 0.0
    output: str = field(default="", repr=False)  # pytest's output, when captured

    @property
    def ok(self) -> bool:
        # pytest exits with 1 when a test fails, the documented failures included.
        return (
            not self.failures
            and self.returncode in (0, 1)
            and self.passed + len(self.documented) == self.reported == self.expected
        )

    def report(self) -> str:
        lines = [
            f"{self.passed} / {self.expected} in scope ({self.mode}) passed, "
            f"{len(self.documented)} failed as documented; pytest reported on "
            f"{self.reported} and exited with {self.returncode}; {self.seconds:.0f} s."
        ]
        lines += [f"FAILED AS DOCUMENTED {node}" for node in self.documented]
        lines += [f"FAILED {failure}" for failure in self.failures]
        if not self.ok and self.output:
            lines.append(self.output[-6000:])
        return "\n".join(lines)


def run(
    directory: Path, mode: str = "ci", capture: bool = True, workers: int = 0, **shim
) -> Outcome:
    """Build the shim in `directory` (see `build`, which takes `shim`), run the selection in a
    fresh interpreter (with `workers` pytest-xdist processes if positive) and read back what
    pytest reports in its JUnit XML."""
    build(directory, **shim)
    selected = select(mode)
    junit = directory / "junit.xml"
    command = [
        *(sys.executable, "-m", "pytest", *selected),
        *("-c", "pytest.ini", "--rootdir", ".", "-p", "no:cacheprovider", "-q"),
        *(("-n", str(workers)) if workers > 0 else ()),
        f"--junitxml={junit}",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=directory, capture_output=capture, text=True)
    outcome = Outcome(mode, count(selected), 0, 0, returncode=result.returncode)
    outcome.seconds = time.perf_counter() - start
    if capture:
        outcome.output = f"{result.stdout}\n{result.stderr}"
    if not junit.is_file():
        return outcome
    problems: dict[str, list[str]] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        # pytest writes the node id's path, dotted and without `.py`, as the classname.
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome.times[node] = outcome.times.get(node, 0.0) + float(case.get("time", 0.0))
        documented = DOCUMENTED_FAILURES.get(node)
        found = [p for p in case if p.tag in ("failure", "error", "skipped")]
        if documented and [p.tag for p in found] == ["failure"]:
            if documented[1] in f"{found[0].get('message')}\n{found[0].text}":
                outcome.documented.append(node)
                continue
        elif documented and not found:
            problems[node] = ["passed, but flashbax's behaviour here is documented to differ"]
        for problem in found:
            message = (problem.get("message") or problem.tag).strip().splitlines() or [""]
            problems.setdefault(node, []).append(f"{problem.tag}: {message[0]}")
    outcome.reported = len(outcome.times)
    outcome.passed = outcome.reported - len(problems) - len(outcome.documented)
    outcome.failures = [f"{node}: {'; '.join(found)}" for node, found in problems.items()]
    return outcome


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(
        prog="python -m tests.flashbax_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--all", action="store_true", help="every case of the sweeps (an hour)")
    parser.add_argument("--keep", type=Path, help="build in this new or empty directory, kept")
    parser.add_argument(
        "-n", "--workers", type=int, default=0, help="pytest-xdist processes (default: none)"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--target", default=TARGET, help=f"the package tested (default {TARGET})")
    group.add_argument(
        "--reference", action="store_true", help="test a renamed copy of the installed flashbax"
    )
    args = parser.parse_args(argv)
    mode = "all" if args.all else "ci"
    with tempfile.TemporaryDirectory(prefix="flashbax_upstream_") as scratch:
        directory = args.keep or Path(scratch)
        outcome = run(
            directory,
            mode,
            capture=False,
            workers=args.workers,
            target=args.target,
            reference=args.reference,
        )
    print(outcome.report())
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
