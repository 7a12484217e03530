"""`dx.Mixture`: exact counts, each part's law (chi-square against NumPy models), exact
importance weights, the layers (rate-limited, global), faults.

Every chi-square test uses fixed keys and fails a correct sampler with probability 1e-6
(`assert_frequencies`); a test of several parts checks each part once, so its false-failure
rate is at most 2e-6... and is stated where it is so.
"""

import functools
import itertools
import math
from fractions import Fraction
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx._mixture import static_counts, traced_counts
from hypothesis import given, strategies as st

from .helpers import assert_frequencies, SLOW


STEP = {
    "obs": jnp.zeros(2, jnp.float32),
    "reward": jnp.zeros((), jnp.float32),
    "done": jnp.zeros((), jnp.bool_),
    "version": jnp.zeros((), jnp.int32),
}
NUM_ENVS, MAX_LENGTH = 3, 8
WINDOW = dx.Window(2, strict=True)


def _version(step):
    return step["version"]


AGE = dx.PolicyAge(_version, current=13, max_age=6, decay="inverse")
ALPHA, BETA = 1.0, 0.6


def _steps(env_ids, t):
    n = len(env_ids)
    return {
        "obs": np.stack([np.asarray(env_ids), np.full(n, t)], 1).astype(np.float32),
        "reward": np.ones(n, np.float32),
        "done": np.zeros(n, bool),
        "version": np.full(n, t, np.int32),
    }


def _filled(buf, seed):
    """`buf` after 14 calls that add to random subsets of envs (so envs differ in length,
    and some wrap), the online queue reset after the 9th."""
    rng = np.random.default_rng(seed)
    for t in range(14):
        env_ids = np.flatnonzero(rng.random(NUM_ENVS) < 0.75).astype(np.int32)
        if t < 2:
            env_ids = np.arange(NUM_ENVS, dtype=np.int32)
        if len(env_ids):
            buf = buf.add(_steps(env_ids, t), env_ids=env_ids)
        if t == 8 and hasattr(buf, "reset_online_queue"):
            buf = buf.reset_online_queue()
    return buf


@functools.cache
def _plain(seed=0):
    return _filled(dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH), seed)


@functools.cache
def _prioritised(seed=2):
    buf = dx.PrioritisedTrajectoryBuffer(
        STEP, NUM_ENVS, MAX_LENGTH, window=WINDOW, priority_exponent=ALPHA
    )
    buf = _filled(buf, seed)
    # Priorities 1..4 by (env, start), set through the stamps of every stored window.
    envs, starts = _windows(buf, "replay")
    priorities = 1.0 + (envs * 7 + starts) % 4
    return buf.set_priorities(envs, starts, priorities.astype(np.float32))


def _windows(buf, source):
    """Every (env, start) of a strict window of 2 in `source` of a filled buffer."""
    counts = np.asarray(buf.step_count)
    lengths = np.asarray(buf.streams.lengths if source == "replay" else buf.online_length)
    envs, starts = [], []
    for e in range(NUM_ENVS):
        for s in range(counts[e] - lengths[e], counts[e] - 1):
            envs.append(e)
            starts.append(s)
    return np.asarray(envs, np.int32), np.asarray(starts, np.int32)


# --- each kind of part: its buffer, its Part, and its law as a NumPy model -------------------


def _kind(kind) -> tuple[Any, dict[str, Any], Any]:
    """`(buffer, part options, model)`: `model(buffer)` gives every (env, start) the part can
    draw and its probability."""
    if kind in ("replay", "online"):

        def uniform(buf):
            envs, starts = _windows(buf, kind)
            return envs, starts, np.full(len(envs), 1 / len(envs))

        source = None if kind == "replay" else "online"
        return _plain(), dict(what=WINDOW, source=source), uniform
    if kind == "prioritised":

        def by_priority(buf):
            envs, starts = _windows(buf, "replay")
            mass = (1.0 + (envs * 7 + starts) % 4) ** ALPHA
            return envs, starts, mass / mass.sum()

        return _prioritised(), dict(beta=BETA), by_priority
    if kind == "aged":  # recent data: young windows, by 1 / (age + 1)

        def by_age(buf):
            envs, starts = _windows(buf, "replay")
            # A window is as old as its first step; a step's version is the call that added it.
            version = np.asarray(buf.streams.data["version"])[envs, starts % MAX_LENGTH]
            age = 13 - version  # AGE.current
            weight = np.where(age <= 6, 1.0 / (age + 1), 0.0)
            return envs, starts, weight / weight.sum()

        return _plain(seed=1), dict(what=WINDOW, age=AGE), by_age
    raise AssertionError(kind)


