"""Replay buffers for reinforcement learning in JAX, as immutable Equinox modules."""

import importlib.metadata

from ._abstract import AbstractReplay as AbstractReplay
from ._io import load as load, save as save
from ._storage import CircularBuffer as CircularBuffer
from ._uniform import UniformReplay as UniformReplay


__version__ = importlib.metadata.version("dejax_eqx")
