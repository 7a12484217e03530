"""Replay buffers for reinforcement learning in JAX, as immutable Equinox modules."""

import importlib.metadata

from ._abstract import (
    AbstractPrioritisedReplay as AbstractPrioritisedReplay,
    AbstractReplay as AbstractReplay,
)
from ._clustered import ClusteredReplay as ClusteredReplay
from ._dataset import Dataset as Dataset
from ._io import load as load, save as save
from ._prioritised import (
    importance_weights as importance_weights,
    PrioritisedReplay as PrioritisedReplay,
    PrioritisedSample as PrioritisedSample,
    sequence_priorities as sequence_priorities,
)
from ._prioritised_trajectory import (
    PrioritisedSequenceSample as PrioritisedSequenceSample,
    PrioritisedTrajectoryBuffer as PrioritisedTrajectoryBuffer,
)
from ._queue import TrajectoryQueue as TrajectoryQueue
from ._storage import CircularBuffer as CircularBuffer
from ._sum_tree import SumTree as SumTree
from ._trajectory import (
    SequenceSample as SequenceSample,
    TrajectoryBuffer as TrajectoryBuffer,
    Transitions as Transitions,
)
from ._uniform import UniformReplay as UniformReplay


__version__ = importlib.metadata.version("dejax_eqx")
