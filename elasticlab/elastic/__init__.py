"""Live-resizing local DDP jobs (elasticlab's runtime; cf. ``torch.distributed.elastic``).

* :class:`ElasticJob` (job.py) — the controller in the caller's process: start/resize/pause/resume/stop,
  status/metrics/events, non-blocking; its thread is controller.py (generations in generation.py, faults in
  faults.py), its requests requests.py, its batch decisions adaptation.py, its processes pool.py.
* states.py — :class:`JobState` and its transitions, :class:`JobStatus` (what ``status()`` returns).
* messages.py — the typed messages between the job and its workers, and the step commands.
* worker.py — each worker process's main (pool worker and ``torchrun`` entry); trainer.py — the
  training loop (:class:`~elasticlab.elastic.trainer.Trainer`).
* :class:`ElasticSampler` (sampler.py) — exactly-once sample order across resizes.
* checkpoint.py — atomic, checksummed checkpoints with fallback.
* policies.py — batch policies (fixed global, fixed per-worker + Dynamic SGD, goodput-adaptive).
* scaling.py — the GNS estimator and LR rule the workers carry; records.py — metrics/event logs.
* task.py — :class:`Task`, what an entrypoint returns.
"""
from elasticlab.elastic.checkpoint import CheckpointDir, CheckpointError
from elasticlab.elastic.job import ElasticJob
from elasticlab.elastic.policies import BatchConfig, FixedGlobalBatch, FixedPerWorkerBatch, GoodputAdaptive
from elasticlab.elastic.sampler import ElasticSampler, check_exactly_once, effective_rows
from elasticlab.elastic.states import JobState, JobStatus
from elasticlab.elastic.task import Task

__all__ = ["ElasticJob", "Task", "ElasticSampler", "check_exactly_once", "effective_rows", "CheckpointDir",
           "CheckpointError", "BatchConfig", "FixedGlobalBatch", "FixedPerWorkerBatch", "GoodputAdaptive",
           "JobState", "JobStatus"]
