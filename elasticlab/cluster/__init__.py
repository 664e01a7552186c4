"""A local cluster autoscaler: the allocation policies moving slots and batch sizes between live jobs.

* :class:`Scheduler` (scheduler.py) -- the scheduling loop every backend shares (rounds, policies, queue/drop
  admission, requests, event log); reports.py -- what the panel and the benchmark read of it.
* :class:`LocalCluster` (cluster.py) -- the loop over a pool of worker slots on this machine.
* :class:`RayCluster` (ray/, the ``ray`` extra) -- the loop over Ray nodes: placement groups, gangs of actors.
* :class:`JobSpec` (spec.py) -- what a user submits (entrypoint, slot range, batch range, work).
* :class:`LiveJob` (view.py) -- a live job as the policies see it (fitted throughput model, GNS, speedups).
* policies.py -- the ``live`` policies of :mod:`elasticlab.alloc` (goodput, pollux, saxena, fifo) and
  equal_share.
* :class:`RestartCost` (restart.py) -- the measured resize cost used as Pollux's restart penalty.
* torchrun.py -- the same decisions driving jobs launched under ``torchrun`` (c10d rendezvous).
* experiments.py -- the three-job comparison shared by tests, benchmark and ``elasticlab reproduce``.
"""
from elasticlab.cluster.cluster import ADMISSION, LocalCluster
from elasticlab.cluster.policies import EqualSharePolicy, batch_mode, make_policy, policy_names
from elasticlab.cluster.restart import RestartCost, measure_restart_cost
from elasticlab.cluster.scheduler import Scheduler
from elasticlab.cluster.spec import JobSpec
from elasticlab.cluster.view import LiveJob

__all__ = ["LocalCluster", "Scheduler", "JobSpec", "LiveJob", "RestartCost", "measure_restart_cost",
           "EqualSharePolicy", "make_policy", "policy_names", "batch_mode", "BATCH_MODE", "ADMISSION"]


def __getattr__(name):  # ``BATCH_MODE`` is read from the policies when asked
    if name == "BATCH_MODE":
        from elasticlab.cluster import policies

        return policies.BATCH_MODE
    if name == "RayCluster":  # the ``ray`` extra, imported only when asked for
        from elasticlab.cluster.ray import RayCluster

        return RayCluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
