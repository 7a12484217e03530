"""The helper functions of `dejax_eqx.compat.flashbax` (sizes, capacities, the sum tree's
arithmetic and queries, the validators, `utils`) on bad input: each refuses it with a message
that names the call and the argument, where flashbax 0.1.3 raised a bare `ZeroDivisionError`,
returned a negative or zero size, or answered a leaf for a query outside `[0, 1]`. On valid
input each gives flashbax's answer (the expected values below are flashbax 0.1.3's, computed
with it).

Under the tests' jaxtyping import hook a float or `None` where an `int` is annotated is refused
by the hook before the function runs (a `TypeCheckError`, a `TypeError` that names the function
and the parameter): the patterns below accept either message.
"""

import inspect
import re
import typing

import dejax_eqx
import dejax_eqx.compat.flashbax as fbx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx.compat.flashbax import utils
from dejax_eqx.compat.flashbax.buffers import (
    flat_buffer as fb,
    item_buffer as ib,
    mixer,
    prioritised_trajectory_buffer as ptb,
    sum_tree,
    trajectory_buffer as tb,
    trajectory_queue as tq,
)

from .helpers import SLOW


STEP = {"x": jnp.zeros(())}
INT32_MAX = 2**31 - 1


def _names(call: str, arg: str) -> str:
    """A pattern for a message naming `call` and its argument `arg`: ours, or the import
    hook's (which names the function by its module path and the parameter)."""
    function = call.split(".")[-1].split("(")[0]
    hook = rf"\.{function}\.\nThe problem arose whilst typechecking parameter '{arg}'"
    return re.escape(f"`{call}({arg}=...)`") + "|" + hook


def _check_refused(function, call: str, args: dict, arg: str, *, zero_ok: bool = False):
    """`function(**args)` with `args[arg]` replaced by each bad value raises the right error,
    naming `call` and `arg`, and saying what was wrong. `None` is tried only where the
    argument may not be `None` (flashbax's optional sizes may)."""
    annotation = inspect.signature(function).parameters[arg].annotation
    optional = type(None) in typing.get_args(annotation)
    bad: list[tuple[object, type[Exception], str]]
    bad = [(-1, ValueError, "must be (positive|non-negative), got -1")]
    bad += [(-16, ValueError, "got -16"), (2**31, ValueError, "must be at most 2147483647")]
    if not zero_ok:
        bad.append((0, ValueError, "must be positive, got 0"))
    bad += [
        (True, TypeError, "must be a Python int, got True of type bool"),
        (2.0, TypeError, "must be a Python int, got 2.0"),
        (2.5, TypeError, "must be a Python int, got 2.5"),
        (float("nan"), TypeError, "must be a Python int, got nan"),
        ("3", TypeError, "must be a Python int, got '3'"),
        (jnp.int32(3), TypeError, "must be a Python int, got Array"),
    ]
    if not optional:
        bad.append((None, TypeError, "must be a Python int, got None"))
    for value, error, what in bad:
        with pytest.raises(error) as info:
            function(**{**args, arg: value})
        message = str(info.value)
        assert re.search(_names(call, arg), message), (arg, value, message)
        if message.startswith("`"):  # ours, not the hook's: it also says what was wrong
            assert re.search(what, message), (arg, value, message)


# ---------------------------------------------------------------------------------------------
# The sizes of a prioritised buffer's sum tree.


def test_capacity_helpers_give_flashbax_s_values():
    divisible = [(10, 3), (9, 3), (2, 4), (7, 1), (1, 1)]
    assert [ptb.get_max_divisible_length(*a) for a in divisible] == [9, 9, 0, 7, 1]
    items = [(10, 3), (9, 3), (2, 4), (7, 1)]
    assert [ptb.get_num_items_in_row(*a) for a in items] == [3, 3, 0, 7]
    capacity = [(10, 3, 4), (9, 1, 2), (2, 4, 3), (7, 7, 1)]
    assert [ptb.get_sum_tree_capacity(*a) for a in capacity] == [12, 18, 0, 1]
    capacities = [1, 2, 3, 4, 5, 8, 9, 2**30, 2**30 + 1, INT32_MAX]
    assert [sum_tree.get_tree_depth(c) for c in capacities] == [0, 1, 2, 2, 3, 3, 4, 30, 31, 31]
    # The same function from both of flashbax's paths.
    assert ptb.get_tree_depth is sum_tree.get_tree_depth
    # NumPy integers are taken, as flashbax takes them (outside the hook, which wants an `int`).
    assert inspect.unwrap(ptb.get_sum_tree_capacity)(np.int64(10), np.int32(3), 4) == 12


