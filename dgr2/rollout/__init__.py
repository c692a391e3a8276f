"""On-policy rollouts for OPD and RL: a Ray actor pool that decodes trajectories in parallel.

* :mod:`dgr2.rollout.types` - requests, trajectories, the policy spec, the errors;
* :mod:`dgr2.rollout.actor` - one policy replica (:class:`RolloutWorker`);
* :mod:`dgr2.rollout.pool` - :class:`RolloutPool`: chunking, parallel dispatch, versioned weight
  sync, replacement of dead or hung actors, exactly-once results.
"""

from dgr2.rollout.actor import RolloutWorker, RolloutWorkerBase, chunk_seed
from dgr2.rollout.pool import RolloutPool, RolloutStats
from dgr2.rollout.types import (
    ActorRestartLimitExceeded,
    PolicySpec,
    RolloutError,
    RolloutRequest,
    Trajectory,
    WeightSyncTimeout,
)

__all__ = [
    "ActorRestartLimitExceeded",
    "PolicySpec",
    "RolloutError",
    "RolloutPool",
    "RolloutRequest",
    "RolloutStats",
    "RolloutWorker",
    "RolloutWorkerBase",
    "Trajectory",
    "WeightSyncTimeout",
    "chunk_seed",
]
