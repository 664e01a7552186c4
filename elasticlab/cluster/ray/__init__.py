"""The cluster autoscaler on Ray (the ``ray`` extra: ``pip install 'elasticlab[ray]'``).

* :class:`RayCluster` (cluster.py) -- the shared scheduling loop over Ray nodes: the same policies,
  ``JobSpec``, event log and ``ClusterPanel`` as :class:`~elasticlab.cluster.LocalCluster`; node placement
  by :func:`elasticlab.alloc.placement.place`; a lost node lowers the capacity and the jobs re-allocate.
* :class:`RayJob` (job.py) -- one job as a gang of actors forming one gloo/NCCL group per generation;
  resize at a step boundary from a checkpoint, faults resumed from the newest valid one.
* generation.py -- a job's generations (form, drain, end, recover from a fault); gang.py -- a job's actors
  and the placement groups holding their slots; actor.py -- the actor; local.py -- a multi-node cluster on
  one machine (tests, benchmark, notebook).
"""
try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("elasticlab.cluster.ray needs Ray: pip install 'elasticlab[ray]'") from e

from elasticlab.cluster.ray.cluster import RayCluster, connect, ray_nodes
from elasticlab.cluster.ray.job import RayJob, RayJobStatus

__all__ = ["RayCluster", "RayJob", "RayJobStatus", "connect", "ray_nodes"]