def _cells(model, buf):
    envs, starts, p = model(buf)
    return {(int(e), int(s)): i for i, (e, s) in enumerate(zip(envs, starts))}, p


def _draws(mixture, buffers, fractions, batch, rounds, key=jax.random.key(0)):
    """`rounds` batches, each from its own key, the fractions traced if they are arrays."""

    @eqx.filter_jit
    def run(buffers, fractions, keys):
        def one(_, key):
            return None, mixture.sample(key, batch, buffers, fractions)[1]

        return jax.lax.scan(one, None, keys)[1]

    return run(buffers, fractions, jax.random.split(key, rounds))


KINDS = ["replay", "online", "prioritised", "aged"]
PAIRS = list(itertools.combinations(KINDS, 2))
QUICK_PAIRS = {("online", "prioritised")}


@pytest.mark.parametrize(
    "pair",
    [pytest.param(p, marks=() if p in QUICK_PAIRS else SLOW, id="+".join(p)) for p in PAIRS],
)
def test_each_part_draws_by_its_law_with_traced_fractions(pair):
    # Two parts of two kinds, the fraction traced (so each part keeps a traced number of the
    # rows it draws): exact counts in every batch, and each part's rows by its own law
    # (chi-square against a NumPy model per part; false-failure rate <= 2e-6). Replay and
    # online share one buffer (two parts naming one buffer).
    a, b = pair
    (buf_a, opts_a, model_a), (buf_b, opts_b, model_b) = _kind(a), _kind(b)
    names = {a: "x", b: "x" if {a, b} == {"replay", "online"} else "y"}
    if names[b] == "x":
        buf_b = buf_a
    buffers = {"x": buf_a} | ({"y": buf_b} if names[b] == "y" else {})
    mixture = dx.Mixture({a: dx.Part(names[a], **opts_a), b: dx.Part(names[b], **opts_b)})
    fraction = jnp.float32(0.375)
    out = _draws(mixture, buffers, {a: fraction, b: 1 - fraction}, 16, 500)
    source = np.asarray(out.source)
    assert (np.asarray(out.counts) == [6, 10]).all()
    assert (source == np.repeat([0, 1], [6, 10])).all()
    env, start = np.asarray(out.sample.env), np.asarray(out.sample.start)
    for i, (buf, model) in enumerate([(buf_a, model_a), (buf_b, model_b)]):
        cells, p = _cells(model, buf)
        got = np.zeros(len(p))
        for e, s in zip(env[source == i], start[source == i]):
            assert (int(e), int(s)) in cells, f"part {pair[i]} drew a window it cannot: {e, s}"
            got[cells[int(e), int(s)]] += 1
        assert_frequencies(got, p)


def test_static_fractions_draw_exactly_their_rows():
    # Python fractions: static counts, each part sampled for exactly its rows, the same law.
    buf, opts, model = _kind("prioritised")
    off, _, off_model = _kind("replay")
    mixture = dx.Mixture({"offline": dx.Part("off", WINDOW), "per": dx.Part("p", **opts)})
    out = _draws(mixture, {"off": off, "p": buf}, {"offline": 0.25, "per": 0.75}, 12, 600)
    assert (np.asarray(out.source) == np.repeat([0, 1], [3, 9])).all()
    env, start, source = (np.asarray(x) for x in (out.sample.env, out.sample.start, out.source))
    for i, (b, m) in enumerate([(off, off_model), (buf, model)]):
        cells, p = _cells(m, b)
        got = np.bincount(
            [cells[int(e), int(s)] for e, s in zip(env[source == i], start[source == i])],
            minlength=len(p),
        )
        assert_frequencies(got, p)  # false-failure rate 2e-6 for the test


