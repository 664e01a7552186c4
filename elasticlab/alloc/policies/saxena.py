"""Saxena et al.'s batch-elastic autoscaler (MASCOTS 2020): total throughput over GPU counts and batch sizes.

Each job's utility at g GPUs is its best throughput over batch sizes in [M0, max batch] (the batch folded
into the utility), normalised by its 1-GPU value; the DP maximises the sum over admitted jobs (>= 1 GPU each,
FIFO admission with a waiting queue). Jobs then run at that throughput-maximising batch.
"""
from __future__ import annotations

from elasticlab.alloc.policies.gpu_elastic import ThroughputDPPolicy


class SaxenaPolicy(ThroughputDPPolicy):
    name = "saxena"
    batch_mode = "throughput"
    live = True
