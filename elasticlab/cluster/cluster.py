"""LocalCluster: a pool of worker slots on this machine shared by several live elastic jobs.

The scheduling loop is :class:`~elasticlab.cluster.scheduler.Scheduler` (rounds, policies, requests,
event log; shared with the Ray backend, :mod:`elasticlab.cluster.ray`). This module adds the local pool:
``slots`` slots on one node, each job an :class:`~elasticlab.elastic.ElasticJob` (a warm pool of worker
processes re-forming gloo groups) or torchrun agents (``JobSpec(backend="torchrun")``, one c10d agent per
slot, :mod:`elasticlab.cluster.torchrun`).
"""
from __future__ import annotations

from pathlib import Path

from elasticlab.checks import whole
from elasticlab.cluster.scheduler import ADMISSION, Scheduler
from elasticlab.cluster.spec import JobSpec
from elasticlab.cluster.view import LiveJob
from elasticlab.elastic.policies import BatchConfig

__all__ = ["ADMISSION", "LocalCluster"]


def _start_elastic_job(spec: JobSpec, n: int, batch: BatchConfig, slots: int, workdir: Path):
    """The default job launcher: an :class:`~elasticlab.elastic.ElasticJob` on this machine, or torchrun
    agents for ``backend="torchrun"``."""
    from elasticlab.elastic import ElasticJob, FixedGlobalBatch

    if spec.backend == "torchrun":
        from elasticlab.cluster.torchrun import start_torchrun_job

        return start_torchrun_job(spec, n, batch, slots, workdir)

    ckpt = workdir / spec.name
    ckpt.mkdir(parents=True, exist_ok=True)
    record = spec.record_samples
    if record is True:
        record = str(ckpt / "samples.jsonl")
    job = ElasticJob(spec.entrypoint, workers=n, entry_kwargs=spec.entry_kwargs,
                     policy=FixedGlobalBatch(batch.global_batch, spec.per_slot_batch[1], spec.lr_rule),
                     epochs=spec.epochs, max_steps=spec.max_steps, slots=slots, warm=max(spec.warm, n),
                     checkpoint_dir=str(ckpt), checkpoint_every=spec.checkpoint_every, record_samples=record,
                     seed=spec.seed, timeout_s=spec.timeout_s, lr_rule=spec.lr_rule,
                     goodput_refit_s=REFIT_S)
    return job.start()


#: How often a cluster's job refits its throughput model, s: about once a scheduling round, so that the
#: policies see a model as fresh as the step times (the job publishes it; the cluster does not refit).
REFIT_S = 1.0


class LocalCluster(Scheduler):
    """A pool of ``slots`` worker slots on this machine scheduled by ``policy`` (see
    :mod:`elasticlab.cluster.policies`); the other arguments are :class:`Scheduler`'s. ``launcher(spec, n,
    batch, slots, workdir)`` starts a job handle (default: an ElasticJob, or torchrun agents)."""

    def __init__(self, slots: int = 4, policy: str = "goodput", interval: float = 2.0, *, launcher=None,
                 **kwargs):
        self.slots = whole("slots", slots, 1, "an integer >= 1")
        self._launch = launcher or _start_elastic_job
        super().__init__(policy, interval, **kwargs)

    def _launch_job(self, j: LiveJob, n: int, batch: BatchConfig):
        return self._launch(j.spec, n, batch, self.slots, self.workdir)
