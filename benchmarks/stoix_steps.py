"""W13: Stoix-shaped learner steps, called from Python one `jax.jit` call at a time.

Stoix's off-policy systems run one jitted learner step per iteration of a Python loop: the
rollout is added, then the learner samples `epochs` batches (updating their priorities, for
the prioritised systems). This workload times that step's buffer work alone, through
flashbax's API, on flashbax 0.1.3 and on `dejax_eqx.compat.flashbax` (the import is all that
differs, as in W9), the buffer full, the step donating its state:

- `item`: `ff_dqn`'s item buffer: `make_item_buffer(add_batches=True)`, 100k items; each step
    adds `NUM_ENVS * ROLLOUT` transitions and samples `EPOCHS` batches of `BATCH`.
- `rainbow`: `ff_rainbow`'s prioritised item buffer, the same sizes, each sample followed by
    `set_priorities` of its indices.
- `r2d2`: `rec_r2d2`'s prioritised trajectory buffer: `NUM_ENVS` rows of 1,000 steps, windows
    of `SEQUENCE` steps on `PERIOD`; each step adds `[NUM_ENVS, ROLLOUT]` steps and samples
    `EPOCHS` batches of `BATCH` windows, setting their priorities.

A part's name ending in ` scanned` (`r2d2 scanned`) runs the epochs in a `lax.scan`, as
Stoix's systems do (`_update_epoch` in `ff_dqn.py`, `ff_rainbow.py`, `rec_r2d2.py`); without
it they are unrolled, one sample (and update) after the other in the step's program, as this
workload first measured them.

The value is milliseconds per step: the minimum over `repeats` rounds of `STEPS` calls each
(the issue's protocol: a round's calls run back to back, as a training loop's do, so JAX's
asynchronous dispatch overlaps a call's dispatch with the previous call's run where it can).
A system name ending in `, EQX_ON_ERROR=nan` runs with the run-time checks as NaNs; one
ending in `, throw=False` builds the drop-in's buffer with `throw=False` (faults kept as
results: no conditional and no callback compiled).
"""

import importlib
import time

import jax
import jax.numpy as jnp

from . import _harness as h


NUM_ENVS = 8
ROLLOUT = 16
EPOCHS = 16
BATCH = 32
SEQUENCE = 20
PERIOD = 10
STEPS = 300
ITEM_SIZE = 100_000
ROW_LENGTH = 1000

MODULES = {"flashbax": "flashbax", "dejax_eqx.compat.flashbax": "dejax_eqx.compat.flashbax"}


def _transitions(t, n: int) -> dict[str, jax.Array]:
    """`n` transitions from step `t` (traced): values that change with `t`, cheap to make."""
    t = jnp.asarray(t, jnp.float32) + jnp.arange(n, dtype=jnp.float32)
    return {
        "obs": t[:, None] * jnp.ones((n, h.OBS_DIM), jnp.float32),
        "action": t.astype(jnp.int32) % 7,
        "reward": jnp.sin(t),
        "done": t.astype(jnp.int32) % 100 == 0,
    }


def _epochs(epoch, state, key, scan: bool):
    """`EPOCHS` calls `state, total = epoch(state, k)`, one key each: a `lax.scan`, as Stoix's
    `_update_epoch` runs, or unrolled (a Python loop) with `scan=False`. Returns `(state, the
    sum of the totals)`."""
    keys = jax.random.split(key, EPOCHS)
    if scan:
        state, totals = jax.lax.scan(epoch, state, keys)
        return state, jnp.sum(totals)
    total = jnp.zeros(())
    for k in keys:
        state, value = epoch(state, k)
        total = total + value
    return state, total


def _item_like(fbx, prioritised: bool, options: dict, scan: bool):
    make = fbx.make_prioritised_item_buffer if prioritised else fbx.make_item_buffer
    options = {**options, **({"priority_exponent": 0.6} if prioritised else {})}
    buffer = make(
        max_length=ITEM_SIZE,
        min_length=BATCH,
        sample_batch_size=BATCH,
        add_batches=True,
        **options,
    )
    state = buffer.init(jax.tree.map(lambda x: x[0], _transitions(0, 1)))
    fill = jax.jit(lambda s, t: buffer.add(s, _transitions(t, 1000)), donate_argnums=0)
    for i in range(ITEM_SIZE // 1000):
        state = fill(state, i * 1000)

    def epoch(state, k):
        sample = buffer.sample(state, k)
        if prioritised:
            new = jnp.abs(jnp.sin(sample.experience["reward"])) + 1e-3
            state = buffer.set_priorities(state, sample.indices, new)
        return state, h.consume(sample.experience)

    def step(state, key, t):
        state = buffer.add(state, _transitions(t, NUM_ENVS * ROLLOUT))
        return _epochs(epoch, state, key, scan)

    return state, step


def _r2d2(fbx, options: dict, scan: bool):
    buffer = fbx.make_prioritised_trajectory_buffer(
        add_batch_size=NUM_ENVS,
        sample_batch_size=BATCH,
        sample_sequence_length=SEQUENCE,
        period=PERIOD,
        min_length_time_axis=SEQUENCE,
        max_length_time_axis=ROW_LENGTH,
        priority_exponent=0.6,
        **options,
    )
    state = buffer.init(jax.tree.map(lambda x: x[0], _transitions(0, 1)))

    def rollout(t):
        steps = _transitions(t, NUM_ENVS * ROLLOUT)
        return jax.tree.map(lambda x: x.reshape(NUM_ENVS, ROLLOUT, *x.shape[1:]), steps)

    fill = jax.jit(lambda s, t: buffer.add(s, rollout(t)), donate_argnums=0)
    for i in range(ROW_LENGTH // ROLLOUT):
        state = fill(state, i * ROLLOUT)

    def epoch(state, k):
        sample = buffer.sample(state, k)
        new = jnp.abs(jnp.sin(jnp.mean(sample.experience["reward"], axis=1))) + 1e-3
        return buffer.set_priorities(state, sample.indices, new), h.consume(sample.experience)

    def step(state, key, t):
        state = buffer.add(state, rollout(t))
        return _epochs(epoch, state, key, scan)

    return state, step


PARTS = {
    "item": lambda fbx, options, scan: _item_like(fbx, False, options, scan),
    "rainbow": lambda fbx, options, scan: _item_like(fbx, True, options, scan),
    "r2d2": _r2d2,
}


def w13(system: str, size: int, steps: int, repeats: int) -> dict:
    """`system` is `"<module>, <part>"`; `size` is unused (the sizes are Stoix's), `steps` the
    calls per round."""
    system, results = h.results_mode(system)
    name, _, part = system.partition(", ")
    part, scanned = part.removesuffix(" scanned"), part.endswith(" scanned")
    if name not in MODULES or part not in PARTS or (results and name == "flashbax"):
        raise ValueError(system)
    options = {"throw": False} if results else {}
    state, step = PARTS[part](importlib.import_module(MODULES[name]), options, scanned)
    call = jax.jit(step, donate_argnums=0)
    keys = list(jax.random.split(jax.random.key(0), steps))
    for k in keys[:2]:  # compile, and settle the state's types (see `h.time_steps`)
        state, total = call(state, k, 0)
    jax.block_until_ready(total)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for t, k in enumerate(keys):
            state, total = call(state, k, t)
        jax.block_until_ready((state, total))
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return {"values": rounds, "unit": "ms/step"}
