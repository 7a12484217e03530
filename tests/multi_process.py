"""Checks of the global buffers (`dx.GlobalReplay`, `dx.GlobalTrajectoryBuffer`) across real
processes, run by `test_multi_process.py`.

One process of a `jax.distributed` program: started `--processes` times on 127.0.0.1 with
`--devices` CPU devices each, CPU collectives over gloo. Every check asserts in every process
(the samples are replicated, so each process compares the whole batch), and a failing check
exits non-zero. The file name does not match `test_*.py`: pytest does not collect it. By hand:

    python -m tests.multi_process --processes 2 --devices 2 --port 12345 --id 0 --out DIR &
    python -m tests.multi_process --processes 2 --devices 2 --port 12345 --id 1 --out DIR

The data are a function of the global shard and row, so every process can build the single
buffer that holds all of them, and compare.
"""

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checks", default="all", help="comma-separated names, or 'all'")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    import jax
    import jax.experimental.multihost_utils  # noqa: F401

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.id,
            initialization_timeout=60,
        )
    assert jax.process_count() == args.processes
    assert jax.device_count() == args.processes * args.devices
    names = list(CHECKS) if args.checks == "all" else args.checks.split(",")
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            CHECKS[name](args.out)
            seconds = time.perf_counter() - start
            print(f"process {args.id}: {name} passed ({seconds:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"process {args.id}: {name} FAILED", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            # A check that failed in one process may leave the others waiting in a
            # collective: stop here rather than run the next check out of step.
            break
    if args.processes > 1:
        jax.distributed.shutdown()
    sys.exit(1 if failed else 0)


CHECKS: dict[str, Callable[[Path], None]] = {}


def check(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    CHECKS[fn.__name__] = fn
    return fn


# The checks import JAX only once `main` has set the device count.


def _setup():
    import dejax_eqx as dx
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    return dx, eqx, jax, jnp, np


def _mesh():
    import jax

    return jax.make_mesh((jax.device_count(),), ("replay",))


ITEM_SHAPE = (3,)


def _replay_rows(np, shards, per_shard, fill):
    """Rows for `shards` shards: shard `k` gets `per_shard` rows, the first `fill(k)` valid.
    Item ids are unique over the whole buffer: `1000 k + j`."""
    ids = np.array([1000 * k + j for k in range(shards) for j in range(per_shard)], np.int32)
    mask = np.array([j < fill(k) for k in range(shards) for j in range(per_shard)])
    items = {"obs": np.repeat(ids[:, None], 3, axis=1).astype(np.float32), "id": ids}
    return items, mask


def _local(np, buffer, tree):
    """This process's rows of `tree` (split into one equal block per shard)."""
    n = buffer.num_shards

    def rows(x):
        blocks = np.split(np.asarray(x), n)
        return np.concatenate([blocks[k] for k in buffer.local_shard_ids])

    import jax

    return jax.tree.map(rows, tree)


def _whole(x):
    """Every process's shards of a global array, as one host array."""
    import jax.experimental.multihost_utils
    import numpy as np

    return np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True))


def _item():
    import jax.numpy as jnp

    return {"obs": jnp.zeros(ITEM_SHAPE), "id": jnp.zeros((), jnp.int32)}


