"""flashbax 0.1.3's `flashbax.buffers`, on dejax_eqx's modules."""

from . import (
    flat_buffer as flat_buffer,
    item_buffer as item_buffer,
    mixer as mixer,
    prioritised_flat_buffer as prioritised_flat_buffer,
    prioritised_item_buffer as prioritised_item_buffer,
    prioritised_trajectory_buffer as prioritised_trajectory_buffer,
    sum_tree as sum_tree,
    trajectory_buffer as trajectory_buffer,
    trajectory_queue as trajectory_queue,
)
from .flat_buffer import make_flat_buffer as make_flat_buffer
from .item_buffer import make_item_buffer as make_item_buffer
from .mixer import make_mixer as make_mixer
from .prioritised_flat_buffer import make_prioritised_flat_buffer as make_prioritised_flat_buffer
from .prioritised_item_buffer import make_prioritised_item_buffer as make_prioritised_item_buffer
from .prioritised_trajectory_buffer import (
    make_prioritised_trajectory_buffer as make_prioritised_trajectory_buffer,
)
from .trajectory_buffer import make_trajectory_buffer as make_trajectory_buffer
from .trajectory_queue import make_trajectory_queue as make_trajectory_queue
