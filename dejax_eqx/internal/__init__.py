"""The surface that dejax_eqx's compatibility layers (`dejax_eqx.compat`), and buffer types
defined outside the package, build on.

Not for applications: these names may change between releases without a deprecation period.
They are the checks every public method uses at its door, and the operations behind those
doors, under the names they have in the package. A layer over dejax_eqx imports only
`dejax_eqx` and `dejax_eqx.internal`, never a module whose name starts with an underscore.
"""

from .._checks import (
    as_float as as_float,
    check_bool as check_bool,
    check_finite_float as check_finite_float,
    check_index as check_index,
    check_items as check_items,
    check_nonnegative_int as check_nonnegative_int,
    check_positive_int as check_positive_int,
    check_sequences as check_sequences,
    check_vector as check_vector,
    Prototype as Prototype,
)
from .._faults import (
    check_faults as check_faults,
    Fault as Fault,
    is_concrete as is_concrete,
    recording as recording,
)
from .._laws import (
    float_targets as float_targets,
    in_union as in_union,
    locate as locate,
    probability as probability,
    single as single,
    split_union as split_union,
)
from .._priorities import Priorities as Priorities, priority_mass as priority_mass
from .._prioritised_trajectory import stamps_of as stamps_of
from .._queue import extend_queue as extend_queue, pop_queue as pop_queue
from .._results import reports as reports, result_of as result_of
from .._sequences import draw_starts as draw_starts, phase as phase
from .._windows import read_windows as read_windows