def _chi_square_p(np, counts, probabilities):
    from scipy import stats

    keep = probabilities > 0
    assert counts[~keep].sum() == 0, "an item of probability 0 was drawn"
    expected = probabilities[keep] / probabilities[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


# Statistical checks: fixed keys; each fails a correct implementation with probability 1e-6.
P_MIN = 1e-6


@check
def uniform(out: Path) -> None:
    """Each process adds only its own shards' rows; shards unequally full; the global sample
    equals a single replay's holding shard 0's items, then shard 1's, ...; chi-square."""
    dx, eqx, jax, jnp, np = _setup()
    buffer = dx.GlobalReplay(_mesh(), lambda: dx.UniformReplay(_item(), 16))
    n = buffer.num_shards
    items, mask = _replay_rows(np, n, 8, lambda k: 2 * k + 1)
    buffer = buffer.add_batch(
        buffer.rows(_local(np, buffer, items)), mask=buffer.rows(_local(np, buffer, mask))
    )
    single = dx.UniformReplay(_item(), 16 * n).add_batch(items, mask=mask)
    assert int(buffer.size) == int(single.size) == sum(2 * k + 1 for k in range(n))

    @eqx.filter_jit(donate="all")
    def step(buffer, key):
        return buffer, buffer.sample(key, 64)

    for seed in range(3):
        key = jax.random.key(seed)
        buffer, batch = step(buffer, key)
        want = single.sample(key, 64)
        assert np.asarray(batch["id"]).tolist() == np.asarray(want["id"]).tolist()
        assert np.array_equal(np.asarray(batch["obs"]), np.asarray(want["obs"]))

    @eqx.filter_jit
    def counts(buffer, key):
        keys = jax.random.split(key, 16)
        ids = jax.vmap(lambda k: buffer.sample(k, 4096)["id"])(keys).reshape(-1)
        return jnp.zeros(n * 1000, jnp.int32).at[ids].add(1)

    # What crosses devices: nothing on add; on sample, two all-reduces (a size per shard, and
    # the batch's bits), every step. The buffer is updated in place under donation.
    from .hlo import aliased_parameters, collectives

    rows = buffer.rows(_local(np, buffer, items))

    def compiled(fn, *args):
        return jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()

    add_hlo = compiled(lambda b, x: b.add_batch(x), buffer, rows)
    assert collectives(add_hlo) == []
    leaves = len(jax.tree.leaves(buffer))
    assert set(range(leaves)) <= aliased_parameters(add_hlo)
    sample_hlo = compiled(lambda b, k: (b, b.sample(k, 64)), buffer, jax.random.key(0))
    found = [(c.op, c.shapes) for c in collectives(sample_hlo) if c.every_step]
    print(f"sample's collectives: {found}", flush=True)
    # A size per shard (one word each), and the batch (a row of words per item), each as one
    # all-reduce of 32-bit words.
    words = [f"u32[{n}]", f"u32[64,{ITEM_SHAPE[0] + 1}]"]
    assert sorted(found) == sorted(("all-reduce", (w,)) for w in words), found

    c = np.asarray(counts(buffer, jax.random.key(7)))
    p = np.zeros(n * 1000)
    p[np.asarray(items["id"])[mask]] = 1 / mask.sum()
    assert _chi_square_p(np, c, p) > P_MIN


@check
def prioritised(out: Path) -> None:
    """Priorities per item, shards unequally full: the global sample equals a single
    replay's (integer masses, so the sums are exact); chi-square against p / Σp; a
    priority update goes to the owning shard, and a stale one is dropped."""
    dx, eqx, jax, jnp, np = _setup()
    make = lambda: dx.PrioritisedReplay(_item(), 8, priority_exponent=1.0)  # noqa: E731
    buffer = dx.GlobalReplay(_mesh(), make)
    n = buffer.num_shards
    items, mask = _replay_rows(np, n, 8, lambda k: k + 2)
    priorities = (np.arange(8 * n) % 5 + 1).astype(np.float32)
    local = lambda x: buffer.rows(_local(np, buffer, x))  # noqa: E731
    buffer = buffer.add_batch(local(items), local(priorities), mask=local(mask))
    single = dx.PrioritisedReplay(_item(), 8 * n, priority_exponent=1.0)
    single = single.add_batch(items, priorities, mask=mask)
    key = jax.random.key(3)
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 256))(buffer, key)
    want = single.sample(key, 256)
    assert np.asarray(sample.items["id"]).tolist() == np.asarray(want.items["id"]).tolist()
    np.testing.assert_allclose(sample.probabilities, want.probabilities, rtol=1e-6)
    ids = np.asarray(sample.items["id"])
    assert (np.asarray(sample.indices) == (ids // 1000) * 8 + ids % 1000).all()

    p = np.zeros(n * 1000)
    p[np.asarray(items["id"])[mask]] = priorities[mask].astype(np.float64)
    big = eqx.filter_jit(lambda b, k: b.sample(k, 65536).items["id"])(buffer, jax.random.key(9))
    assert _chi_square_p(np, np.bincount(np.asarray(big), minlength=n * 1000), p) > P_MIN

    # Shard 0's first item sampled, then written over; its update is dropped, the others kept.
    first = int(np.flatnonzero(ids // 1000 == 0)[0])
    refill = np.zeros(8 * n, bool)
    refill[:8] = True  # shard 0 gets 8 new items: every slot of its 8 is written again
    buffer = buffer.add_batch(local(items), local(priorities), mask=local(refill))
    stale = np.asarray(buffer.stale(sample.indices, sample.generations))
    assert (stale == (np.asarray(sample.indices) < 8)).all() and stale[first]
    new = jnp.full(256, 9.0)
    buffer = buffer.set_priorities(sample.indices, new, generations=sample.generations)
    leaves = _whole(jax.vmap(lambda r: r.tree.leaves)(buffer.shards)).reshape(-1)
    touched = np.unique(np.asarray(sample.indices)[~stale])
    assert (leaves[touched] == 9.0).all()
    # Shard 0 held 2 items: the refill's 8 went to slots 2..7, then 0 and 1, and kept the
    # priorities they came with, not 9.
    assert (leaves[:8] == np.roll(priorities[:8], 2)).all()
    assert (_whole(buffer.shards.max_priority) == 9.0).all()


@check
def trajectory(out: Path) -> None:
    """Each process adds steps of its own envs, as an async actor does (a different subset of
    envs each time, global ids); the windows drawn are those of a single buffer of every env;
    stamps name global envs."""
    dx, eqx, jax, jnp, np = _setup()
    envs = 3
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), lambda: dx.TrajectoryBuffer(_item(), envs, 8))
    n = buffer.num_shards
    single = dx.TrajectoryBuffer(_item(), envs * n, 8)
    rng = np.random.default_rng(0)
    add = eqx.filter_jit(lambda b, x, e: b.add(x, e))
    for t in range(12):
        # Two envs per shard step this time: ids local to each shard, made global.
        chosen = np.stack([rng.choice(envs, 2, replace=False) + k * envs for k in range(n)])
        env_ids = chosen.reshape(-1).astype(np.int32)
        steps = {
            "obs": np.full((2 * n, 3), t, np.float32),
            "id": (env_ids * 100 + t).astype(np.int32),
        }
        buffer = add(
            buffer, buffer.rows(_local(np, buffer, steps)), buffer.rows(_local(np, buffer, env_ids))
        )
        single = add(single, steps, env_ids)
    window = dx.Window(2, burn_in=1, period=2)
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 32, window, distribution_power=0.5))
    got = want = None
    for seed in range(2):
        key = jax.random.key(seed)
        got, want = sample(buffer, key), sample(single, key)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert want is not None
    env, start = want.env, want.start
    assert np.array_equal(
        np.asarray(buffer.stale(env, start)), np.asarray(single.stale(env, start))
    )

    # A process adding to envs it does not own: block k names an env of shard k + 1.
    wrong = ((np.arange(n) + 1) % n * envs).astype(np.int32)
    steps = {"obs": np.zeros((n, 3), np.float32), "id": np.zeros(n, np.int32)}
    try:
        # Under `eqx.filter_jit` (as eagerly and under `jax.jit`, a failed check raises when
        # the result is waited for, here as `EquinoxRuntimeError`).
        jax.block_until_ready(
            add(
                buffer,
                buffer.rows(_local(np, buffer, steps)),
                buffer.rows(_local(np, buffer, wrong)),
            )
        )
    except eqx.EquinoxRuntimeError as e:
        assert "a process adds only to its own envs" in str(e)
    else:
        raise AssertionError("adding to another shard's envs did not raise")


