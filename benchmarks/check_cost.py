"""W14: what the run-time checks cost a program, by themselves.

Every data-dependent fault of a public call goes through one `check_faults` (one
`eqx.branched_error_if`, whose error branch holds host callbacks). This workload measures that
mechanism alone, on a step with no buffer in it, so that the cost is not hidden in a buffer's
own work: `step(x) -> x * 1.0001 + 1` on a float32 vector of 64 entries, under
`jax.jit(step, donate_argnums=0)`, called `steps` times from a Python loop, with `k` checks
of `x` added through `dejax_eqx.internal.check_faults` (each its own call, as `k` public calls
in one jitted step would make them; the conditions never hold). The value is microseconds per
call; `size` is `k`.

Systems:

- `checks`: the step with `k` checks (`k = 0` is the step alone).
- `checks, heavy`: the same with a 1024x1024 matmul added to the step (about 10 ms on the
    2-core machine); the value is the microseconds until the call *returns* (not until its
    result is ready). A program JAX runs asynchronously returns in microseconds; one it runs
    synchronously returns when it has run.
- `..., EQX_ON_ERROR=nan`: the same, the checks as NaNs (no callback).

What it showed (see docs/benchmarks.md): with jax 0.10.2, a check costs a tiny step well
under a microsecond, but any program that holds one runs synchronously; with jax 0.5.3 any
program that holds a callback leaves JAX's C++ dispatch path and costs about 200 µs a call.
"""

import time

import jax
import jax.numpy as jnp
from dejax_eqx.internal import check_faults

from . import _harness as h


WIDTH = 64
HEAVY = 1024


def _step(k: int, heavy: bool):
    def step(x, m):
        for i in range(k):
            x = check_faults(x, [(x[i % WIDTH] < -1e30, f"`W14`: check {i} failed")])
        y = m @ m if heavy else m
        return x * 1.0001 + 1, y

    return jax.jit(step, donate_argnums=0)


def w14(system: str, size: int, steps: int, repeats: int) -> dict:
    name, _, mode = system.partition(", ")
    if name != "checks" or mode not in ("", "heavy"):
        raise ValueError(system)
    heavy = mode == "heavy"
    call = _step(size, heavy)
    m = jnp.ones((HEAVY, HEAVY) if heavy else (1,), jnp.float32)
    x = jnp.zeros(WIDTH, jnp.float32)
    for _ in range(3):  # compile and warm up
        x, y = call(x, m)
    jax.block_until_ready((x, y))
    if heavy:  # time to return, one call at a time
        values = []
        for _ in range(repeats):
            start = time.perf_counter()
            x, y = call(x, m)
            values.append((time.perf_counter() - start) * 1e6)
            jax.block_until_ready((x, y))
        return {"values": values, "unit": "us/call"}

    def loop(x, key):
        del key
        for _ in range(steps):
            x, _ = call(x, m)
        return jax.block_until_ready(x)

    seconds = h.time_steps(loop, x, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/call"}
