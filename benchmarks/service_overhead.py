"""What `ReplayService` costs over calling the same jitted buffer operations directly.

Run by hand from the repository root (not a workload of `python -m benchmarks`: it times
threads in one process, and compares the service with the buffer it serves, not with the
other systems):

    python -m benchmarks.service_overhead            # 5 repeats
    python -m benchmarks.service_overhead --quick    # a smoke run

Rows (the harness's item, `{"obs": f32[128], "action", "reward", "done"}`, from NumPy arrays
as an actor has them):

- `add_batch 64`: one thread, `UniformReplay` of 100k items, 64 items per call.
- `sample 256`: one thread, the same replay full, 256 rows per call.
- `add 8 of 16 envs`: one thread, `TrajectoryBuffer` of 16 envs, envpool's async mode: each
    call 8 envs (W10's add).
- `4 actors + 1 learner`: the service with 4 actor threads adding 64 items per call and a
    learner thread sampling 256 rows per call under `sample_to_insert_ratio(4.0, ...)` (4
    rows per item: a sample per add); the direct column does the same adds and samples from
    one thread, each sample as soon as the law allows it. Per add: the wall time of the whole
    run over the number of adds.

Each run ends by reading one row sampled from the final buffer, which waits for every add
before it (the service's buffer is not reachable otherwise without a copy).

The direct column calls `jax.jit(op, donate_argnums=0)` of the same method (what a
single-threaded program would write); the service wraps the same call in its law, its locks
and its bookkeeping. Each value is the median of the repeats, in microseconds; the ratio is
service over direct (1.00x: no overhead).
"""

import argparse
import statistics
import threading
import time

import dejax_eqx as dx
import jax
import numpy as np
from dejax_eqx import RateLimited, RateLimiter, ReplayService, WaitCannotEnd

from . import _harness as h


CAPACITY = 100_000
ADD, ROWS = 64, 256
POOL = 32  # distinct inputs, cycled


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    return [jax.tree.map(np.asarray, h.items(n, seed)) for seed in range(POOL)]


def _free_law() -> RateLimiter:
    """No bound: nothing waits, so the service's cost is its bookkeeping alone."""
    return RateLimiter(1, 1, None, None, insert_batch_size=ADD, sample_batch_size=ROWS)


def add_batch_row(calls: int, repeats: int) -> tuple[list[float], list[float]]:
    batches = _batches(ADD)
    add = jax.jit(lambda buf, items: buf.add_batch(items), donate_argnums=0)
    state = {"buf": dx.UniformReplay(h.prototype(), CAPACITY)}

    one = jax.jit(lambda buf, key: buf.sample(key, 1))
    key = jax.random.key(0)

    def direct():
        buf = state["buf"]
        for i in range(calls):
            buf = add(buf, batches[i % POOL])
        state["buf"] = buf
        jax.block_until_ready(one(buf, key))

    service = ReplayService(RateLimited(dx.UniformReplay(h.prototype(), CAPACITY), _free_law()))

    def served():
        for i in range(calls):
            service.add_batch(batches[i % POOL])
        jax.block_until_ready(service.sample(key, 1))

    return _per_call(direct, served, calls, repeats)