def test_weights_are_those_of_the_part_alone():
    # A prioritised part's weights are normalised over its own kept rows, as a sample of that
    # many rows alone would be: with traced fractions it draws the whole batch and keeps a
    # part, and the rows it drops must not change the weights of those it keeps.
    buf, opts, model = _kind("prioritised")
    off = _plain()
    mixture = dx.Mixture({"offline": dx.Part("off", WINDOW), "per": dx.Part("p", **opts)})
    fraction = jnp.float32(0.75)  # 12 offline rows, 4 prioritised, of 16 drawn
    out = _draws(
        mixture, {"off": off, "p": buf}, {"offline": fraction, "per": 1 - fraction}, 16, 64
    )
    cells, p = _cells(model, buf)
    number = len(p)
    w = np.asarray(out.weights)
    for k in range(w.shape[0]):
        mine = np.asarray(out.source[k]) == 1
        rows = [
            cells[int(e), int(s)]
            for e, s in zip(out.sample.env[k][mine], out.sample.start[k][mine])
        ]
        want = (number * p[rows]) ** -BETA
        np.testing.assert_allclose(w[k][mine], want / want.max(), rtol=2e-6)
        assert (w[k][~mine] == 1).all()


def _model_counts(fractions, batch):
    """The counts in exact arithmetic: c_i = floor(B * (f_0 + ... + f_{i-1}) + 1/2)."""
    running, ends = Fraction(0), [0]
    for f in fractions[:-1]:
        running += Fraction(f)
        ends.append(math.floor(batch * running + Fraction(1, 2)))
    ends.append(batch)
    return [ends[i + 1] - ends[i] for i in range(len(fractions))]


_traced_counts = jax.jit(lambda f, b: traced_counts(list(f), b, "")[0], static_argnums=1)


# A few batch sizes: each is a compilation of the traced counts (with each number of parts).
BATCHES = st.sampled_from([1, 2, 7, 64, 255, 256, 1000, 4096])


@given(parts=st.integers(1, 5), batch=BATCHES, data=st.data())
def test_counts_are_the_rounded_cumulative_shares(parts, batch, data):
    # Static fractions in exact arithmetic, and traced ones (dyadic here, multiples of 1/64, so
    # that float32 is exact) give the model's counts: they add up to the batch, and each is
    # floor or ceil of f_i * B.
    cuts = sorted(data.draw(st.lists(st.integers(0, 64), min_size=parts - 1, max_size=parts - 1)))
    fractions = [u / 64 for u in np.diff([0, *cuts, 64]).tolist()]
    want = _model_counts(fractions, batch)
    assert sum(want) == batch
    for f, n in zip(fractions, want):
        assert math.floor(f * batch) <= n <= math.ceil(f * batch)
    names = [f"p{i}" for i in range(parts)]
    assert static_counts(fractions, batch, names, "") == want
    traced = _traced_counts(jnp.asarray(fractions, jnp.float32), batch)
    assert np.asarray(traced).tolist() == want


@given(parts=st.integers(2, 4), batch=BATCHES, data=st.data())
def test_counts_of_any_fractions_are_exact_or_within_float32(parts, batch, data):
    # Any fractions summing to 1: static counts follow the exact rule; traced ones (float32)
    # add up to the batch, are never negative, and each is within one row of f_i * B.
    raw = data.draw(st.lists(st.floats(0, 1), min_size=parts, max_size=parts))
    if sum(raw) == 0:
        raw[0] = 1.0
    fractions = [x / sum(raw) for x in raw]
    fractions[-1] = max(1.0 - sum(fractions[:-1]), 0.0)
    names = [f"p{i}" for i in range(parts)]
    counts = static_counts(fractions, batch, names, "")
    assert counts == _model_counts(
        [Fraction(f) / sum(map(Fraction, fractions)) for f in fractions], batch
    )
    traced = np.asarray(_traced_counts(jnp.asarray(fractions, jnp.float32), batch))
    assert traced.sum() == batch and (traced >= 0).all()
    assert (np.abs(traced - np.asarray(fractions) * batch) < 1 + 1e-3).all()