@check
def prioritised_trajectory(out: Path) -> None:
    """Windows by priority over every shard: the sample equals a single buffer's; weights
    from the global number of windows; updates go to the shard of the env."""
    dx, eqx, jax, jnp, np = _setup()
    envs, window = 2, dx.Window(2, strict=True, period=2)
    make = lambda: dx.PrioritisedTrajectoryBuffer(  # noqa: E731
        _item(), envs, 8, window, priority_exponent=1.0
    )
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), make)
    n = buffer.num_shards
    single = dx.PrioritisedTrajectoryBuffer(_item(), envs * n, 8, window, priority_exponent=1.0)
    add = eqx.filter_jit(lambda b, x: b.add(x))
    for t in range(7):
        steps = {
            "obs": np.full((envs * n, 3), t, np.float32),
            "id": (np.arange(envs * n) * 100 + t).astype(np.int32),
        }
        buffer = add(buffer, buffer.rows(_local(np, buffer, steps)))
        single = add(single, steps)
    windows = int(jnp.sum(jax.vmap(lambda b: b.num_windows)(buffer.shards)))
    assert windows == int(single.num_windows)
    key = jax.random.key(5)
    sample = eqx.filter_jit(lambda b, k, n: b.sample(k, n, beta=0.5))
    got, want = sample(buffer, key, 16), sample(single, key, 16)
    assert np.array_equal(np.asarray(got.sample.env), np.asarray(want.sample.env))
    assert np.array_equal(np.asarray(got.sample.start), np.asarray(want.sample.start))
    assert np.array_equal(np.asarray(got.indices), np.asarray(want.indices))
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-6)
    priorities = jnp.arange(16, dtype=jnp.float32) % 4 + 1
    update = eqx.filter_jit(lambda b, s, p: b.set_priorities(s.env, s.start, p))
    buffer, single = update(buffer, got.sample, priorities), update(single, want.sample, priorities)
    leaves = _whole(jax.vmap(lambda b: b.tree.leaves)(buffer.shards)).reshape(-1)
    assert np.array_equal(leaves, np.asarray(single.tree.leaves))
    key = jax.random.key(6)
    got, want = sample(buffer, key, 16), sample(single, key, 16)
    assert np.array_equal(np.asarray(got.indices), np.asarray(want.indices))


