"""Every form CHANGELOG.md marks *deprecated* still works, warns, and gives what its new form
gives: each bullet of the changelog that deprecates something is listed in `FORMS` with the
tests that hold its forms to that, and a test here fails on a deprecating bullet no test
covers (or a listed test that is gone).

Most forms are tested beside the behaviour they are an old spelling of; the ones with no
better home are here.
"""

import re
from pathlib import Path

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import SLOW


ROOT = Path(__file__).parent.parent

# A phrase of each deprecating changelog bullet -> the tests (file::function) of its forms.
FORMS = {
    "**Window options are one object, `dx.Window`**": [
        "test_trajectory.py::test_sample_old_form_is_deprecated",
        "test_trajectory.py::test_sample_mixed_is_deprecated",
        "test_deprecations.py::test_dataset_sample_takes_the_old_window_form",
    ],
    "**`PrioritisedTrajectoryBuffer(prototype, num_envs, max_length, window, *,": [
        "test_prioritised_trajectory.py::test_deprecated_forms_still_work_with_a_warning",
        "test_deprecations.py::test_prioritised_trajectory_buffer_takes_the_old_keyword_form",
    ],
    "**`dx.NStep` describes n-step transitions**": [
        "test_trajectory.py::test_sample_transitions_is_deprecated",
    ],
    "**`stale` is the one word for": ["test_trajectory.py::test_overwritten_is_deprecated"],
    "**A stamp is `(env, start)`; a replay's slot versions are `generations`**": [
        "test_prioritised.py::test_deprecated_stamps_still_work_with_a_warning",
        "test_clustered.py::test_prioritised_inner_takes_the_deprecated_stamps_with_a_warning",
    ],
    "**`PrioritisedTrajectoryBuffer.slots_per_env` is `leaves_per_env`**": [
        "test_prioritised_trajectory.py::test_deprecated_forms_still_work_with_a_warning",
    ],
    "**One `sample` per family, with every option.**": [
        "test_trajectory.py::test_sample_mixed_is_deprecated",
        "test_trajectory.py::test_sample_transitions_is_deprecated",
    ],
    "**`ClusteredReplay.set_priorities((cluster_ids, slots), priorities)`**": [
        "test_clustered.py::test_prioritised_inner_takes_the_deprecated_three_argument_form_with_a_warning",
    ],
}


def _deprecating_bullets() -> list[str]:
    """The bullets of CHANGELOG.md that mark something *deprecated*."""
    text = (ROOT / "CHANGELOG.md").read_text()
    bullets = re.split(r"\n(?=- |#)", text)  # a bullet ends at the next one, or a heading
    return [b for b in bullets if b.startswith("- ") and "*deprecated*" in b]


def test_every_deprecating_bullet_has_tests_of_its_forms():
    bullets = _deprecating_bullets()
    assert bullets, "CHANGELOG.md deprecates nothing: is the marker still *deprecated*?"
    uncovered = [b.splitlines()[0] for b in bullets if not any(p in b for p in FORMS)]
    assert not uncovered, f"deprecating bullets with no tests in FORMS: {uncovered}"
    stale = [p for p in FORMS if not any(p in b for b in bullets)]
    assert not stale, f"FORMS names bullets CHANGELOG.md no longer has: {stale}"


@pytest.mark.parametrize("test", sorted({t for ts in FORMS.values() for t in ts}))
def test_every_listed_test_exists(test):
    path, name = test.split("::")
    assert re.search(rf"^def {name}\(", (ROOT / "tests" / path).read_text(), re.M), test


STEP = {"x": jnp.zeros((), jnp.float32), "done": jnp.zeros((), jnp.bool_)}


@SLOW
def test_prioritised_trajectory_buffer_takes_the_old_keyword_form():
    # The window's parts as keywords, the sequence length named too: the old constructor form,
    # given entirely by keyword, as the positional one.
    new = dx.PrioritisedTrajectoryBuffer(STEP, 2, 8, dx.Window(3, period=2, strict=True))
    with pytest.warns(DeprecationWarning, match="window options as keywords is deprecated"):
        old = dx.PrioritisedTrajectoryBuffer(  # pyright: ignore[reportCallIssue]
            STEP, num_envs=2, max_length=8, sequence_length=3, period=2
        )
    assert old.window == new.window
    steps = {"x": np.arange(20, dtype=np.float32).reshape(2, 10), "done": np.zeros((2, 10), bool)}
    key = jax.random.key(0)
    a, b = old.extend(steps).sample(key, 4), new.extend(steps).sample(key, 4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    with pytest.raises(TypeError, match="window"):  # neither a window nor its length
        dx.PrioritisedTrajectoryBuffer(STEP, num_envs=2, max_length=8, period=2)  # pyright: ignore[reportCallIssue]


def test_dataset_sample_takes_the_old_window_form(tmp_path):
    # `Dataset.sample(key, b, 3, burn_in=1, period=2, strict=True)`: the old form of
    # `sample(key, b, dx.Window(3, burn_in=1, period=2, strict=True))`, the same windows.
    buf = dx.TrajectoryBuffer(STEP, 2, 12)
    buf = buf.extend(
        {"x": np.arange(24, dtype=np.float32).reshape(2, 12), "done": np.zeros((2, 12), bool)}
    )
    ds = dx.Dataset.create(tmp_path / "d", STEP, 2)
    ds.write(buf)
    key = jax.random.key(3)
    new = ds.sample(key, 16, dx.Window(3, burn_in=1, period=2, strict=True))
    with pytest.warns(DeprecationWarning, match=r"pass `dx.Window\(3, ...\)`"):
        old = ds.sample(key, 16, 3, burn_in=1, period=2, strict=True)
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