@pytest.mark.parametrize(
    "function, args",
    [
        (ptb.get_max_divisible_length, dict(max_length_time_axis=10, period=3)),
        (ptb.get_num_items_in_row, dict(max_length_time_axis=10, period=3)),
        (ptb.get_sum_tree_capacity, dict(max_length_time_axis=10, period=3, add_batch_size=4)),
        (sum_tree.get_tree_depth, dict(capacity=5)),
    ],
)
def test_capacity_helpers_refuse_sizes_that_are_not_positive_ints(function, args):
    # flashbax: a ZeroDivisionError for a zero period, -16 or 0 for negative or zero sizes
    # (get_max_divisible_length(-16, 3) == -18, get_sum_tree_capacity(10, 3, -16) == -48),
    # and OverflowError / ValueError from a float logarithm in get_tree_depth.
    for arg in args:
        _check_refused(function, function.__name__, args, arg)


# ---------------------------------------------------------------------------------------------
# The validators of the buffers' arguments.

VALIDATORS = [
    (
        fb.validate_sample_batch_size,
        "validate_sample_batch_size",
        dict(sample_batch_size=4, max_length=8),
    ),
    (
        fb.validate_min_length,
        "flat_buffer.validate_min_length",
        dict(min_length=4, add_batch_size=2, max_length=8),
    ),
    (
        fb.validate_max_length_add_batch_size,
        "validate_max_length_add_batch_size",
        dict(max_length=8, add_batch_size=2),
    ),
    (
        fb.validate_flat_buffer_args,
        "validate_flat_buffer_args",
        dict(max_length=8, min_length=2, sample_batch_size=4, add_batch_size=2),
    ),
    (ib.validate_min_length, "item_buffer.validate_min_length", dict(min_length=3, max_length=4)),
    (
        ib.validate_item_buffer_args,
        "validate_item_buffer_args",
        dict(max_length=8, min_length=2, sample_batch_size=4),
    ),
    (
        tb.validate_size,
        "validate_size",
        dict(max_length_time_axis=8, max_size=None, add_batch_size=2),
    ),
    (
        tb.validate_trajectory_buffer_args,
        "validate_trajectory_buffer_args",
        dict(
            max_length_time_axis=8,
            min_length_time_axis=4,
            add_batch_size=2,
            sample_sequence_length=4,
            period=1,
            max_size=None,
        ),
    ),
    (
        tq.validate_trajectory_queue_args,
        "validate_trajectory_queue_args",
        dict(max_length_time_axis=8, add_batch_size=2, sample_sequence_length=2, max_size=None),
    ),
]


@pytest.mark.parametrize("function, call, args", VALIDATORS)
def test_validators_refuse_sizes_that_are_not_positive_ints(function, call, args):
    # flashbax: ZeroDivisionError for add_batch_size = 0 (validate_min_length,
    # validate_max_length_add_batch_size, validate_size with a max_size, ...), and silence for
    # negative sizes (validate_sample_batch_size(-1, 8), validate_min_length(-1, 8)).
    assert function(**args) is None  # valid: nothing raised, as flashbax
    for arg, value in args.items():
        if value is None:  # the optional sizes: max_size
            continue
        _check_refused(function, call, args, arg, zero_ok=arg.startswith("min_length"))
    if "max_size" in args:  # `None` stands for a size not given; given, it must be positive
        args = {**args, "max_length_time_axis": None} if "validate_size" in call else args
        for value, error in [(0, ValueError), (-1, ValueError), (True, TypeError)]:
            with pytest.raises(error, match=_names(call, "max_size")):
                function(**{**args, "max_size": value})