@check
def queue_and_clustered(out: Path) -> None:
    """A queue pops every env's oldest steps on its own device; a clustered replay draws the
    cluster by the global cluster sizes (chi-square)."""
    dx, eqx, jax, jnp, np = _setup()
    queue = dx.GlobalTrajectoryBuffer(_mesh(), lambda: dx.TrajectoryQueue(_item(), 2, 8))
    n = queue.num_shards
    steps = {
        "obs": np.ones((2 * n, 5, 3), np.float32),
        "id": (np.arange(2 * n)[:, None] * 100 + np.arange(5)).astype(np.int32),
    }
    queue = queue.extend(queue.rows(_local(np, queue, steps)))
    popped, queue = queue.pop(3)
    for shard in popped["id"].addressable_shards:
        rows = shard.index[0]
        assert np.array_equal(np.asarray(shard.data), steps["id"][rows, :3])
    assert not bool(queue.can_pop(3)) and bool(queue.can_pop(2))

    odd = lambda item: item["id"] % 2  # noqa: E731
    replay = dx.GlobalReplay(
        _mesh(), lambda: dx.ClusteredReplay(dx.UniformReplay(_item(), 8), 2, odd)
    )
    items, mask = _replay_rows(np, n, 8, lambda k: k + 2)
    local = lambda x: replay.rows(_local(np, replay, x))  # noqa: E731
    replay = replay.add_batch(local(items), mask=local(mask))
    drawn = eqx.filter_jit(lambda b, k: b.sample(k, 65536)["id"])(replay, jax.random.key(4))
    ids = np.asarray(items["id"])[mask]
    p = np.zeros(n * 1000)
    for c in (0, 1):  # distribution_power 0: each non-empty cluster 1/2, uniform within
        members = ids[ids % 2 == c]
        p[members] = 0.5 / len(members)
    assert _chi_square_p(np, np.bincount(np.asarray(drawn), minlength=n * 1000), p) > P_MIN


@check
def errors(out: Path) -> None:
    """Mistakes of layout are refused at once; an empty global buffer, and a bad index,
    raise in every process."""
    dx, eqx, jax, jnp, np = _setup()
    replay = dx.GlobalReplay(_mesh(), lambda: dx.UniformReplay(_item(), 4))
    n, local = replay.num_shards, replay.num_local_shards
    refused = {
        "does not divide": lambda: replay.add_batch(
            {"obs": np.zeros((n + 1, 3), np.float32), "id": np.zeros(n + 1, np.int32)}
        ),
        f"holds {local} shards": lambda: replay.rows({"id": np.zeros(local + 1, np.int32)}),
        "a shard must be a Replay": lambda: dx.GlobalReplay(
            _mesh(), lambda: dx.TrajectoryBuffer(_item(), 2, 4)
        ),
        f"do not divide {10 * n + 1}": lambda: dx.GlobalReplay.shard_size(_mesh(), 10 * n + 1),
        "the mesh has axes": lambda: dx.GlobalReplay(
            _mesh(), lambda: dx.UniformReplay(_item(), 4), axis="envs"
        ),
    }
    for words, call in refused.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            assert words in str(e), (words, e)
        else:
            raise AssertionError(f"not refused: {words}")
    buffer = dx.GlobalReplay(_mesh(), lambda: dx.PrioritisedReplay(_item(), 4))
    # An empty buffer: nothing to draw, and no stored slot to set (the single replay's
    # messages, under the global call's name).
    for words, bad in (
        ("`GlobalReplay.sample`", lambda b: b.sample(jax.random.key(0), 4)),
        (
            "`GlobalReplay.set_priorities`: index out of range",
            lambda b: b.set_priorities(jnp.array([0]), jnp.array([1.0])),
        ),
    ):
        try:
            jax.block_until_ready(eqx.filter_jit(bad)(buffer))
        except eqx.EquinoxRuntimeError as e:
            assert words in str(e), e
            assert "empty" in str(e) or "no stored item" in str(e) or "a stored slot" in str(e), e
        else:
            raise AssertionError("no error")


