"""Minari in and out beside `Dataset` reads, in MB/s of step data (one run, printed).

A Minari dataset (HDF5, Minari's default) of `EPISODES` episodes of `STEPS` steps, each step an
observation `f32[OBS]`, an `int64` action, a `float64` reward and the two end flags, made with
`minari.create_dataset_from_buffers` (not timed). Then, each timed once:

- `minari read`: Minari's own `iterate_episodes` over every episode (the floor of any import);
- `from_minari`: `dx.from_minari` into a new `dx.Dataset` (`sync=True`, the default, and
    `sync=False`);
- `Dataset read`: every env's whole stream read back with `Dataset.read`;
- `to_minari`: the `Dataset` written out as a new Minari dataset.

MB/s counts the bytes of the steps as they are stored in the `Dataset` (`T + 1` steps an
episode, the `valid` flag included), so the rows compare. Run: `python -m benchmarks.minari_io`
(`--quick` for a smoke run).
"""

import argparse
import os
import shutil
import tempfile
import time
import warnings

import numpy as np


EPISODES, STEPS, OBS, NUM_ENVS = 200, 500, 64, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    episodes, steps = (8, 50) if args.quick else (EPISODES, STEPS)
    root = tempfile.mkdtemp(prefix="minari_io_")
    os.environ["MINARI_DATASETS_PATH"] = os.path.join(root, "minari")
    warnings.filterwarnings("ignore", ".*(is set to None|no environment spec).*", UserWarning)
    import dejax_eqx as dx
    import gymnasium as gym
    import minari

    try:
        rng = np.random.default_rng(0)
        buffers = [
            minari.data_collector.EpisodeBuffer(
                observations=rng.normal(size=(steps + 1, OBS)).astype(np.float32),
                actions=rng.integers(0, 4, steps),
                rewards=rng.normal(size=steps),
                terminations=np.arange(steps) == steps - 1,
                truncations=np.zeros(steps, bool),
            )
            for _ in range(episodes)
        ]
        space = gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
        source = minari.create_dataset_from_buffers(
            "bench/source-v0", buffers, observation_space=space, action_space=gym.spaces.Discrete(4)
        )
        del buffers
        step_bytes = OBS * 4 + 8 + 8 + 3
        total = episodes * (steps + 1) * step_bytes / 1e6
        rows = []

        def timed(name, fn):
            start = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - start
            rows.append((name, seconds, total / seconds))
            return out

        timed("minari read (iterate_episodes)", lambda: sum(1 for _ in source.iterate_episodes()))
        dataset = timed(
            "from_minari (sync=True)",
            lambda: dx.from_minari(
                source, os.path.join(root, "a"), num_envs=NUM_ENVS, progress=False
            ),
        )
        timed(
            "from_minari (sync=False)",
            lambda: dx.from_minari(
                source, os.path.join(root, "b"), num_envs=NUM_ENVS, progress=False, sync=False
            ),
        )
        timed(
            "Dataset read (every stream)",
            lambda: [dataset.read(e, 0, int(dataset.ends[e])) for e in range(NUM_ENVS)],
        )
        timed(
            "to_minari",
            lambda: dx.to_minari(
                dataset,
                "bench/copy-v0",
                observation_space=space,
                action_space=gym.spaces.Discrete(4),
                progress=False,
            ),
        )
        print(f"{episodes} episodes x {steps} steps, {step_bytes} bytes a step, {total:.1f} MB")
        floor = rows[0][2]
        for name, seconds, rate in rows:
            print(f"{name:34s} {seconds:8.3f} s {rate:9.1f} MB/s  {rate / floor:6.2f}x minari read")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
