"""Sharding pattern 1, "Anakin": a batch of independent buffers, one per device.

The buffers are made with `eqx.filter_vmap`, so every leaf gains a leading axis with one row per
buffer, and that axis is sharded over the devices with `NamedSharding(mesh, P("devices"))`. The
training step is an ordinary donated `eqx.filter_jit` of a vmapped `add_and_sample`: XLA
partitions it so that each device updates its own buffer in place and samples from it. No buffer
data moves between devices.

Run: python examples/sharding_anakin.py
On a machine without accelerators it asks XLA for 4 CPU devices, so that the sharding is real.
"""

import os


# Must be set before JAX starts. It only concerns the CPU platform, so GPUs and TPUs are used as
# they are.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


ITEM = {
    "obs": jnp.zeros(4, jnp.float32),
    "device": jnp.zeros((), jnp.int32),  # which device's environments produced the item
    "step": jnp.zeros((), jnp.int32),
}


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(AxisType.Explicit,))


def make_buffers(mesh: jax.sharding.Mesh, max_size: int) -> dx.UniformReplay:
    """One `UniformReplay` per device, each allocated directly on its own device.

    Built inside `jax.jit` with `out_shardings`, so that no device ever holds more than its
    own buffer (making the whole batch on one device and then `jax.device_put`ting it would
    need all of it to fit there first).
    """
    num = mesh.shape["devices"]
    make = lambda: eqx.filter_vmap(lambda: dx.UniformReplay(ITEM, max_size), axis_size=num)()
    return jax.jit(make, out_shardings=NamedSharding(mesh, P("devices")))()


@eqx.filter_jit(donate="all")
def step(buffers, items, key, *, sharding: NamedSharding, batch_size: int):
    """Add `items[d]` to buffer `d`, then sample `batch_size` items from it, for every `d`.

    `items` leaves have shape `[num_devices, n, ...]`, sharded like the buffers. Returns the new
    buffers and the samples, `[num_devices, batch_size, ...]`, each row on its buffer's device.
    """
    keys = jax.random.split(key, jax.tree.leaves(items)[0].shape[0])
    # Every device computes all the keys (a few integers); resharding them like the buffers
    # only keeps each device's own row, without communication. With an `AxisType.Auto` mesh,
    # use `jax.lax.with_sharding_constraint(keys, sharding)` instead.
    keys = jax.sharding.reshard(keys, sharding)
    add_and_sample = lambda buf, x, k: buf.add_and_sample(x, k, batch_size)
    return eqx.filter_vmap(add_and_sample)(buffers, items, keys)


def main(num_steps: int = 20, items_per_step: int = 8, batch_size: int = 16) -> None:
    mesh = make_mesh()
    sharding = NamedSharding(mesh, P("devices"))
    num = mesh.shape["devices"]
    buffers = make_buffers(mesh, max_size=1000)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    for t in range(num_steps):
        # Stand-in for the environments: device d's items carry the label d. From the host,
        # each device receives only its own rows.
        items = {
            "obs": rng.normal(size=(num, items_per_step, 4)).astype(np.float32),
            "device": np.repeat(np.arange(num, dtype=np.int32)[:, None], items_per_step, 1),
            "step": np.full((num, items_per_step), t, np.int32),
        }
        key, subkey = jax.random.split(key)
        buffers, batch = step(
            buffers,
            jax.device_put(items, sharding),
            subkey,
            sharding=sharding,
            batch_size=batch_size,
        )

    # Each device sampled only from its own buffer.
    assert (np.asarray(batch["device"]) == np.arange(num)[:, None]).all()
    print(f"{num} devices: {jax.devices()}")
    # `size` is a property of one buffer: ask each buffer of the batch, under vmap.
    sizes = eqx.filter_vmap(lambda buffer: buffer.size)(buffers)
    print(f"buffer sizes: {np.asarray(sizes).tolist()} (max_size {buffers.max_size})")
    print(f"buffer sharding: {buffers.storage.data['obs'].sharding.spec}")
    print(f"samples per device: {batch_size}, each from that device's own buffer")


if __name__ == "__main__":
    main()