def test_validators_keep_flashbax_s_own_checks_and_messages():
    with pytest.raises(ValueError, match="^sample_batch_size must be less than or equal to max"):
        fb.validate_sample_batch_size(9, 8)
    with pytest.raises(ValueError, match="^min_length used is too large for the buffer size"):
        fb.validate_min_length(7, 2, 3)
    with pytest.raises(ValueError, match=re.escape("It is currently 3//2 = 1")):
        fb.validate_max_length_add_batch_size(3, 2)
    with pytest.raises(ValueError, match="^min_length used cannot be larger than max_length"):
        ib.validate_min_length(5, 4)
    with pytest.raises(ValueError, match="^Cannot specify both `max_size`"):
        tb.validate_size(8, 16, 2)
    with pytest.warns(UserWarning, match="max_size // add_batch_size = 1"):
        with pytest.raises(ValueError, match="must be at most `max_length_time_axis` = 1"):
            tq.validate_trajectory_queue_args(8, 2, 2, 2)  # max_size 2 // 2 = 1 step per row
    assert fb.validate_min_length(0, 2, 4) is None and ib.validate_min_length(0, 4) is None
    with pytest.warns(UserWarning, match="max_length_time_axis = max_size // add_batch_size = 8"):
        tb.validate_size(None, 17, 2)


def test_a_max_size_below_add_batch_size_is_refused_by_the_call_given_it():
    # max_size // add_batch_size = 0 steps per row: flashbax built rows of no steps (the queue
    # then refused `sample_sequence_length`, an argument that was fine).
    message = "max_size = 3 is less than add_batch_size = 4, so the rows would hold "
    cases = [
        ("validate_size", lambda: tb.validate_size(None, 3, 4)),
        (
            "validate_trajectory_buffer_args",
            lambda: tb.validate_trajectory_buffer_args(None, 1, 4, 1, 1, 3),
        ),
        ("validate_trajectory_queue_args", lambda: tq.validate_trajectory_queue_args(8, 4, 1, 3)),
        ("make_trajectory_buffer", lambda: fbx.make_trajectory_buffer(4, 2, 1, 1, 1, max_size=3)),
        (
            "make_prioritised_trajectory_buffer",
            lambda: fbx.make_prioritised_trajectory_buffer(4, 2, 1, 1, 1, max_size=3),
        ),
        ("make_trajectory_queue", lambda: fbx.make_trajectory_queue(8, 4, 1, 1, max_size=3)),
    ]
    for call, make in cases:
        with pytest.raises(ValueError, match=re.escape(f"`{call}`: {message}")):
            make()
    # max_size = add_batch_size: one step per row, as flashbax.
    with pytest.warns(UserWarning, match="max_size // add_batch_size = 1"):
        buffer = fbx.make_trajectory_buffer(4, 2, 1, 1, 1, max_size=4)
    assert buffer.init(STEP).experience["x"].shape == (4, 1)


def test_a_period_longer_than_the_time_axis_is_refused_by_make_prioritised_trajectory_buffer():
    # flashbax cut the time axis down to 2 // 4 * 4 = 0 steps, a buffer that init then refused
    # under the module's name.
    call = "make_prioritised_trajectory_buffer"
    with pytest.warns(UserWarning, match="period = 4 > sample_sequence_length = 1"):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"`{call}(period=...)` must be at most max_length_time_axis = 2, got 4"
            ),
        ):
            fbx.make_prioritised_trajectory_buffer(2, 2, 1, 4, 1, max_length_time_axis=2)
    # A period that fits: the axis is cut down to a multiple of it, as flashbax does.
    with pytest.warns(UserWarning, match="period = 4 > sample_sequence_length = 1"):
        buffer = fbx.make_prioritised_trajectory_buffer(2, 2, 1, 4, 1, max_length_time_axis=9)
    assert buffer.init(STEP).experience["x"].shape == (2, 8)


def test_the_priority_exponent_is_checked_under_the_call_given_it():
    # flashbax let a bool through and raised Python's own TypeError for a string.
    assert ptb.validate_priority_exponent(0.0) is None
    assert ptb.validate_priority_exponent(1.0) is None
    with pytest.raises(
        ValueError, match=re.escape("`validate_priority_exponent(priority_exponent=...)` must be")
    ):
        ptb.validate_priority_exponent(1.5)
    for value in [True, "a"]:
        with pytest.raises(
            TypeError, match=_names("validate_priority_exponent", "priority_exponent")
        ):
            ptb.validate_priority_exponent(value)
    for make, args in [
        (fbx.make_prioritised_trajectory_buffer, (2, 2, 1, 1, 1, None, 8)),
        (fbx.make_prioritised_flat_buffer, (8, 2, 2)),
        (fbx.make_prioritised_item_buffer, (8, 2, 2)),
    ]:
        where = re.escape(f"`{make.__name__}(priority_exponent=...)`")
        with pytest.raises(ValueError, match=where + " must be in \\[0, 1\\], got 2.0"):
            make(*args, priority_exponent=2.0)
        with pytest.raises(ValueError, match=where + " must be finite, got nan"):
            make(*args, priority_exponent=float("nan"))
        with pytest.raises(TypeError, match=where + "|parameter 'priority_exponent'"):
            make(*args, priority_exponent="a")