def _raises_everywhere(eqx, jax, call, words: str) -> None:
    """`call()` raises `words` in this process; every process runs it, and each must raise
    (none may wait in a collective for another), then the next check proceeds in step."""
    try:
        jax.block_until_ready(call())
    except (eqx.EquinoxRuntimeError, ValueError, TypeError) as e:
        assert words in str(e), (words, str(e)[:500])
    else:
        raise AssertionError(f"no error: {words}")


@check
def faults_raise_in_every_process(out: Path) -> None:
    """A bad index or env id of a routed call (`set_priorities`, `stale`, `read`, `peek`)
    raises in every process, eagerly and under `jit`, and the processes go on in step: no
    process waits in a collective for one that raised. An int64 name is checked in its own
    dtype, never wrapped into range."""
    dx, eqx, jax, jnp, np = _setup()
    replay = dx.GlobalReplay(_mesh(), lambda: dx.PrioritisedReplay(_item(), 4))
    n = replay.num_shards
    items, mask = _replay_rows(np, n, 4, lambda k: 2)
    local = lambda x: replay.rows(_local(np, replay, x))  # noqa: E731
    replay = replay.add_batch(local(items), mask=local(mask))
    one = jnp.ones(1)
    names = "an index names no item of any shard"
    stored = "index out of range"
    for index, words in [
        (np.array([4 * n]), names),  # past the end
        (np.array([-1]), names),  # negative
        (np.array([2**32 + 1], np.int64), names),  # would wrap to 1
        (np.array([3]), stored),  # shard 0's slot 3: not stored
    ]:
        _raises_everywhere(eqx, jax, lambda: replay.set_priorities(index, one), words)
        jitted = eqx.filter_jit(lambda r, i: r.set_priorities(i, one))
        if index.dtype != np.int64:
            _raises_everywhere(eqx, jax, lambda: jitted(replay, jnp.asarray(index)), words)
    generations = np.zeros(1, np.uint32)
    _raises_everywhere(eqx, jax, lambda: replay.stale(np.array([4 * n]), generations), names)
    clustered = dx.GlobalReplay(
        _mesh(), lambda: dx.ClusteredReplay(dx.PrioritisedReplay(_item(), 4), 2, _odd)
    )
    pair = (np.array([0]), np.array([4 * n]))
    _raises_everywhere(eqx, jax, lambda: clustered.set_priorities(pair, one), names)
    window = dx.Window(1, strict=True)
    windows = dx.GlobalTrajectoryBuffer(
        _mesh(), lambda: dx.PrioritisedTrajectoryBuffer(_item(), 2, 4, window)
    )
    for t in range(3):
        steps = {"obs": np.zeros((2 * n, 3), np.float32), "id": np.zeros(2 * n, np.int32)}
        windows = windows.add(windows.rows(_local(np, windows, steps)))
    bad_env = np.array([2 * n])
    for call in [
        lambda: windows.set_priorities(bad_env, np.array([0]), one),
        lambda: windows.stale(bad_env, np.array([0])),
        lambda: windows.peek(bad_env),
    ]:
        _raises_everywhere(eqx, jax, call, "an env id is outside [0, num_envs)")
    _raises_everywhere(
        eqx,
        jax,
        lambda: windows.set_priorities(np.array([0]), np.array([7]), one),
        "a start is not a step of its env",
    )
    # In step afterwards: a collective of every process still meets.
    assert int(jax.block_until_ready(replay.sample(jax.random.key(0), 4).indices).shape[0]) == 4


def _odd(item):
    return item["id"] % 2


