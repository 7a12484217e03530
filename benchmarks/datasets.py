"""W11: writing a training run's steps to disk and reading them back, in MB/s of step data.

16 envs step in lock-step; every `WRITE_EVERY` steps of each env, the new steps go to disk
(the buffer holds twice that, so nothing is lost between writes). `size` is the number of
steps per env in all; the item is the harness's (`obs f32[128]`, `action i32`, `reward f32`,
`done bool`: 521 bytes a step). The data start on the device, as a buffer's do, and every
system's timing includes taking them off it.

- `... write`: the time of the writes only (the adds between them are not timed), every step
    once; MB/s of step data written.
- `... read`: after the same writes, reading every step back into host memory; MB/s.

Systems:

- `dejax_eqx`: `dx.Dataset.write(buffer)` from a `TrajectoryBuffer`; reads with
    `Dataset.read(env, start, end)`, env by env. zarr v3 through tensorstore, uncompressed,
    every chunk and the manifest `fsync`ed (the default). `dejax_eqx sync=False`: the same
    without the `fsync`s (`np.save` does none; the Vault runs on tensorstore's defaults).
- `numpy`: the same new steps as arrays (`np.asarray` of each leaf's new `[16, WRITE_EVERY]`
    block), each written with `np.save` to its own `.npy` file; reads with `np.load` of every
    file. No manifest, no crash safety, no random access by step: the floor of writing
    arrays to files.
- `flashbax`: flashbax 0.1.3's `Vault.write(state)` from a flashbax trajectory buffer of the
    same data, with its default compression; reads with `Vault.read()`.
"""

import shutil
import tempfile
import time
from pathlib import Path

import dejax_eqx as dx
import jax
import numpy as np

from . import _harness as h


NUM_ENVS = 16
WRITE_EVERY = 1024  # steps of each env between two writes


def _blocks(size: int):
    """The steps, as `size // WRITE_EVERY` device blocks `[NUM_ENVS, WRITE_EVERY, ...]`."""
    per = min(WRITE_EVERY, size)
    make = jax.jit(
        lambda key: jax.tree.map(
            lambda x: x.reshape(NUM_ENVS, per, *x.shape[1:]), h.generate(key, NUM_ENVS * per)
        )
    )
    return [make(jax.random.key(i)) for i in range(size // per)], per


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _dejax(blocks, per, directory: Path, sync: bool = True):
    """Seconds of the writes, and a function that reads everything back."""
    buf = dx.TrajectoryBuffer(h.prototype(), NUM_ENVS, 2 * per)
    extend = jax.jit(lambda b, x: b.extend(x), donate_argnums=0)
    dataset = dx.Dataset.create(directory / "d", h.prototype(), NUM_ENVS, sync=sync)
    seconds = 0.0
    for block in blocks:
        buf = jax.block_until_ready(extend(buf, block))
        start = time.perf_counter()
        dataset.write(buf)
        seconds += time.perf_counter() - start

    def read():
        d = dx.Dataset.open(directory / "d", h.prototype())
        return [d.read(e, int(d.starts[e]), int(d.ends[e])) for e in range(NUM_ENVS)]

    return seconds, read


def _numpy(blocks, per, directory: Path):
    seconds = 0.0
    files = []
    for i, block in enumerate(blocks):
        start = time.perf_counter()
        for name, leaf in block.items():
            files.append(directory / f"{i}-{name}.npy")
            np.save(files[-1], np.asarray(leaf))
        seconds += time.perf_counter() - start
    return seconds, lambda: [np.load(f) for f in files]


def _flashbax(blocks, per, directory: Path):
    import flashbax as fbx
    from flashbax.vault import Vault

    buffer = fbx.make_trajectory_buffer(
        max_length_time_axis=2 * per,
        min_length_time_axis=1,
        sample_batch_size=1,
        add_batch_size=NUM_ENVS,
        sample_sequence_length=1,
        period=1,
    )
    state = buffer.init(h.prototype())
    add = jax.jit(buffer.add, donate_argnums=0)
    vault = Vault(
        "w11", experience_structure=state.experience, rel_dir=str(directory), vault_uid="run"
    )
    seconds = 0.0
    for block in blocks:
        state = jax.block_until_ready(add(state, block))
        start = time.perf_counter()
        vault.write(state)
        seconds += time.perf_counter() - start

    def read():
        again = Vault("w11", rel_dir=str(directory), vault_uid="run")
        return jax.block_until_ready(again.read().experience)

    return seconds, read


_SYSTEMS = {
    "dejax_eqx": _dejax,
    "dejax_eqx sync=False": lambda *args: _dejax(*args, sync=False),
    "numpy": _numpy,
    "flashbax": _flashbax,
}


def w11(system: str, size: int, steps: int, repeats: int) -> dict:
    del steps
    name, part = system.rsplit(" ", 1)
    blocks, per = _blocks(size)
    total = sum(_nbytes(b) for b in blocks)
    values = []
    for r in range(repeats + 1):  # the first run warms up (compilation, imports, the cache)
        directory = Path(tempfile.mkdtemp(prefix="w11-"))
        try:
            seconds, read = _SYSTEMS[name](blocks, per, directory)
            if part == "read":
                start = time.perf_counter()
                out = read()
                seconds = time.perf_counter() - start
                assert sum(_nbytes(x) for x in jax.tree.leaves(out)) == total
        finally:
            shutil.rmtree(directory)
        if r:
            values.append(total / seconds / 1e6)
    return {"values": values, "unit": "MB/s", "bytes": total}
