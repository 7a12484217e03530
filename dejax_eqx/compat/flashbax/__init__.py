"""A drop-in for flashbax 0.1.3: `import dejax_eqx.compat.flashbax as fbx`.

The same functions, arguments, states and samples as flashbax's, computed by dejax_eqx's
modules: `TrajectoryBuffer` (trajectory, item and flat buffers), `PrioritisedTrajectoryBuffer`
(their prioritised forms) and `TrajectoryQueue`. Where flashbax silently sampled zeros or
overwrote unread data, this raises; docs/migration-flashbax.md lists every difference.
"""

from . import buffers as buffers, utils as utils
from .buffers import (
    flat_buffer as flat_buffer,
    item_buffer as item_buffer,
    make_flat_buffer as make_flat_buffer,
    make_item_buffer as make_item_buffer,
    make_mixer as make_mixer,
    make_prioritised_flat_buffer as make_prioritised_flat_buffer,
    make_prioritised_item_buffer as make_prioritised_item_buffer,
    make_prioritised_trajectory_buffer as make_prioritised_trajectory_buffer,
    make_trajectory_buffer as make_trajectory_buffer,
    make_trajectory_queue as make_trajectory_queue,
    mixer as mixer,
    prioritised_flat_buffer as prioritised_flat_buffer,
    prioritised_item_buffer as prioritised_item_buffer,
    prioritised_trajectory_buffer as prioritised_trajectory_buffer,
    trajectory_buffer as trajectory_buffer,
    trajectory_queue as trajectory_queue,
)
