"""W10: the actor loop's buffer call. One add per `recv()`, called from a Python loop with the
NumPy arrays envpool returns, as `examples/r2d2_envpool.py` and `examples/envpool_async.py`
call it; the result is microseconds per add.

`size` is the number of envs. With 16, each add brings 8 of them (envpool's async mode with
`batch_size=8`: a different subset every call, `env_ids` given); with 64, all 64 (lock-step,
`env_ids` given too, the setting of the issue that measured `eqx.filter_jit`'s dispatch). The
step is CartPole's, as the example stores it: `obs f32[2]`, `action i32[]`, `reward f32[]`,
`terminated`, `truncated`, `first` (bool), so the write itself is small and the call's
overhead shows.

Systems:

- `dejax_eqx eqx.filter_jit`: `TrajectoryBuffer.add` under `eqx.filter_jit(donate="all")`.
- `dejax_eqx jax.jit`: the same under plain `jax.jit(..., donate_argnums=0)` (the fast path: a
    buffer holds only arrays).
- `dejax_eqx lock-step jax.jit` (64 envs only): `TrajectoryBuffer.add` of every env in
    order, without `env_ids`, as flashbax's add takes them.
- `dejax_eqx prioritised, jax.jit`: `PrioritisedTrajectoryBuffer.add` (the example's buffer:
    windows of 27 steps every 8, so each add also updates the sum tree), plain `jax.jit`.
- `raw`: the floor, per-env rings of plain arrays with a head per env, one scatter per leaf at
    `(env_ids, head[env_ids])`, no checks, under `jax.jit` with donation.
- `flashbax` (64 envs only: its trajectory buffer adds every env at once): `add` of a
    `[64, 1]` batch, under `jax.jit` with donation.
"""

import functools

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


MAX_LENGTH = 2048
CALLS_POOL = 64  # distinct inputs cycled through, made before timing


def _prototype() -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "obs": jax.ShapeDtypeStruct((2,), jnp.float32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), jnp.float32),
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
        "truncated": jax.ShapeDtypeStruct((), jnp.bool_),
        "first": jax.ShapeDtypeStruct((), jnp.bool_),
    }


def _inputs(num_envs: int, per_add: int) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """NumPy steps and env ids, as `recv()` returns them."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(CALLS_POOL):
        steps = {
            "obs": rng.standard_normal((per_add, 2), dtype=np.float32),
            "action": rng.integers(0, 2, per_add, dtype=np.int32),
            "reward": np.ones(per_add, np.float32),
            "terminated": rng.random(per_add) < 0.01,
            "truncated": np.zeros(per_add, bool),
            "first": rng.random(per_add) < 0.01,
        }
        env_ids = rng.permutation(num_envs)[:per_add].astype(np.int32)
        out.append((steps, env_ids))
    return out


def _add_fn(system: str, num_envs: int):
    """`(state, add)` with `add(state, steps, env_ids) -> state`."""
    system, results = h.results_mode(system)
    if system in ("dejax_eqx eqx.filter_jit", "dejax_eqx jax.jit"):
        state = dx.TrajectoryBuffer(
            _prototype(), num_envs=num_envs, max_length=MAX_LENGTH, throw=not results
        )

        def add(buf, steps, env_ids):
            return buf.add(steps, env_ids=env_ids)

        if system == "dejax_eqx eqx.filter_jit":
            return state, eqx.filter_jit(add, donate="all")
        return state, jax.jit(add, donate_argnums=0)
    if system == "dejax_eqx lock-step jax.jit":
        state = dx.TrajectoryBuffer(
            _prototype(), num_envs=num_envs, max_length=MAX_LENGTH, throw=not results
        )
        return state, jax.jit(lambda buf, s, i: buf.add(s), donate_argnums=0)
    if system == "dejax_eqx prioritised, jax.jit":
        state = h.prioritised_trajectory_buffer(
            _prototype(), num_envs, MAX_LENGTH, 16, burn_in=8, bootstrap=3, period=8
        )
        return state, jax.jit(lambda buf, s, i: buf.add(s, env_ids=i), donate_argnums=0)
    if system == "raw":
        data = jax.tree.map(
            lambda s: jnp.zeros((num_envs, MAX_LENGTH, *s.shape), s.dtype), _prototype()
        )

        @functools.partial(jax.jit, donate_argnums=0)
        def raw_add(state, steps, env_ids):
            data, head = state
            rows = head[env_ids]
            data = jax.tree.map(lambda d, x: d.at[env_ids, rows].set(x), data, steps)
            return data, head.at[env_ids].set((rows + 1) % MAX_LENGTH)

        return (data, jnp.zeros(num_envs, jnp.int32)), raw_add
    if system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_trajectory_buffer(
            max_length_time_axis=MAX_LENGTH,
            min_length_time_axis=1,
            sample_batch_size=1,
            add_batch_size=num_envs,
            sample_sequence_length=1,
            period=1,
        )
        one = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _prototype())
        state = buffer.init(one)

        @functools.partial(jax.jit, donate_argnums=0)
        def fbx_add(state, steps, env_ids):
            del env_ids  # lock-step: every env, in order
            return buffer.add(state, jax.tree.map(lambda x: x[:, None], steps))

        return state, fbx_add
    raise ValueError(system)


def w10(system: str, num_envs: int, steps: int, repeats: int) -> dict:
    per_add = {16: 8, 64: 64}.get(num_envs, num_envs)
    lock_step = system in ("flashbax", "dejax_eqx lock-step jax.jit")
    if lock_step and per_add != num_envs:
        raise ValueError(f"{system} adds every env at once (lock-step only)")
    state, add = _add_fn(system, num_envs)
    inputs = _inputs(num_envs, per_add)
    if lock_step:  # every env, in env order
        inputs = [(steps_, np.arange(num_envs, dtype=np.int32)) for steps_, _ in inputs]

    def loop(state, key):
        del key
        for i in range(steps):
            new, env_ids = inputs[i % CALLS_POOL]
            state = add(state, new, env_ids)
        return jax.block_until_ready(state)

    seconds = h.time_steps(loop, state, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/add"}