@SLOW
def test_a_mixture_gives_its_counts_in_order():
    # End to end, static and traced: the counts, and the rows of each part in the parts' order.
    buf = _plain()
    mixture = dx.Mixture({n: dx.Part("b", WINDOW) for n in ("a", "b", "c")})
    key = jax.random.key(1)
    fractions = [0.3, 0.3, 0.4]
    want = _model_counts(fractions, 19)
    _, static = mixture.sample(key, 19, {"b": buf}, fractions)
    traced = eqx.filter_jit(lambda f: mixture.sample(key, 19, {"b": buf}, f)[1])(
        jnp.asarray(fractions, jnp.float32)
    )
    for out in (static, traced):
        assert np.asarray(out.counts).tolist() == want == [6, 5, 8]
        assert np.asarray(out.source).tolist() == np.repeat([0, 1, 2], want).tolist()


@SLOW
def test_a_source_mapping_is_a_mixture_of_one_buffer():
    # `sample(..., source={"replay": r, "online": o})` draws the rows of the two-part mixture
    # of that buffer with static fractions r/B and o/B: the same rows, bit for bit.
    buf = _plain()
    key = jax.random.key(5)
    old = buf.sample(key, 8, WINDOW, source={"replay": 6, "online": 2})
    mixture = dx.Mixture(
        {"replay": dx.Part("b", WINDOW), "online": dx.Part("b", WINDOW, source="online")}
    )
    _, new = mixture.sample(key, 8, {"b": buf}, [0.75, 0.25])
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new.sample)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@SLOW
def test_a_rate_limited_part_counts_its_rows():
    # Through the rate-limited layer: the limiter counts the rows its part gave (traced),
    # and a part of 0 rows is no sample: not refused even before min_size_to_sample.
    def limited(calls):
        out = dx.RateLimited(
            dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH),
            dx.RateLimiter.min_size(12, sample_batch_size=16),
        )
        for t in range(calls):
            out = out.add(_steps(np.arange(NUM_ENVS), t))
        return out

    mixture = dx.Mixture({"offline": dx.Part("off", WINDOW), "online": dx.Part("on", WINDOW)})

    @eqx.filter_jit
    def run(buffers, f):
        return mixture.sample(jax.random.key(0), 16, buffers, jnp.stack([1 - f, f]))

    early = {"off": _plain(seed=3), "on": limited(2)}  # 6 of the 12 steps sampling waits for
    new, out = run(early, jnp.float32(0.0))  # allowed, as nothing is drawn
    assert new["on"].limiter.counts() == (6, 0)
    assert (np.asarray(out.source) == 0).all()
    with pytest.raises(eqx.EquinoxRuntimeError, match="rate limit does not allow"):
        run(early, jnp.float32(0.25))
    ready = {"off": _plain(seed=3), "on": limited(5)}
    new, out = run(ready, jnp.float32(0.25))
    assert new["on"].limiter.counts() == (15, 4)
    # Static fractions: counted as well, exactly; two parts of one buffer count both.
    new, _ = mixture.sample(jax.random.key(0), 16, ready, [0.5, 0.5])
    assert new["on"].limiter.counts() == (15, 8)
    both = dx.Mixture(
        {"replay": dx.Part("on", WINDOW), "online": dx.Part("on", WINDOW, source="online")}
    )
    new, _ = both.sample(jax.random.key(0), 16, {"on": ready["on"]}, [0.75, 0.25])
    assert new["on"].limiter.counts() == (15, 16)