@check
def every_sampling_option_globally(out: Path) -> None:
    """Windows with every option (`done`, episode ends, period, burn-in) from both sources
    and by policy age in one batch, and n-step transitions: each the draw of one buffer of
    every env."""
    dx, eqx, jax, jnp, np = _setup()
    step = {
        **_item(),
        "r": jnp.zeros(()),
        "done": jnp.zeros((), bool),
        "v": jnp.zeros((), jnp.int32),
    }
    make = lambda: dx.TrajectoryBuffer(step, 2, 16)  # noqa: E731
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), make)
    n = buffer.num_shards
    single = dx.TrajectoryBuffer(step, 2 * n, 16)
    for t in range(11):
        steps = {
            "obs": np.full((2 * n, 3), t, np.float32),
            "id": (np.arange(2 * n) * 100 + t).astype(np.int32),
            "r": np.ones(2 * n, np.float32),
            "done": (np.arange(2 * n) + t) % 4 == 3,
            "v": np.full(2 * n, t, np.int32),
        }
        buffer = buffer.add(buffer.rows(_local(np, buffer, steps)))
        single = single.add(steps)
        if t == 6:
            buffer, single = (
                buffer.with_streams(buffer.streams),
                single.with_streams(single.streams),
            )
    window = dx.Window(3, burn_in=1, period=2, done="done", episode_ends="within")
    nstep = dx.NStep(2, reward="r", terminated="done")
    version = lambda item: item["v"]  # noqa: E731
    age = dx.PolicyAge(version, 10, max_age=4)
    # Every option of the law in one draw here (tests/test_global.py has each alone, on the
    # devices of one process).
    asks = {
        "windows, both sources, aged": lambda b, k: b.sample(
            k, 16, window, source={"replay": 10, "online": 6}, age=age
        ),
        "transitions": lambda b, k: b.sample(k, 16, nstep, discount=0.9),
    }
    for name, ask in asks.items():
        key = jax.random.key(7)
        got, want = eqx.filter_jit(ask)(buffer, key), eqx.filter_jit(ask)(single, key)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    # The stamps read back on the shard of their env.
    sample = buffer.sample(jax.random.key(8), 16, window)
    again = buffer.read(sample.env, sample.start, window)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(sample)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@check
def bad_inputs_as_the_single_buffer(out: Path) -> None:
    """A bad input to a global buffer gets the error the single buffer gives: nothing is cast
    or wrapped on its way into a compiled call."""
    dx, eqx, jax, jnp, np = _setup()
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), lambda: dx.TrajectoryBuffer(_item(), 2, 8))
    single = dx.TrajectoryBuffer(_item(), 2 * buffer.num_shards, 8)
    n = buffer.num_shards
    wide = {"obs": np.zeros((2 * n, 3), np.float64), "id": np.zeros(2 * n, np.int32)}
    for b in (buffer, single):
        try:
            b.add(wide)
        except TypeError as e:
            assert "has dtype float64, expected float32" in str(e)
        else:
            raise AssertionError("float64 items were cast")
    try:
        buffer.rows(_local(np, buffer, wide))
    except TypeError as e:
        assert "which JAX holds as float32" in str(e)
    else:
        raise AssertionError("rows() cast float64")
    # env ids past int32, given on the host: refused in their own dtype.
    ids = (np.arange(n) * 2 + 2**32).astype(np.int64)
    steps = {"obs": np.zeros((n, 3), np.float32), "id": np.zeros(n, np.int32)}
    for b in (buffer, single):
        _raises_everywhere(eqx, jax, lambda: b.add(steps, ids), "env id")
    priorities = dx.GlobalReplay(_mesh(), lambda: dx.PrioritisedReplay(_item(), 4))
    items, mask = _replay_rows(np, n, 4, lambda k: 4)
    priorities = priorities.add_batch(priorities.rows(_local(np, priorities, items)))
    big = np.array([2**32], np.int64)  # a priority, not wrapped to 0
    priorities = priorities.set_priorities(np.array([0]), big)
    assert float(_whole(priorities.shards.max_priority)[0]) == float(np.float32(2**32))


@check
def rate_limited_global(out: Path) -> None:
    """`RateLimited(GlobalReplay(...))` across processes: each shard counts its own block of
    every insert, every sample folds the counts in with one all-reduce; the counts are the
    global ones, the same in every process, and the law holds over them."""
    dx, eqx, jax, jnp, np = _setup()
    buffer = dx.GlobalReplay(_mesh(), lambda: dx.UniformReplay(_item(), 64))
    n = buffer.num_shards
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 4 * n, 8 * n, insert_batch_size=4 * n, sample_batch_size=8
    )
    limited = dx.RateLimited(buffer, limiter)
    assert isinstance(limited, dx.AbstractReplay) and limited.num_shards == n
    items, _ = _replay_rows(np, n, 4, lambda k: 4)
    rows = buffer.rows(_local(np, buffer, items))
    add = eqx.filter_jit(lambda r, x: r.add_batch(x))
    sample = eqx.filter_jit(lambda r, k: r.sample(k, 8))
    inserted = sampled = 0
    for step in range(6):
        if bool(limited.can_insert(4 * n)):
            limited = add(limited, rows)
            inserted += 4 * n
        while bool(limited.can_sample(8)):
            limited, batch = sample(limited, jax.random.key(step))
            sampled += 8
        assert limited.counts() == (inserted, sampled)
        rate = limiter.rate
        assert rate.balance(inserted, sampled) <= rate.scaled_max
        assert (
            inserted < rate.min_size_to_sample or rate.balance(inserted, sampled) >= rate.scaled_min
        )
    assert sampled > 0