# ---------------------------------------------------------------------------------------------
# The sum tree: queries, node positions.


def _tree(values: list[float]) -> sum_tree.SumTreeState:
    tree = dejax_eqx.SumTree(len(values)).set(jnp.arange(len(values)), jnp.asarray(values))
    return sum_tree.SumTreeState(tree, jnp.float32(1), 1.0)


def test_sum_tree_sample_takes_flashbax_s_queries_in_0_1():
    state = _tree([1.0, 0.0, 3.0])  # intervals [0, 0.25) for leaf 0, [0.25, 1] for leaf 2
    for query, leaf in [(0.0, 0), (0.1, 0), (0.24, 0), (0.26, 2), (0.5, 2), (1.0, 2)]:
        assert int(sum_tree.sample(state, query_value=query)) == leaf, query
        assert int(sum_tree.sample(state, query_value=np.float64(query))) == leaf, query
        assert int(sum_tree.sample(state, query_value=jnp.float32(query))) == leaf, query
    assert int(sum_tree.sample(state, query_value=0)) == 0
    assert int(sum_tree.sample(state, query_value=1)) == 2
    assert int(sum_tree.sample(state, query_value=jnp.int32(1))) == 2
    # Traced, as flashbax's stratified_sample maps it over queries.
    queries = jnp.asarray([0.0, 0.2, 0.3, 1.0])
    drawn = jax.jit(jax.vmap(lambda q: sum_tree.sample(state, None, q)))(queries)
    assert drawn.tolist() == [0, 0, 2, 2]
    # A key (the query drawn in [0, 1)) still works.
    assert int(sum_tree.sample(state, jax.random.key(0))) in (0, 2)


@pytest.mark.parametrize(
    "bad",
    [1.5, -0.5, float("nan"), float("inf"), 1 + 1e-12, 2, -1, pytest.param(10**400, id="10**400")],
)
def test_sum_tree_sample_refuses_a_python_or_numpy_query_outside_0_1_at_once(bad):
    # flashbax returned a leaf (the last for 1.5 or NaN, the first for -0.5).
    state = _tree([1.0, 0.0, 3.0])
    message = re.escape("`sum_tree.sample(query_value=...)` must be in [0, 1]")
    with pytest.raises(ValueError, match=message):
        sum_tree.sample(state, query_value=bad)
    if not isinstance(bad, int) or abs(bad) < 2**63:
        with pytest.raises(ValueError, match=message):
            sum_tree.sample(state, query_value=np.asarray(bad)[()])
    # Raised at trace time inside jit too: the value is a constant of the program.
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda: sum_tree.sample(state, query_value=bad))()


@pytest.mark.parametrize("bad", [1.5, -0.5, float("nan"), float("inf")])
def test_sum_tree_sample_reports_a_jax_query_outside_0_1_as_a_fault(bad):
    state = _tree([1.0, 0.0, 3.0])
    message = "`sum_tree.sample`: query_value must be in [0, 1]"
    query = jnp.float32(bad)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        sum_tree.sample(state, query_value=query)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        eqx.filter_jit(lambda q: sum_tree.sample(state, query_value=q))(query)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
        jax.jit(lambda q: sum_tree.sample(state, query_value=q))(query)
    # One bad lane of a vmapped batch of queries.
    queries = jnp.asarray([0.5, bad, 0.1], jnp.float32)
    with pytest.raises(eqx.EquinoxRuntimeError, match=re.escape(message)):
        eqx.filter_jit(jax.vmap(lambda q: sum_tree.sample(state, None, q)))(queries)