@SLOW
@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+")
def test_a_global_part_draws_as_one_buffer_of_every_env():
    mesh = jax.make_mesh((2,), ("shards",), devices=jax.devices()[:2])
    glob = dx.GlobalTrajectoryBuffer(mesh, lambda: dx.TrajectoryBuffer(STEP, 2, MAX_LENGTH))
    single = dx.TrajectoryBuffer(STEP, 4, MAX_LENGTH)
    for t in range(11):
        steps = _steps(np.arange(4), t)
        glob, single = glob.add(glob.rows(steps)), single.add(steps)
    mixture = dx.Mixture({"offline": dx.Part("off", WINDOW), "online": dx.Part("on", WINDOW)})
    off = _plain()

    @eqx.filter_jit
    def run(on, f):
        return mixture.sample(jax.random.key(2), 16, {"off": off, "on": on}, jnp.stack([f, 1 - f]))[
            1
        ]

    got, want = run(glob, jnp.float32(0.5)), run(single, jnp.float32(0.5))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@SLOW
def test_a_donated_step_draws_a_mixture_and_adds():
    mixture = dx.Mixture({"offline": dx.Part("off", WINDOW), "online": dx.Part("on", WINDOW)})

    @eqx.filter_jit(donate="all-except-first")
    def steps(key, buffers):
        def one(buffers, xs):
            key, t = xs
            f = 0.5 * jnp.maximum(1.0 - t / 4.0, 0.0)
            buffers, out = mixture.sample(key, 8, buffers, {"offline": f, "online": 1 - f})
            more = jax.tree.map(lambda x: x[:NUM_ENVS, 0], out.sample.items)
            return buffers | {"on": buffers["on"].add(more)}, out.counts

        xs = (jax.random.split(key, 6), jnp.arange(6, dtype=jnp.float32))
        return jax.lax.scan(one, buffers, xs)

    # Fresh buffers (not the cached ones): these are donated.
    fresh = {"off": _plain.__wrapped__(seed=3), "on": _plain.__wrapped__()}
    taken = int(fresh["on"].step_count.sum())
    buffers, counts = steps(jax.random.key(0), fresh)
    assert np.asarray(counts)[:, 0].tolist() == [4, 3, 2, 1, 0, 0]
    assert int(buffers["on"].step_count.sum()) == taken + 6 * NUM_ENVS


def test_faults_of_a_mixture_arguments():
    buf = _plain()
    two = dx.Mixture({"a": dx.Part("x", WINDOW), "b": dx.Part("y", WINDOW)})
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="no buffer named 'y'"):
        two.sample(key, 8, {"x": buf}, [0.5, 0.5])
    with pytest.raises(ValueError, match="no part draws from the buffer named 'z'"):
        two.sample(key, 8, {"x": buf, "y": buf, "z": buf}, [0.5, 0.5])
    with pytest.raises(TypeError, match="trajectory buffers"):
        two.sample(key, 8, {"x": buf, "y": dx.UniformReplay(STEP, 4)}, [0.5, 0.5])
    with pytest.raises(ValueError, match="sum to 0.9"):
        two.sample(key, 8, {"x": buf, "y": buf}, [0.5, 0.4])
    with pytest.raises(ValueError, match="finite and non-negative"):
        two.sample(key, 8, {"x": buf, "y": buf}, [1.5, -0.5])
    with pytest.raises(ValueError, match="a fraction for each part"):
        two.sample(key, 8, {"x": buf, "y": buf}, {"a": 1.0})
    with pytest.raises(ValueError, match="2 fractions for 1 parts"):
        dx.Mixture({"a": dx.Part("x")}).sample(key, 8, {"x": buf}, [0.5, 0.5])
    with pytest.raises(TypeError, match="different `throw`"):
        loose = dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH, throw=False)
        two.sample(key, 8, {"x": buf, "y": loose}, [0.5, 0.5])
    with pytest.raises(TypeError, match="Part"):
        dx.Mixture({"a": WINDOW})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"max_fraction=...\)` must be in \(0, 1\]"):
        dx.Part("x", max_fraction=1.5)
    with pytest.raises(TypeError, match="one part for each|parameter 'source'"):
        dx.Part("x", source={"replay": 1})  # pyright: ignore[reportArgumentType]