@check
def service_across_processes(out: Path) -> None:
    """A `ReplayService` in every process over one rate-limited global replay: each process
    counts only its own rows (a mask's `True`s among them), the learners' exchange adds every
    process's counts to the global ones, and the law judges a sample by them."""
    dx, eqx, jax, jnp, np = _setup()
    buffer = dx.GlobalReplay(_mesh(), lambda: dx.UniformReplay(_item(), 64))
    n, local = buffer.num_shards, buffer.num_local_shards
    processes = jax.process_count()
    per_process = 2 * local  # rows per process per insert: 2 per local shard
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        1, 4 * n, 8 * n, insert_batch_size=per_process * processes, sample_batch_size=4
    )
    service = dx.ReplayService(dx.RateLimited(buffer, limiter), donate=False)
    items, _ = _replay_rows(np, n, 2, lambda k: 2)
    rows = buffer.rows(_local(np, buffer, items))
    for r in range(1, 4):
        service.add_batch(rows)
        # Before an exchange, a process knows its own inserts only.
        assert service.counts()[0] == (r - 1) * per_process * processes + per_process, r
        assert service.snapshot().counts() == (r * per_process * processes, 0), r
    mask = buffer.rows(np.arange(per_process) % 2 == 0)  # half of this process's rows
    service.add_batch(rows, mask=mask)
    inserts = 3 * per_process * processes + per_process // 2 * processes
    assert service.snapshot().counts() == (inserts, 0)
    try:  # a host mask cannot say which rows are this process's
        service.add_batch(rows, mask=np.ones(per_process * processes, bool))
    except TypeError as e:
        assert "give the mask as the items are given" in str(e), e
    else:
        raise AssertionError("a host mask was counted")
    with service.learner():
        batch = service.sample(jax.random.key(0), 4)  # every process, in step
    assert service.counts() == (inserts, 4)
    assert jax.tree.leaves(batch)[0].shape[0] == 4
    service.close()


@check
def datasets_refuse_another_shard_count(out: Path) -> None:
    """`load_datasets` of the datasets of another number of shards, and `write_datasets` into
    them, refuse before they read or write anything."""
    dx, eqx, jax, jnp, np = _setup()
    root = out / "datasets-wrong-count"
    shards = jax.device_count()
    if jax.process_index() == 0:
        for k in range(shards + 2):  # more shards than this mesh has
            dx.Dataset.create(root / f"shard-{k:05d}", _item(), 2).close()
    jax.experimental.multihost_utils.sync_global_devices("datasets made")
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), _dataset_shard)
    for call, words in [
        (
            lambda: dx.GlobalTrajectoryBuffer.load_datasets(root, _mesh(), _dataset_shard),
            "Nothing was read",
        ),
        (lambda: buffer.write_datasets(root), "Nothing was written"),
    ]:
        try:
            call()
        except ValueError as e:
            assert words in str(e) and "another number of shards" in str(e), e
        else:
            raise AssertionError(words)
    for k in range(shards + 2):  # untouched: still empty
        assert (root / f"shard-{k:05d}" / "manifest.json").exists()


# Checkpoints: saved with orbax by one topology, restored by the other.


def _checkpointed():
    """Two buffers whose contents are a function of the global shard alone (items,
    priorities, generations and counters; windows, their stamps and priorities): for each, its
    class and how to make one shard."""
    dx, eqx, jax, jnp, np = _setup()
    mesh = _mesh()
    window = dx.Window(2, strict=True)
    makers = {
        "prioritised": (dx.GlobalReplay, lambda: dx.PrioritisedReplay(_item(), 8)),
        "windows": (
            dx.GlobalTrajectoryBuffer,
            lambda: dx.PrioritisedTrajectoryBuffer(_item(), 2, 8, window),
        ),
    }
    return mesh, makers


def _fill(name, buffer):
    dx, eqx, jax, jnp, np = _setup()
    n = buffer.num_shards
    local = lambda x: buffer.rows(_local(np, buffer, x))  # noqa: E731
    if name == "windows":
        for t in range(5):
            steps = {
                "obs": np.full((2 * n, 3), t, np.float32),
                "id": (np.arange(2 * n) * 10 + t).astype(np.int32),
            }
            buffer = buffer.add(local(steps))
        sample = buffer.sample(jax.random.key(0), 8)
        return buffer.set_priorities(sample.sample.env, sample.sample.start, jnp.arange(8.0))
    items, mask = _replay_rows(np, n, 8, lambda k: k + 3)
    buffer = buffer.add_batch(local(items), mask=local(mask))
    if name == "prioritised":
        sample = buffer.sample(jax.random.key(1), 8)
        buffer = buffer.set_priorities(sample.indices, jnp.arange(8.0) + 0.5)
    return buffer


