"""W6: prioritised replay, one training step = sample 256 items + set the priorities of those 256.

What is timed: `steps` training steps inside one jitted, donating `lax.scan`, on a buffer
filled with `capacity` items. Each step samples a batch, computes new priorities from every
field of the sampled items (so the whole batch is read, as a learner would) and writes them
back. The raw floor does the same with uniformly random indices and no priorities at all: the
cost of moving the batch, which no prioritised buffer can avoid.
"""

import dejax_eqx as dx
import jax
import jax.numpy as jnp

from . import _harness as h


BATCH_SIZE = 256
PRIORITY_EXPONENT = 0.6


def _new_priorities(sampled):
    """Stands in for |TD error|: reads every field of the sampled items."""
    value = (
        jnp.mean(sampled["obs"], axis=-1)
        + sampled["reward"]
        + sampled["action"].astype(jnp.float32)
    )
    return jnp.abs(jnp.where(sampled["done"], 0.0, value)) + 1e-3


def _dejax_eqx(capacity: int, steps: int, stratified: bool):
    full = h.items(capacity)
    buf = dx.PrioritisedReplay(h.prototype(), capacity, PRIORITY_EXPONENT, stratified=stratified)
    buf = jax.jit(lambda b, x: b.add_batch(x), donate_argnums=0)(buf, full)
    del full

    def run(buf, key):
        def step(buf, key):
            s = buf.sample(key, BATCH_SIZE)
            return buf.set_priorities(s.indices, _new_priorities(s.items)), None

        return jax.lax.scan(step, buf, jax.random.split(key, steps))[0]

    return buf, run


def _flashbax(capacity: int, steps: int):
    """`make_prioritised_flat_buffer` on CPU (`device="cpu"`; it always samples stratified and
    reads transition pairs: each draw an item and its successor)."""
    import flashbax as fbx

    full = h.items(capacity)
    buffer = fbx.make_prioritised_flat_buffer(
        max_length=capacity,
        min_length=BATCH_SIZE,
        sample_batch_size=BATCH_SIZE,
        add_sequences=True,
        add_batch_size=1,
        priority_exponent=PRIORITY_EXPONENT,
        device="cpu",
    )

    def add(state, full):  # one row of `capacity` steps
        return buffer.add(state, jax.tree.map(lambda x: x[None], full))

    state = jax.jit(add, donate_argnums=0)(buffer.init(h.prototype()), full)
    del full

    def run(state, key):
        def step(state, key):
            s = buffer.sample(state, key)
            new = _new_priorities(s.experience.first)
            return buffer.set_priorities(state, s.indices, new), None

        return jax.lax.scan(step, state, jax.random.split(key, steps))[0]

    return state, run


def _raw(capacity: int, steps: int):
    """Gather a uniformly random batch and compute its priorities; no tree."""

    def run(state, key):
        data, acc = state

        def step(acc, key):
            index = jax.random.randint(key, (BATCH_SIZE,), 0, capacity)
            batch = jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), data)
            return acc + jnp.sum(_new_priorities(batch)), None

        return data, jax.lax.scan(step, acc, jax.random.split(key, steps))[0]

    return (h.items(capacity), jnp.float32(0)), run


def w6(system: str, capacity: int, steps: int, repeats: int) -> dict:
    if system == "dejax_eqx":
        state, run = _dejax_eqx(capacity, steps, stratified=False)
    elif system == "dejax_eqx stratified":
        state, run = _dejax_eqx(capacity, steps, stratified=True)
    elif system == "flashbax":
        state, run = _flashbax(capacity, steps)
    elif system == "raw":
        state, run = _raw(capacity, steps)
    else:
        raise ValueError(system)
    # The state is donated, so the scan updates it in place (the raw floor's data is returned
    # unchanged and aliases its input: no copy either).
    seconds = h.time_steps(jax.jit(run, donate_argnums=0), state, repeats)
    return {"values": [steps / s for s in seconds], "unit": "steps/s"}