def test_sum_tree_sample_refuses_a_query_that_is_not_a_real_scalar():
    state = _tree([1.0, 3.0])
    where = re.escape("`sum_tree.sample(query_value=...)`")
    hook = "|parameter 'query_value'"
    with pytest.raises(TypeError, match=where + " must be a real scalar.*got True" + hook):
        sum_tree.sample(state, query_value=True)
    with pytest.raises(TypeError, match=where + " must be a real scalar.*got '0.5'" + hook):
        sum_tree.sample(state, query_value="0.5")  # pyright: ignore[reportArgumentType]
    with pytest.raises((ValueError, TypeError), match=where + " must be a scalar" + hook):
        sum_tree.sample(state, query_value=jnp.asarray([0.5]))
    with pytest.raises((ValueError, TypeError), match=where + " must be a scalar" + hook):
        sum_tree.sample(state, query_value=np.asarray([0.1, 0.5]))
    with pytest.raises(TypeError, match=where + " must be a real number, got dtype bool" + hook):
        sum_tree.sample(state, query_value=jnp.asarray(True))


def test_stratified_sample_is_unchanged():
    state = _tree([1.0, 0.0, 3.0])
    # One draw from each eighth of the total (flashbax's answer for this key, too).
    drawn = sum_tree.stratified_sample(state, 8, jax.random.key(1))
    assert drawn.tolist() == [0, 0, 2, 2, 2, 2, 2, 2]
    for value, error in [(0, ValueError), (-1, ValueError), (True, TypeError)]:
        with pytest.raises(error, match=_names("sum_tree.stratified_sample", "batch_size")):
            sum_tree.stratified_sample(state, value, jax.random.key(1))


def test_get_tree_index_is_flashbax_s_inside_the_tree_and_a_fault_outside():
    # flashbax: 2**depth_level - 1 + node_index for any integers, so (2, -1) named node 2 of
    # level 1, (0, 1) node 0 of level 1, and a negative level raised JAX's own error.
    assert int(sum_tree.get_tree_index(0, 0)) == 0
    assert int(sum_tree.get_tree_index(2, 3)) == 6
    assert int(sum_tree.get_tree_index(30, 2**30 - 1)) == 2**31 - 2
    nodes = sum_tree.get_tree_index(jnp.asarray([0, 1, 1, 2]), jnp.asarray([0, 0, 1, 3]))
    assert nodes.tolist() == [0, 1, 2, 6]
    level = sum_tree.get_tree_index(2, jnp.arange(4))  # flashbax's get_batch maps it so
    assert level.tolist() == [3, 4, 5, 6]
    # The nodes of a state: leaf i of a state of depth d sits at get_tree_index(d, i).
    state = _tree([1.0, 0.0, 3.0])
    leaves = state.nodes[sum_tree.get_tree_index(state.tree_depth, jnp.arange(3))]
    assert leaves.tolist() == [1.0, 0.0, 3.0]
    depth = re.escape("`sum_tree.get_tree_index`: depth_level must be in [0, 30]")
    node = re.escape("`sum_tree.get_tree_index`: node_index must be in [0, 2**depth_level)")
    for args, message in [
        ((-1, 0), depth),
        ((31, 0), depth),
        ((jnp.asarray([0, -1]), jnp.asarray([0, 0])), depth),
        ((0, 1), node),
        ((2, 4), node),
        ((2, -1), node),
        ((np.int64(2), np.int64(2**40)), node),
    ]:
        with pytest.raises(eqx.EquinoxRuntimeError, match=message):
            sum_tree.get_tree_index(*args)
    with pytest.raises(jax.errors.JaxRuntimeError, match=node):
        jax.jit(sum_tree.get_tree_index)(jnp.int32(1), jnp.int32(2))
    for args, arg in [((1.5, 0), "depth_level"), ((2, 1.5), "node_index")]:
        with pytest.raises(TypeError, match=_names("sum_tree.get_tree_index", arg)):
            sum_tree.get_tree_index(*args)


# ---------------------------------------------------------------------------------------------
# The functions of the buffers that take sizes beside a state.


def test_get_invalid_indices_refuses_sizes_that_are_not_the_state_s():
    state = tb.init(STEP, 2, 8)
    for _ in range(3):
        state = tb.add(state, {"x": jnp.ones((2, 1))})
    args: dict[str, typing.Any] = dict(
        state=state, sample_sequence_length=2, period=1, add_batch_size=2, max_length_time_axis=8
    )
    # flashbax's answer (current_index 3, windows of 2, period 1).
    assert ptb.get_invalid_indices(**args).tolist() == [[2, 3, 4], [10, 11, 12]]
    for arg in ["sample_sequence_length", "period", "add_batch_size", "max_length_time_axis"]:
        _check_refused(ptb.get_invalid_indices, "get_invalid_indices", args, arg)
    # flashbax: a ZeroDivisionError for period 0, rows of other buffers for other sizes, a
    # modulo by zero items per row (all zeros) for a period past the time axis.
    for arg, value, what in [
        ("add_batch_size", 3, "must be the state's, 2, got 3"),
        ("max_length_time_axis", 6, "must be the state's, 8, got 6"),
        ("period", 9, "must be at most max_length_time_axis = 8, got 9"),
        ("sample_sequence_length", 9, "must be at most max_length_time_axis = 8, got 9"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"`get_invalid_indices({arg}=...)` {what}")):
            ptb.get_invalid_indices(**{**args, arg: value})


