"""Sharding pattern 2: one logical buffer per device, inside `jax.shard_map`.

Inside `shard_map` each device runs ordinary single-buffer code on its own block of the
arrays: it builds its buffer, adds its own items and samples from its own data. Outside, the
buffers look like a batch with one row per device (every leaf has a leading axis sharded over
"devices"), so they can be donated, saved, or handed to the next step like any pytree. This is
the form to use when the step also runs per-device code of its own (a learner with `pmean`ed
gradients, model parallelism) inside the same `shard_map`.

Run: python examples/sharding_shard_map.py
On a machine without accelerators it asks XLA for 4 CPU devices, so that the sharding is real.
"""

import os


# Must be set before JAX starts. It only concerns the CPU platform.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


ITEM = {
    "obs": jnp.zeros(4, jnp.float32),
    "device": jnp.zeros((), jnp.int32),  # which device's environments produced the item
    "step": jnp.zeros((), jnp.int32),
}


def _local(tree):
    """This device's block of a per-device array (leading axis 1) -> the value itself."""
    return jax.tree.map(lambda x: x[0], tree)


def _stacked(tree):
    """The inverse of `_local`: a leading axis of 1, one row per device outside `shard_map`."""
    return jax.tree.map(lambda x: x[None], tree)


def make_buffers(mesh: jax.sharding.Mesh, max_size: int) -> dx.UniformReplay:
    """Each device makes its own empty `UniformReplay`, in its own memory."""
    make = jax.shard_map(
        lambda: _stacked(dx.UniformReplay(ITEM, max_size)),
        mesh=mesh,
        in_specs=(),
        out_specs=P("devices"),
    )
    return jax.jit(make)()


def make_step(mesh: jax.sharding.Mesh, batch_size: int):
    """A donated, jitted step: every device adds its items to its buffer and samples from it."""

    def local_step(buffers, items, key):
        buffer, items = _local((buffers, items))
        # One key for all devices comes in; each device derives its own.
        key = jax.random.fold_in(key, jax.lax.axis_index("devices"))
        buffer, batch = buffer.add_and_sample(items, key, batch_size)
        return _stacked((buffer, batch))

    per_device = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P("devices"), P("devices"), P()),
        out_specs=P("devices"),
    )
    return eqx.filter_jit(per_device, donate="all")


def main(num_steps: int = 20, items_per_step: int = 8, batch_size: int = 16) -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("devices",))
    num = mesh.shape["devices"]
    sharding = NamedSharding(mesh, P("devices"))
    buffers = make_buffers(mesh, max_size=1000)
    step = make_step(mesh, batch_size)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    for t in range(num_steps):
        # Stand-in for the environments: device d's items carry the label d.
        items = {
            "obs": rng.normal(size=(num, items_per_step, 4)).astype(np.float32),
            "device": np.repeat(np.arange(num, dtype=np.int32)[:, None], items_per_step, 1),
            "step": np.full((num, items_per_step), t, np.int32),
        }
        key, subkey = jax.random.split(key)
        buffers, batch = step(buffers, jax.device_put(items, sharding), subkey)

    # Each device sampled only from the items it added.
    assert (np.asarray(batch["device"]) == np.arange(num)[:, None]).all()
    print(f"{num} devices: {jax.devices()}")
    # `size` is a property of one buffer: ask each buffer of the batch, under vmap.
    sizes = eqx.filter_vmap(lambda buffer: buffer.size)(buffers)
    print(f"buffer sizes: {np.asarray(sizes).tolist()} (max_size {buffers.max_size})")
    print(f"samples per device: {batch_size}, each from that device's own buffer")


if __name__ == "__main__":
    main()