def _fingerprint(tree):
    """Every array leaf of a global buffer (its shards) or of a part of its shards, whole."""
    import dejax_eqx as dx
    import jax

    if isinstance(tree, dx.AbstractGlobalBuffer):
        tree = tree.shards
    return [_whole(x) for x in jax.tree.leaves(tree)]


@check
def save(out: Path) -> None:
    dx, eqx, jax, jnp, np = _setup()
    import orbax.checkpoint as ocp

    mesh, makers = _checkpointed()
    tag = f"{jax.process_count()}p"
    checkpointer = ocp.StandardCheckpointer()
    for name, (kind, make) in makers.items():
        buffer = _fill(name, kind(mesh, make))
        checkpointer.save((out / f"{name}-{tag}").absolute(), buffer)
        if jax.process_index() == 0:
            np.savez(out / f"{name}-{tag}.npz", *_fingerprint(buffer))
        else:
            _fingerprint(buffer)
    checkpointer.wait_until_finished()


@check
def datasets(out: Path) -> None:
    """Each process writes its own shards of a trajectory buffer to `dx.Dataset`s, twice; the
    other topology loads them (`restore`)."""
    dx, eqx, jax, jnp, np = _setup()
    buffer = dx.GlobalTrajectoryBuffer(_mesh(), _dataset_shard)
    n = buffer.num_shards
    written = 0
    for t in range(9):
        steps = {
            "obs": np.full((2 * n, 3), t, np.float32),
            "id": (np.arange(2 * n) * 100 + t).astype(np.int32),
        }
        buffer = buffer.add(buffer.rows(_local(np, buffer, steps)))
        if t in (4, 8):
            written += buffer.write_datasets(out / f"datasets-{jax.process_count()}p")
    assert written == 9 * 2 * buffer.num_local_shards
    # Adds have no collective: a process may reach its load while another still writes.
    jax.experimental.multihost_utils.sync_global_devices("datasets written")
    loaded = dx.GlobalTrajectoryBuffer.load_datasets(
        out / f"datasets-{jax.process_count()}p", _mesh(), _dataset_shard
    )
    # The steps and step counts come back; the online queue starts empty (`with_streams`).
    for a, b in zip(_fingerprint(loaded.shards.streams), _fingerprint(buffer.shards.streams)):
        assert a.tobytes() == b.tobytes()


def _dataset_shard():
    import dejax_eqx as dx

    return dx.TrajectoryBuffer(_item(), 2, 6)


@check
def restore(out: Path) -> None:
    """Restores what the other topology saved: every leaf of every shard bit for bit."""
    dx, eqx, jax, jnp, np = _setup()
    import orbax.checkpoint as ocp

    mesh, makers = _checkpointed()
    other = "2p" if jax.process_count() == 1 else "1p"
    checkpointer = ocp.StandardCheckpointer()
    for name, (kind, make) in makers.items():
        target = kind.abstract(mesh, make)
        restored = checkpointer.restore((out / f"{name}-{other}").absolute(), target)
        assert isinstance(restored, kind)
        want = np.load(out / f"{name}-{other}.npz")
        got = _fingerprint(restored)
        assert len(got) == len(want.files)
        for i, leaf in enumerate(got):
            assert leaf.dtype == want[f"arr_{i}"].dtype
            assert leaf.tobytes() == want[f"arr_{i}"].tobytes(), (name, i)
        # The restored buffer works: it samples.
        jax.block_until_ready(restored.sample(jax.random.key(0), 4))
    # The datasets the other topology's processes wrote, one per shard.
    loaded = dx.GlobalTrajectoryBuffer.load_datasets(
        out / f"datasets-{other}", mesh, _dataset_shard
    )
    assert _whole(loaded.shards.step_count).tolist() == [[9, 9]] * loaded.num_shards
    ids = _whole(loaded.shards.data["id"])  # (shards, envs, max_length): the newest 6 steps
    envs = np.arange(2 * loaded.num_shards).reshape(-1, 2)
    head = 9 % 6  # the ring's next slot: the oldest of the 6 kept steps
    want = envs[..., None] * 100 + np.roll(np.arange(3, 9), head)
    assert np.array_equal(ids, want)


if __name__ == "__main__":
    main()