# An error edge: the slow tier.
@SLOW
def test_periods_and_windows_longer_than_a_row_are_refused_under_flashbax_s_names():
    # The module refused them in its own words (`PrioritisedTrajectoryBuffer`: a window of
    # burn_in + sequence_length + bootstrap = 0 + 9 + 0 = 9 steps ...), naming a class and
    # options the caller never wrote.
    where = "`prioritised_trajectory_buffer.prioritised_init(period=...)`"
    with pytest.raises(
        ValueError, match=re.escape(f"{where} must be at most max_length_time_axis = 4, got 8")
    ):
        ptb.prioritised_init(STEP, 2, 4, 8)
    state = ptb.prioritised_init(STEP, 2, 8, 2)
    batch = {"x": jnp.ones((2, 3))}
    for call, arg, run in [
        (
            "prioritised_add",
            "sample_sequence_length",
            lambda n: ptb.prioritised_add(state, batch, n, 2, "cpu"),
        ),
        (
            "prioritised_sample",
            "sequence_length",
            lambda n: ptb.prioritised_sample(state, jax.random.key(0), 2, n, 2),
        ),
    ]:
        where = f"`prioritised_trajectory_buffer.{call}({arg}=...)`"
        with pytest.raises(
            ValueError, match=re.escape(f"{where} must be at most max_length_time_axis = 8, got 9")
        ):
            run(9)
    state = ptb.prioritised_add(state, batch, 2, 2, "cpu")  # windows of 2 fit, as in flashbax
    assert ptb.prioritised_sample(state, jax.random.key(0), 3, 2, 2).experience["x"].shape == (3, 2)
    plain = tb.init(STEP, 2, 8)
    where = "`trajectory_buffer.sample(sequence_length=...)`"
    with pytest.raises(
        ValueError, match=re.escape(f"{where} must be at most max_length_time_axis = 8, got 9")
    ):
        tb.sample(plain, jax.random.key(0), 2, 9, 1)
    # A size not given (`None`) is named, not handed to the module.
    for call, arg, run in [
        ("trajectory_buffer.init", "add_batch_size", lambda: tb.init(STEP, None, 8)),  # pyright: ignore[reportArgumentType]
        ("trajectory_queue.init", "max_length_time_axis", lambda: tq.init(STEP, 2, None)),  # pyright: ignore[reportArgumentType]
        (
            "prioritised_trajectory_buffer.prioritised_init",
            "period",
            lambda: ptb.prioritised_init(STEP, 2, 8, None),  # pyright: ignore[reportArgumentType]
        ),
    ]:
        with pytest.raises(TypeError, match=_names(call, arg)):
            run()


def test_can_sample_and_can_add_refuse_lengths_that_are_not_ints():
    # flashbax answered True for a negative (or zero) length and compared against floats.
    state = tb.init(STEP, 2, 8)
    assert bool(tb.can_sample(state, 0)) and not bool(tb.can_sample(state, 1))
    _check_refused(
        tb.can_sample,
        "trajectory_buffer.can_sample",
        dict(state=state, min_length_time_axis=1),
        "min_length_time_axis",
        zero_ok=True,
    )
    queue = tq.init(STEP, 2, 8)
    assert bool(tq.can_add(queue, 8, 8)) and not bool(tq.can_add(queue, 9, 8))
    assert not bool(tq.can_sample(queue, 1, 8))
    for function, arg in [
        (tq.can_add, "add_sequence_length"),
        (tq.can_sample, "sample_sequence_length"),
    ]:
        call = f"trajectory_queue.{function.__name__}"
        args = dict(state=queue, max_length_time_axis=8, **{arg: 2})
        _check_refused(function, call, args, arg)
        for value, error in [(0, ValueError), (True, TypeError), (8.0, TypeError)]:
            with pytest.raises(error, match=_names(call, "max_length_time_axis")):
                function(**{**args, "max_length_time_axis": value})
        with pytest.raises(ValueError, match=re.escape(f"`{call}`: max_length_time_axis = 6, but")):
            function(**{**args, "max_length_time_axis": 6})