@SLOW  # draws and compiles mixtures; the argument checks above run in the default tier
def test_faults_of_a_mixture_draw():
    buf = _plain()
    empty = dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH)
    two = dx.Mixture({"a": dx.Part("x", WINDOW), "b": dx.Part("y", WINDOW)})
    key = jax.random.key(0)
    # Rows of two kinds: windows of different lengths.
    other = dx.Mixture({"a": dx.Part("x", WINDOW), "b": dx.Part("x", dx.Window(3))})
    with pytest.raises(TypeError, match="differ from those of part 'a'"):
        other.sample(key, 8, {"x": buf}, [0.5, 0.5])
    # An empty part is fine with 0 rows (not drawn from).
    _, out = two.sample(key, 8, {"x": buf, "y": empty}, [1.0, 0.0])
    assert (np.asarray(out.source) == 0).all()
    # A traced fraction for a part whose rows depend on the batch.
    stratified = dx.PrioritisedTrajectoryBuffer(
        STEP, NUM_ENVS, MAX_LENGTH, window=WINDOW, stratified=True
    )
    per = dx.Mixture({"a": dx.Part("x", WINDOW), "b": dx.Part("s")})
    with pytest.raises(TypeError, match="cannot keep a traced number"):
        per.sample(key, 8, {"x": buf, "s": _filled(stratified, 0)}, jnp.array([0.5, 0.5]))
    # An empty part: fine with 0 rows (traced too), a fault (naming the part) with some.
    traced = eqx.filter_jit(lambda b, f: two.sample(key, 8, b, f)[1])
    out = traced({"x": buf, "y": empty}, jnp.array([1.0, 0.0]))
    assert (np.asarray(out.counts) == [8, 0]).all()
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"Mixture.sample \(part 'b'\)"):
        traced({"x": buf, "y": empty}, jnp.array([0.5, 0.5]))
    with pytest.raises(eqx.EquinoxRuntimeError, match="must sum to 1"):
        traced({"x": buf, "y": buf}, jnp.array([0.5, 0.4]))
    with pytest.raises(eqx.EquinoxRuntimeError, match="finite and non-negative"):
        traced({"x": buf, "y": buf}, jnp.array([jnp.nan, 0.5]))
    capped = dx.Mixture({"a": dx.Part("x", WINDOW, max_fraction=0.25), "b": dx.Part("x", WINDOW)})
    run = eqx.filter_jit(lambda f: capped.sample(key, 8, {"x": buf}, jnp.stack([f, 1 - f]))[1])
    assert (np.asarray(run(jnp.float32(0.25)).counts) == [2, 6]).all()
    with pytest.raises(eqx.EquinoxRuntimeError, match="more rows than its max_fraction = 0.25"):
        run(jnp.float32(0.4))  # 3 rows, where 0.25 allows 2


def test_throw_false_reports_in_the_sample():
    buf = _plain()
    loose = lambda: dx.TrajectoryBuffer(STEP, NUM_ENVS, MAX_LENGTH, throw=False)  # noqa: E731
    full = _filled(loose(), 0)
    two = dx.Mixture({"a": dx.Part("x", WINDOW), "b": dx.Part("y", WINDOW)})
    run = eqx.filter_jit(lambda b, f: two.sample(jax.random.key(0), 8, b, f)[1])
    ok = run({"x": full, "y": full}, jnp.array([0.5, 0.5]))
    assert ok.result is not None and bool(ok.result.ok)
    ok.result.check()
    bad = run({"x": full, "y": loose()}, jnp.array([0.5, 0.5]))
    assert bad.result is not None and not bool(bad.result.ok)
    assert bad.result.kind == dx.RESULTS.no_window
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"Mixture.sample \(part 'b'\)"):
        bad.result.check()
    bad = run({"x": full, "y": full}, jnp.array([0.5, 0.6]))
    assert bad.result is not None and bad.result.kind == dx.RESULTS.fractions_sum
    assert buf.result is None  # a throw=True buffer carries none
