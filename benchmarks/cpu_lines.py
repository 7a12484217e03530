"""What sets a small step's cost on a CPU of few cores, apart from the buffer's own work.

Issue 38's targets for Python-called and vmapped steps are ratios of steps of a few tens of
microseconds. Two costs that no buffer code controls are of that size; this module measures
both, in one process, repeats interleaved (`_harness.time_interleaved`):

- **XLA's parallel-task line.** XLA's CPU runtime splits a kernel whose estimated cost passes
  a line into tasks for its thread pool. On a machine of two cores, one of them busy, the
  hand-off costs more than the kernel. The rows `bits <n>` time a `jax.random.bits` draw of
  `n` words (one threefry kernel), 200 draws in a jitted `lax.scan`, in microseconds per draw:
  the time jumps between two sizes where the kernel is split. A vmapped step draws the words
  of every lane in one kernel, so it passes the line at a third of one buffer's draw
  (`benchmarks/vmapped.py`). Run under `taskset -c 0` (one core: XLA makes no tasks) for the
  same rows without the line.
- **Flattening a module in Python.** A jitted call flattens its arguments and builds its
  outputs. A tuple, or a dataclass registered with `jax.tree_util.register_dataclass`, is
  flattened in C++; an `equinox.Module` by equinox's generated Python functions, one call per
  module node. The rows `flatten <kind>` are `jax.tree.flatten` plus `jax.tree.unflatten`
  (`timeit`, microseconds per call) of one int32 scalar held by each kind of node, and of
  `UniformReplay` and `TrajectoryBuffer` (`throw=False`; 3 module nodes each), against their
  leaves as a tuple. The rows `call <kind>` time a whole jitted call, donated, that adds one to
  each of three int32 scalars, held as a tuple or in the shape of a `throw=False` buffer: a
  module holding a module of two (its store) and a result, which is a module, a registered
  dataclass, or a bare array (microseconds per call, calls in a Python loop, the kinds
  interleaved over the repeats).

Run from the repository root (not a workload of `python -m benchmarks`):

    python -m benchmarks.cpu_lines
    taskset -c 0 python -m benchmarks.cpu_lines    # one core
    python -m benchmarks.cpu_lines --quick         # a smoke run
"""

import argparse
import dataclasses
import statistics
import time
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp

from . import _harness as h


WORDS = (256, 512, 1024, 1280, 1536, 2048)


class _Module(eqx.Module):
    code: jax.Array


@dataclasses.dataclass(frozen=True)
class _Dataclass:
    code: jax.Array


jax.tree_util.register_dataclass(_Dataclass, data_fields=["code"], meta_fields=[])


class _Store(eqx.Module):
    head: jax.Array
    count: jax.Array
    size: int = eqx.field(static=True)


class _Buffer(eqx.Module):
    store: _Store
    result: Any


def _bits(words: int, steps: int):
    """`(call, state)` for `h.time_interleaved`: `steps` draws of `words` random words."""

    @jax.jit
    def run(total, key):
        def body(total, k):
            return total + jnp.sum(jax.random.bits(k, (words,), jnp.uint32) >> 16), None

        return jax.lax.scan(body, total, jax.random.split(key, steps))[0]

    return run, jnp.zeros((), jnp.uint32)


def bits_rows(steps: int, repeats: int) -> dict[str, float]:
    runs = {f"bits {n}": _bits(n, steps) for n in WORDS}
    seconds = h.time_interleaved(runs, repeats)
    return {row: statistics.median(values) / steps * 1e6 for row, values in seconds.items()}


def _flatten_us(tree, number: int) -> float:
    """The fastest of 5 repeats of `number` flattens, plus that of `number` unflattens."""
    times = h.flatten_times(tree, 5, number)
    return min(times["flatten"]) + min(times["unflatten"])


def flatten_rows(number: int) -> dict[str, float]:
    code = jnp.zeros((), jnp.int32)
    item = {"obs": jnp.zeros(4), "reward": jnp.zeros(()), "done": jnp.zeros((), jnp.bool_)}
    trees = {
        "tuple": (code,),
        "register_dataclass": _Dataclass(code),
        "eqx.Module": _Module(code),
        "UniformReplay": dx.UniformReplay(item, 10_000, throw=False),
        "UniformReplay's leaves": None,
        "TrajectoryBuffer": dx.TrajectoryBuffer(item, 64, 1_000, throw=False),
        "TrajectoryBuffer's leaves": None,
    }
    out = {}
    for name, tree in trees.items():
        if tree is None:  # the leaves of the buffer before, as a tuple
            tree = tuple(jax.tree.leaves(trees[name.removesuffix("'s leaves")]))
        out[f"flatten {name}"] = _flatten_us(tree, number)
    return out


def call_rows(calls: int, repeats: int) -> dict[str, float]:
    def zero():
        return jnp.zeros((), jnp.int32)

    make = {
        "tuple": lambda: (zero(), zero(), zero()),
        "3 module nodes": lambda: _Buffer(_Store(zero(), zero(), 8), _Module(zero())),
        "2 module nodes and a register_dataclass": lambda: _Buffer(
            _Store(zero(), zero(), 8), _Dataclass(zero())
        ),
        "2 module nodes and an array": lambda: _Buffer(_Store(zero(), zero(), 8), zero()),
    }
    step = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)
    states = {kind: step(m()) for kind, m in make.items()}  # compiled before timing
    times: dict[str, list[float]] = {kind: [] for kind in make}
    for _ in range(repeats):
        for kind in make:
            state, start = states[kind], time.perf_counter()
            for _ in range(calls):
                state = step(state)
            states[kind] = jax.block_until_ready(state)
            times[kind].append((time.perf_counter() - start) / calls * 1e6)
    return {f"call {kind}": statistics.median(values) for kind, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    steps, repeats, number = (5, 1, 100) if args.quick else (200, 9, 20_000)
    machine = h.machine()
    print(
        f"{machine['cpu']}, {machine['cores_usable']} cores usable, jax {machine['jax']}, "
        f"equinox {machine['equinox']}, load {machine['load_before']}",
        flush=True,
    )
    rows = bits_rows(steps, repeats) | flatten_rows(number) | call_rows(number // 10, repeats)
    print(f"load after: {h.load_average()}")
    print()
    print("| row | µs |")
    print("|---|---:|")
    for row, value in rows.items():
        print(f"| {row} | {value:.2f} |")


if __name__ == "__main__":
    main()