# ---------------------------------------------------------------------------------------------
# utils and the mixer.


def test_get_tree_shape_prefix_refuses_a_negative_or_non_int_n_axes():
    tree = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 3, 4))}
    assert utils.get_tree_shape_prefix(tree) == (2,)
    assert utils.get_tree_shape_prefix(tree, 2) == (2, 3)
    assert utils.get_tree_shape_prefix(tree, 0) == ()
    # flashbax sliced the shapes with it: -1 compared every axis but the last.
    call, arg = "get_tree_shape_prefix", "n_axes"
    _check_refused(utils.get_tree_shape_prefix, call, dict(tree=tree, n_axes=1), arg, zero_ok=True)


def test_add_dim_to_args_expands_the_slice_flashbax_expands():
    def shapes(*args, **kwargs):
        return [np.shape(a) for a in args], {k: np.shape(v) for k, v in kwargs.items()}

    x = np.zeros(2)
    # flashbax 0.1.3's answers: args[starting_arg_index:ending_arg_index] get the new axis
    # (the drop-in took None as 1 and a negative start as 0).
    for start, end, expected in [
        (1, None, [(2,), (1, 2), (1, 2)]),
        (None, None, [(1, 2), (1, 2), (1, 2)]),
        (-1, None, [(2,), (2,), (1, 2)]),
        (0, -1, [(1, 2), (1, 2), (2,)]),
        (1, 2, [(2,), (1, 2), (2,)]),
        (5, None, [(2,), (2,), (2,)]),
        (2, 1, [(2,), (2,), (2,)]),
    ]:
        wrapped = utils.add_dim_to_args(
            shapes, axis=0, starting_arg_index=start, ending_arg_index=end
        )
        assert wrapped(x, x, x) == (expected, {}), (start, end)
    wrapped = utils.add_dim_to_args(shapes, kwargs_on_device_keys=["k"])
    assert wrapped(x, k=x, j=x) == ([(2,)], {"k": (2, 1), "j": (2,)})
    # Refused when wrapping, where flashbax failed at the first call.
    for kwargs, arg in [
        (dict(axis=1.5), "axis"),
        (dict(axis=True), "axis"),
        (dict(starting_arg_index=1.0), "starting_arg_index"),
        (dict(ending_arg_index=True), "ending_arg_index"),
    ]:
        with pytest.raises(TypeError, match=_names("add_dim_to_args", arg)):
            utils.add_dim_to_args(shapes, **kwargs)


def test_get_timestep_count_refuses_what_is_not_a_buffer_state():
    state = tb.add(tb.init(STEP, 2, 4), {"x": jnp.ones((2, 3))})
    assert int(utils.get_timestep_count(state)) == 6
    # flashbax asserted; the drop-in raised an AttributeError naming `current_index`.
    for value in [tq.init(STEP, 2, 4), None]:
        with pytest.raises(TypeError, match="`get_timestep_count` takes the state of a"):
            utils.get_timestep_count(value)


def test_sample_mixer_fn_refuses_shares_that_are_not_non_negative_ints():
    def sample(state, key):
        return {"x": jnp.full((3,), state, jnp.float32)}

    key = jax.random.key(0)
    out = mixer.sample_mixer_fn([1, 2], key, [1, 2], [sample, sample])
    assert out["x"].tolist() == [1.0, 2.0, 2.0]
    # flashbax: a negative share dropped rows from the end, all zeros an IndexError.
    with pytest.raises(ValueError, match=re.escape("`mixer.sample`: prop_batch_sizes[0] must be")):
        mixer.sample_mixer_fn([1, 2], key, [-1, 2], [sample, sample])
    with pytest.raises(ValueError, match=re.escape("`mixer.sample`: prop_batch_sizes are all 0")):
        mixer.sample_mixer_fn([1, 2], key, [0, 0], [sample, sample])
    with pytest.raises(TypeError, match=r"`mixer.sample`: prop_batch_sizes\[1\]|prop_batch_sizes"):
        mixer.sample_mixer_fn([1, 2], key, [1, 1.5], [sample, sample])  # pyright: ignore[reportArgumentType]
