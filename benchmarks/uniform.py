"""W1-W4: item buffers (`dx.UniformReplay`, flashbax's item buffer, dejax, the raw floor).

Each function `wN(system, size, steps, repeats)` makes one measurement in the calling process
and returns `{"values": [...], "unit": ...}`; the entry point runs each in its own process.
"""

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp

from . import _harness as h


def _raw_add(data, head, new, capacity: int):
    """The floor's add: one unique-index scatter per leaf at the ring's next slots."""
    n = jax.tree.leaves(new)[0].shape[0]
    slots = h.ring_slots(head, n, capacity)
    data = jax.tree.map(
        lambda x, y: x.at[slots].set(y, unique_indices=True, mode="promise_in_bounds"),
        data,
        new,
    )
    return data, (head + n) % capacity


def _raw_sample(data, key, batch: int, capacity: int):
    index = jax.random.randint(key, (batch,), 0, capacity)
    return jax.tree.map(lambda x: jnp.take(x, index, axis=0, mode="clip"), data)


# ---------------------------------------------------------------------------------------------
# W1: add_batch in a scan


def w1(system: str, capacity: int, steps: int, repeats: int) -> dict:
    batch = 256
    new = h.items(batch, seed=1)

    if system == "dejax_eqx":
        state = dx.UniformReplay(h.prototype(), capacity)

        def add(buf, new):
            return buf.add_batch(new)
    elif system == "raw":
        data = jax.tree.map(lambda x: jnp.zeros((capacity, *x.shape[1:]), x.dtype), new)
        state = (data, jnp.int32(0), jnp.int32(0))

        def add(state, new):
            data, head, count = state
            data, head = _raw_add(data, head, new, capacity)
            return data, head, jnp.minimum(count + batch, capacity)
    elif system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=256, add_batches=True
        )
        state = buffer.init(h.prototype())
        add = buffer.add
    elif system == "dejax":
        import dejax

        buffer = dejax.uniform_replay(capacity)
        state = buffer.init_fn(h.prototype())
        add = buffer.add_batch_fn
    else:
        raise ValueError(system)

    def run(carry, key):
        del key
        state, new = carry
        state = jax.lax.scan(lambda s, _: (add(s, new), None), state, None, length=steps)[0]
        return state, new

    seconds = h.time_steps(jax.jit(run, donate_argnums=0), (state, new), repeats)
    return {"values": [steps * batch / s for s in seconds], "unit": "items/s"}


# ---------------------------------------------------------------------------------------------
# W2: sample from a full buffer in a scan


def w2(system: str, capacity: int, steps: int, repeats: int) -> dict:
    batch = 256
    full = h.items(capacity)

    if system == "dejax_eqx":
        state = jax.jit(lambda x: dx.UniformReplay(h.prototype(), capacity).add_batch(x))(full)

        def sample(buf, key):
            return buf.sample(key, batch)
    elif system == "raw":
        state = full

        def sample(data, key):
            return _raw_sample(data, key, batch, capacity)
    elif system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=batch, add_batches=True
        )
        state = jax.jit(buffer.add, donate_argnums=0)(buffer.init(h.prototype()), full)

        def sample(state, key):
            return buffer.sample(state, key).experience
    elif system == "dejax":
        import dejax
        from jax.experimental import checkify

        buffer = dejax.uniform_replay(capacity)
        state = jax.jit(buffer.add_batch_fn)(buffer.init_fn(h.prototype()), full)

        def sample(state, key):
            # dejax's sample holds a checkify check: it must run under `checkify`.
            err, out = checkify.checkify(buffer.sample_fn, errors=checkify.user_checks)(
                state, key, batch
            )
            return out
    else:
        raise ValueError(system)
    del full

    seconds = h.time_reads(h.sampling_scan(sample, steps), state, repeats)
    return {"values": [steps * batch / s for s in seconds], "unit": "items/s"}


# ---------------------------------------------------------------------------------------------
# W3 / W4: a Python loop of donated steps (add 64, sample 256)