def sample_row(calls: int, repeats: int) -> tuple[list[float], list[float]]:
    batches = _batches(ADD)
    full = dx.UniformReplay(h.prototype(), CAPACITY)
    fill = jax.jit(lambda buf, items: buf.add_batch(items), donate_argnums=0)
    for i in range(CAPACITY // ADD + 1):
        full = fill(full, batches[i % POOL])
    sample = jax.jit(lambda buf, key: buf.sample(key, ROWS))
    keys = list(jax.random.split(jax.random.key(0), calls))

    def direct():
        jax.block_until_ready([sample(full, k) for k in keys])

    service = ReplayService(RateLimited(full, _free_law().with_counts(CAPACITY, 0)), donate=False)

    def served():
        jax.block_until_ready([service.sample(k, ROWS) for k in keys])

    return _per_call(direct, served, calls, repeats)


def trajectory_row(calls: int, repeats: int) -> tuple[list[float], list[float]]:
    num_envs, per_recv = 16, 8
    rng = np.random.default_rng(0)
    inputs = [
        (
            jax.tree.map(np.asarray, h.items(per_recv, seed)),
            rng.permutation(num_envs)[:per_recv].astype(np.int32),
        )
        for seed in range(POOL)
    ]
    add = jax.jit(lambda buf, steps, env_ids: buf.add(steps, env_ids), donate_argnums=0)
    state = {"buf": dx.TrajectoryBuffer(h.prototype(), num_envs, 2048)}

    window, key = dx.Window(1), jax.random.key(0)
    one = jax.jit(lambda buf, key: buf.sample(key, 1, window))

    def direct():
        buf = state["buf"]
        for i in range(calls):
            buf = add(buf, *inputs[i % POOL])
        state["buf"] = buf
        jax.block_until_ready(one(buf, key))

    law = RateLimiter(1, 1, None, None, insert_batch_size=per_recv)
    service = ReplayService(RateLimited(dx.TrajectoryBuffer(h.prototype(), num_envs, 2048), law))

    def served():
        for i in range(calls):
            service.add(*inputs[i % POOL])
        jax.block_until_ready(service.sample(key, 1, window))

    return _per_call(direct, served, calls, repeats)


def threads_row(calls: int, repeats: int) -> tuple[list[float], list[float]]:
    """4 actors of `calls // 4` adds each and a learner, against the same work in one
    thread. Per add."""
    actors, spi = 4, 4.0
    per_actor = calls // actors
    batches = _batches(ADD)
    min_size, slack = 4 * ADD, 4 * ROWS

    def law() -> RateLimiter:
        return RateLimiter.sample_to_insert_ratio(
            spi, min_size, slack, insert_batch_size=ADD, sample_batch_size=ROWS
        )

    add = jax.jit(lambda buf, items: buf.add_batch(items), donate_argnums=0)
    sample = jax.jit(lambda buf, key: buf.sample(key, ROWS))
    rate = law().rate

    def direct():
        buf, inserts, samples, key = dx.UniformReplay(h.prototype(), CAPACITY), 0, 0, None
        for i in range(actors * per_actor):
            buf = add(buf, batches[i % POOL])
            inserts += ADD
            while rate.can_sample(inserts, samples, ROWS):
                key = sample(buf, jax.random.key(samples))
                samples += ROWS
        jax.block_until_ready((buf, key))

    def served():
        buf = dx.UniformReplay(h.prototype(), CAPACITY)
        service = ReplayService(RateLimited(buf, law()))
        members = [service.actor() for _ in range(actors)]

        def actor(membership, a):
            with membership:
                for i in range(per_actor):
                    service.add_batch(batches[(a + i) % POOL])

        def learner():
            with service.learner():
                while True:
                    try:
                        out = service.sample(jax.random.key(service.counts()[1]), ROWS)
                    except WaitCannotEnd:
                        return
                    del out

        threads = [threading.Thread(target=actor, args=(m, a)) for a, m in enumerate(members)]
        threads.append(threading.Thread(target=learner))
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
            assert not t.is_alive(), "a thread of the benchmark hangs"
        inserts, _ = service.counts()
        assert inserts == actors * per_actor * ADD

    return _per_call(direct, served, actors * per_actor, repeats)


def _per_call(direct, served, calls: int, repeats: int) -> tuple[list[float], list[float]]:
    """Microseconds per call of each, their repeats interleaved."""
    direct(), served()  # compile and warm up both
    a, b = [], []
    for r in range(repeats):
        for fn, out in ((direct, a), (served, b))[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            fn()
            out.append(1e6 * (time.perf_counter() - start) / calls)
    return a, b


ROWS_OF_TABLE = {
    "add_batch 64": add_batch_row,
    "sample 256": sample_row,
    "add 8 of 16 envs": trajectory_row,
    "4 actors + 1 learner": threads_row,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    calls, repeats = (40, 1) if args.quick else (args.calls, args.repeats)
    machine = h.machine()
    print(
        f"{machine['cpu']}, {machine['cores_usable']} cores, {machine['device']}, "
        f"jax {machine['jax']}, load {machine['load_before']}; {calls} calls, {repeats} repeats"
    )
    print()
    print("| row | direct µs/call | service µs/call | service / direct |")
    print("|---|---:|---:|---:|")
    for name, row in ROWS_OF_TABLE.items():
        direct, served = row(calls, repeats)
        d, s = statistics.median(direct), statistics.median(served)
        print(f"| {name} | {d:.1f} | {s:.1f} | {s / d:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
