"""Replay buffers for reinforcement learning in JAX, as immutable Equinox modules."""

import importlib.metadata

from ._abstract import (
    AbstractBuffer as AbstractBuffer,
    AbstractPrioritisedReplay as AbstractPrioritisedReplay,
    AbstractReplay as AbstractReplay,
    AbstractTrajectoryBuffer as AbstractTrajectoryBuffer,
    WindowPriorities as WindowPriorities,
)
from ._clustered import ClusteredReplay as ClusteredReplay
from ._dataset import Dataset as Dataset
from ._episode_laws import EpisodeSample as EpisodeSample, WholeEpisode as WholeEpisode
from ._episodes import EpisodeInfo as EpisodeInfo, Episodes as Episodes
from ._global import AbstractGlobalBuffer as AbstractGlobalBuffer
from ._global_replay import GlobalReplay as GlobalReplay
from ._global_trajectories import GlobalTrajectoryBuffer as GlobalTrajectoryBuffer
from ._grain import WindowSource as WindowSource
from ._io import load as load, save as save
from ._laws import (
    AbstractEnumerableLaw as AbstractEnumerableLaw,
    AbstractLaw as AbstractLaw,
    Candidates as Candidates,
    Draw as Draw,
    MixedLaw as MixedLaw,
)
from ._minari import (
    from_minari as from_minari,
    load_minari as load_minari,
    minari_spec as minari_spec,
    MinariWritten as MinariWritten,
    to_minari as to_minari,
)
from ._mixture import MixedSample as MixedSample, Mixture as Mixture, Part as Part
from ._nstep import NStep as NStep, Transitions as Transitions
from ._policy_age import AgedLaw as AgedLaw, AgedSample as AgedSample, PolicyAge as PolicyAge
from ._priorities import (
    importance_weights as importance_weights,
    sequence_priorities as sequence_priorities,
)
from ._prioritised import (
    PrioritisedReplay as PrioritisedReplay,
    PrioritisedSample as PrioritisedSample,
)
from ._prioritised_trajectory import (
    PrioritisedSequenceSample as PrioritisedSequenceSample,
    PrioritisedTrajectoryBuffer as PrioritisedTrajectoryBuffer,
)
from ._queue import TrajectoryQueue as TrajectoryQueue
from ._rate_limited import (
    RateLimited as RateLimited,
    RateLimitedReplay as RateLimitedReplay,
    RateLimitedTrajectoryBuffer as RateLimitedTrajectoryBuffer,
)
from ._rate_limiter import RateLimiter as RateLimiter
from ._relabel import Relabel as Relabel, Relabelled as Relabelled
from ._results import Result as Result, RESULTS as RESULTS
from ._service import (
    RateLimitTimeout as RateLimitTimeout,
    ReplayService as ReplayService,
    ServiceClosed as ServiceClosed,
    WaitCannotEnd as WaitCannotEnd,
)
from ._storage import CircularBuffer as CircularBuffer
from ._streams import Streams as Streams, WrittenBack as WrittenBack
from ._sum_tree import SumTree as SumTree
from ._trajectory import TrajectoryBuffer as TrajectoryBuffer
from ._uniform import UniformReplay as UniformReplay
from ._windows import SequenceSample as SequenceSample, Window as Window


__version__ = importlib.metadata.version("dejax_eqx")
