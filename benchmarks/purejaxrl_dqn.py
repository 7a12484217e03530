"""PureJaxRL's `purejaxrl/dqn.py`, unedited, on flashbax and on the drop-in (issue 38).

Runs the file's `make_train` as its `main` does, `jax.jit(jax.vmap(make_train(config)))` over
seeds, with `main`'s config (CartPole-v1, 500k steps), the number of seeds from `--seeds` (the
file's `main` has 1; the issue measured 3). `--fbx dejax` swaps `flashbax` for
`dejax_eqx.compat.flashbax` the way docs/migration-flashbax.md says (`import
dejax_eqx.compat.flashbax as fbx`), here by putting the drop-in under the name `flashbax` in
`sys.modules` before the file is imported, so that the file itself stays unedited. `wandb`,
which the file imports but only uses with `WANDB_MODE` online, is a stub.

    python -m benchmarks.purejaxrl_dqn PATH/TO/purejaxrl/dqn.py --fbx flashbax
    python -m benchmarks.purejaxrl_dqn PATH/TO/purejaxrl/dqn.py --fbx dejax

Needs `gymnax`, `optax`, `flax`, `chex` (and flashbax 0.1.3 for `--fbx flashbax`). Prints the
compile time (`lower` + `compile`), the run time of the compiled program, and each seed's mean
episode return over the last 1% of the updates (`returned_episode_returns`, as logged).
"""

import argparse
import importlib.util
import sys
import time
import types


def _load(path: str, fbx: str):
    if fbx == "dejax":
        import dejax_eqx.compat.flashbax

        sys.modules["flashbax"] = dejax_eqx.compat.flashbax
    if "wandb" not in sys.modules:
        wandb = types.ModuleType("wandb")
        wandb.init = lambda *args, **kwargs: None  # type: ignore[attr-defined]
        wandb.log = lambda *args, **kwargs: None  # type: ignore[attr-defined]
        sys.modules["wandb"] = wandb
    spec = importlib.util.spec_from_file_location("purejaxrl_dqn_file", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# `main`'s config in purejaxrl/dqn.py (luchris429/purejaxrl at 31756b1).
CONFIG = {
    "NUM_ENVS": 10,
    "BUFFER_SIZE": 10000,
    "BUFFER_BATCH_SIZE": 128,
    "TOTAL_TIMESTEPS": 5e5,
    "EPSILON_START": 1.0,
    "EPSILON_FINISH": 0.05,
    "EPSILON_ANNEAL_TIME": 25e4,
    "TARGET_UPDATE_INTERVAL": 500,
    "LR": 2.5e-4,
    "LEARNING_STARTS": 10000,
    "TRAINING_INTERVAL": 10,
    "LR_LINEAR_DECAY": False,
    "GAMMA": 0.99,
    "TAU": 1.0,
    "ENV_NAME": "CartPole-v1",
    "SEED": 0,
    "NUM_SEEDS": 1,
    "WANDB_MODE": "disabled",
    "ENTITY": "",
    "PROJECT": "",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="purejaxrl/dqn.py")
    parser.add_argument("--fbx", choices=("flashbax", "dejax"), required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--timesteps", type=float, default=CONFIG["TOTAL_TIMESTEPS"])
    args = parser.parse_args(argv)
    dqn = _load(args.path, args.fbx)
    import jax
    import numpy as np

    config = dict(CONFIG, NUM_SEEDS=args.seeds, TOTAL_TIMESTEPS=args.timesteps)
    rng = jax.random.PRNGKey(config["SEED"])
    rngs = jax.random.split(rng, config["NUM_SEEDS"])
    train_vjit = jax.jit(jax.vmap(dqn.make_train(config)))
    start = time.perf_counter()
    compiled = train_vjit.lower(rngs).compile()
    compiled_at = time.perf_counter()
    outs = jax.block_until_ready(compiled(rngs))
    ran_at = time.perf_counter()
    returns = np.asarray(outs["metrics"]["returns"])  # (seeds, updates)
    tail = max(1, returns.shape[1] // 100)
    final = returns[:, -tail:].mean(axis=1)
    print(
        f"fbx={args.fbx} jax={jax.__version__} seeds={args.seeds} "
        f"timesteps={int(args.timesteps)}: compile {compiled_at - start:.1f} s, "
        f"run {ran_at - compiled_at:.1f} s, final returns " + ", ".join(f"{r:.1f}" for r in final),
        flush=True,
    )


if __name__ == "__main__":
    main()