def _fill(add, state, capacity: int):
    """`state` filled to capacity by a donated loop of adds of 1,024 generated items: no array
    of all the items ever exists next to the buffer (W4 measures the memory)."""
    chunk = 1024

    def body(i, state):
        return add(state, h.generate(jax.random.fold_in(jax.random.key(0), i), chunk))

    loops = -(-capacity // chunk)
    fill = jax.jit(lambda s: jax.lax.fori_loop(0, loops, body, s), donate_argnums=0)
    return fill(state)


def _w3_step(system: str, capacity: int):
    """`(state, step)`: a full buffer of `capacity` items and the jitted, donating step
    `step(key, state, items) -> (state, sample)`."""
    if system.startswith("dejax_eqx"):
        system, results = h.results_mode(system)
        state = _fill(
            lambda b, x: b.add_batch(x),
            dx.UniformReplay(h.prototype(), capacity, throw=not results),
            capacity,
        )

        def step(key, buf, new):
            buf = buf.add_batch(new)
            return buf, buf.sample(key, 256)

        if system == "dejax_eqx":  # the documented default: eqx.filter_jit
            return state, eqx.filter_jit(step, donate="all-except-first")
        if system == "dejax_eqx jax.jit":  # the fast path: buffers are pytrees of arrays
            return state, jax.jit(step, donate_argnums=1)
        raise ValueError(system)
    if system.startswith("raw"):
        state = (h.items(capacity), jnp.int32(0))

        def step(key, state, new):
            data, head = _raw_add(*state, new, capacity)
            return (data, head), _raw_sample(data, key, 256, capacity)

        if system == "raw":
            return state, jax.jit(step, donate_argnums=1)
        if system == "raw filter_jit":  # equinox's dispatch on a plain tuple of arrays
            return state, eqx.filter_jit(step, donate="all-except-first")
        raise ValueError(system)
    if system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_item_buffer(
            max_length=capacity, min_length=1, sample_batch_size=256, add_batches=True
        )
        state = _fill(buffer.add, buffer.init(h.prototype()), capacity)

        def step(key, state, new):
            state = buffer.add(state, new)
            return state, buffer.sample(state, key).experience

        return state, jax.jit(step, donate_argnums=1)
    raise ValueError(system)


def w3(system: str, capacity: int, steps: int, repeats: int) -> dict:
    state, step = _w3_step(system, capacity)
    new = h.items(64, seed=2)
    keys = list(jax.random.split(jax.random.key(0), steps))

    def loop(state, key):
        del key
        for k in keys:
            state, out = step(k, state, new)
        return jax.block_until_ready((state, out))[0]

    seconds = h.time_steps(loop, state, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/step"}


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: now; VmHWM: the peak since reset), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def w4(system: str, capacity: int, steps: int, repeats: int) -> dict:
    """Peak RSS growth over a baseline taken after JAX started and a small step ran.

    `values` holds the whole growth (the buffer, the compiled programs, the runtime's
    allocations) over the buffer's bytes; `in_steps_bytes` the growth of the peak during the
    steps after the first (compiled) one, which is where a second copy of the buffer would show.
    """
    del repeats
    small, small_step = _w3_step(system, 1024)
    jax.block_until_ready(small_step(jax.random.key(0), small, h.items(64)))
    del small
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    state, step = _w3_step(system, capacity)
    # Every buffer is a pytree of arrays (public contract), so its leaves are its storage.
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    new = h.items(64, seed=2)
    keys = jax.random.split(jax.random.key(0), steps)
    state, out = step(keys[0], state, new)
    jax.block_until_ready((state, out))
    total_before_steps = _status_bytes("VmHWM")
    _reset_peak()
    first = _status_bytes("VmRSS")
    for k in keys[1:]:
        state, out = step(k, state, new)
    jax.block_until_ready((state, out))
    peak = max(_status_bytes("VmHWM"), total_before_steps)
    return {
        "values": [(peak - baseline) / nbytes],
        "unit": "x buffer bytes",
        "buffer_bytes": nbytes,
        "in_steps_bytes": _status_bytes("VmHWM") - first,
    }
