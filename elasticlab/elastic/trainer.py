"""The training loop of one worker: :class:`Trainer` holds its state (model, optimizer, LR rule, GNS
estimator, sampler, step counter, RNG) and runs one synchronous data-parallel step at a time.

Every step ends with one all-reduce of ``[loss·n, Σ local |g|², n, control…]``: rank 0 puts the
controller's command (:class:`~elasticlab.elastic.messages.Command`) in it, so every rank sees the same
command after the same step. The drivers are in :mod:`elasticlab.elastic.worker`.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import random
import time

import numpy as np

from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.sampler import ElasticSampler, micro_batches
from elasticlab.elastic.scaling import make_gns, make_lr


def default_options(**over) -> dict:
    """The options a :class:`Trainer` and its drivers read, with ``over`` applied."""
    opts = {"seed": 0, "lr_rule": "constant", "ramp_per_k": 8, "epochs": 1, "max_steps": None,
            "checkpoint_every": 20, "keep_checkpoints": 3, "timeout_s": 30.0, "threads": 1,
            "record_samples": False, "step_delay_s": 0.0, "schedule": None, "device": None}
    opts.update(over)
    return opts


class Trainer:
    """One worker's training state and its synchronous data-parallel step."""

    def __init__(self, task, options: dict):
        import torch

        self.task, self.opts = task, options
        want = options.get("device")
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        cuda = torch.cuda.is_available() and want != "cpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.model = task.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = task.optimizer(self.params)
        self.sampler = ElasticSampler(len(task), seed=options["seed"])
        self.gns = make_gns(task.base_batch)
        self.lr = make_lr(self.optimizer, options["lr_rule"], task.base_batch, self.gns,
                          options["ramp_per_k"])
        self.batch = BatchConfig(task.base_batch, 0)
        self.step = 0
        self.rank, self.world_size, self.ddp, self.generation = 0, 1, None, 0
        self.norms = None
        self._psn = None
        self._probe = task.batch(np.arange(min(task.probe_size, len(task))))
        self._initial = self._snapshot()  # what a generation with no checkpoint to load starts from

    def _snapshot(self) -> bytes:
        """The trainer's state as checkpoint bytes (on the CPU, not beside the live model)."""
        import io

        import torch

        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return buf.getvalue()

    def reset(self) -> None:
        """Go back to the state right after construction: the task's initial model (built from the same
        seed in every worker), a fresh optimizer, step 0, the sampler at the first epoch's start. A warm
        worker that trained in an earlier generation thus starts exactly like a new one."""
        import io

        import torch

        self.load_state_dict(torch.load(io.BytesIO(self._initial), weights_only=True, map_location="cpu"))

    # ---- group membership -------------------------------------------------------------------
    def form(self, rank: int, world_size: int, store, generation, on_formed=None) -> None:
        """Join a process group of ``world_size`` through ``store`` (a fresh one per generation)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._use_device(rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            # torch names the default group after a process-wide counter (its store keys are
            # "<counter>/..."), raised by every init_process_group -- also by one that failed half-way
            # (a peer died while forming), which destroy_process_group then does not reset. A worker that
            # survived such a formation would wait on "1/..." keys while a fresh replacement writes
            # "0/...": the next group never forms. Every generation here starts from no group at all.
            distributed_c10d._world.group_count = 0
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=self.opts["timeout_s"]))
        if on_formed is not None:
            on_formed()
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self._wrap()

    def form_from_env(self, store=None) -> None:
        """Join the group torchrun describes in the environment (env:// rendezvous, or ``store`` with the
        environment's ``RANK`` and ``WORLD_SIZE``)."""
        import torch
        import torch.distributed as dist

        self._use_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        kw = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                       "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.opts["timeout_s"]), **kw)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._wrap()
        gen = torch.tensor([time.time_ns() // 1000], dtype=torch.int64, device=self.device)
        dist.broadcast(gen, 0)
        self.generation = int(gen.item())

    def _use_device(self, local_rank: int) -> None:
        """One GPU per rank (NCCL refuses two ranks on one device); the model follows."""
        import torch

        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            self.model.to(self.device)

    def _wrap(self) -> None:
        import torch

        from elasticlab.gns.ddp import ReplicaGradNorms

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.norms = ReplicaGradNorms(self.ddp)  # its comm hook records the local |g|^2 before averaging

    def leave(self) -> None:
        import torch.distributed as dist

        self.ddp = self.norms = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        import torch

        nps = np.random.get_state()
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_rule": self.lr.state_dict(), "gns": self.gns.state_dict(),
                "sampler": self.sampler.state_dict(), "step": self.step,
                "batch": {"global_batch": self.batch.global_batch, "accum_steps": self.batch.accum_steps},
                "rng": {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
                        "python_version": random.getstate()[0], "python_gauss": random.getstate()[2],
                        "numpy": torch.from_numpy(nps[1].astype(np.int64)), "numpy_pos": int(nps[2])}}

    def load_state_dict(self, s: dict) -> None:
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optimizer"])
        self.lr.load_state_dict(s["lr_rule"])
        self.gns.load_state_dict(s["gns"])
        self.sampler.load_state_dict(s["sampler"])
        self.step = int(s["step"])
        self.batch = BatchConfig(int(s["batch"]["global_batch"]), int(s["batch"]["accum_steps"]))
        self._restore_rng(s["rng"])

    def _restore_rng(self, rng: dict) -> None:
        import torch

        if self.rank == 0:
            torch.set_rng_state(rng["torch"])
            random.setstate((rng["python_version"], tuple(rng["python"]), rng["python_gauss"]))
            np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), rng["numpy_pos"]))
        else:  # other ranks: a stream derived from (seed, step, rank), the same on every replay
            seed = hash((self.opts["seed"], self.step, self.rank)) & 0x7FFFFFFF
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)

    def set_batch(self, batch: BatchConfig) -> None:
        if batch != self.batch:
            self.lr.on_batch_change(batch.global_batch)
            self.batch = batch

    def _per_example_norms(self):
        """Per-example gradient norms (:class:`elasticlab.gns.PerSampleGradNorms`) for the GNS on one
        worker, where there are no replicas to compare; None if the model has no layer it covers."""
        if self._psn is False:
            return None
        if self._psn is None:
            try:
                from elasticlab.gns import PerSampleGradNorms

                self._psn = PerSampleGradNorms(self.model, strict=False, fused=False)
                if self._psn.skipped:  # norms of part of the model would bias the estimate
                    self._psn = False
            except Exception:
                self._psn = False
        return self._psn or None

    def probe_loss(self) -> float:
        """Loss on a fixed batch (the first ``probe_size`` samples), eval mode, no gradient."""
        import torch

        was = self.model.training
        self.model.eval()
        with torch.no_grad():
            loss = float(self.task.loss_fn(self.model, _to(self._probe, self.device)))
        self.model.train(was)
        return loss

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self, control=(0, 0, 0)) -> tuple[dict, list[int], np.ndarray]:
        """One optimizer step at the current batch config; returns (record, control, my indices)."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        R, M, s = self.world_size, self.batch.global_batch, self.batch.accum_steps
        epoch = self.sampler.epoch
        n_global = len(self.sampler.step_indices(M))
        mine = self.sampler.shard(M, R, self.rank)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        model = self.ddp if self.ddp is not None else self.model
        per_example = R == 1 and n_global == M >= 2 and self._per_example_norms() is not None
        example_sq = []  # per-example ‖∇ℓ_i‖² of each micro-batch (one worker, with or without accumulation)
        for j, mb in enumerate(micro_batches(mine, s)):
            sync = j == s
            ctx = model.no_sync() if (not sync and self.ddp is not None) else contextlib.nullcontext()
            with ctx, (self._psn if per_example else contextlib.nullcontext()):
                if len(mb):
                    loss = self.task.loss_fn(model, _to(self.task.batch(mb), self.device))
                    weight = R * len(mb) / n_global
                    (loss * weight).backward()
                    loss_sum += float(loss.detach()) * len(mb)
                    if per_example:  # the norms are of the weighted loss: undo the weight
                        example_sq.append(self._psn.sq_norms() / weight ** 2)
                else:  # no sample left for this rank (epoch tail): a zero-weight pass keeps DDP in step
                    dummy = mine[:1] if len(mine) else np.arange(1)
                    loss = self.task.loss_fn(model, _to(self.task.batch(dummy), self.device))
                    (loss * 0.0).backward()
        if self.opts.get("step_delay_s"):
            time.sleep(self.opts["step_delay_s"])
        global_sq = float(sum(p.grad.detach().double().pow(2).sum() for p in self.params
                              if p.grad is not None))
        local_sq = global_sq
        if self.norms is not None:
            local_sq = self.norms.local_sq_norm
            self.norms.reset()
        # This replica's mean gradient ḡ_r over its b_r samples: its local gradient is (R·b_r/n)·ḡ_r.
        b_r = len(mine)
        mean_sq = local_sq * (n_global / (R * b_r)) ** 2 if b_r else 0.0
        vec = torch.tensor([loss_sum, mean_sq, 1.0 / b_r if b_r else 0.0, float(b_r > 0),
                            *map(float, control)], dtype=torch.float64, device=self.device)
        if self.ddp is not None:
            dist.all_reduce(vec)
        vec = vec.cpu()
        with self.lr.applied() as lrs:
            self.optimizer.step()
        lr = float(lrs[0])
        self.sampler.advance(M)
        self.step += 1
        n_rep = int(round(float(vec[3])))
        if R > 1 and n_rep >= 2:
            # Replica two-batch form (McCandlish App. A.1) with unequal replica batches b_r: the mean of
            # ‖ḡ_r‖² has expectation ‖G‖² + tr Σ·mean(1/b_r), so B_small is the harmonic mean of the b_r.
            b_small = n_rep / float(vec[2])
            if b_small < n_global:
                self.gns.update_two_batch(float(vec[1]) / n_rep, global_sq, b_small, n_global)
        elif per_example and example_sq:  # one worker: per-example form (McCandlish App. A.1, B_small = 1)
            self.gns.update(torch.cat(example_sq), global_sq)
        dt = time.perf_counter() - t0
        gns = self.gns.b_simple
        rec = {"step": self.step, "epoch": epoch, "time": time.time(), "loss": float(vec[0]) / n_global,
               "samples_per_s": n_global / dt, "step_time": dt, "world_size": R,
               "per_worker_batch": self.batch.per_worker_batch(R), "accum_steps": s, "global_batch": M,
               "samples": n_global, "lr": lr, "gns": gns if math.isfinite(gns) else None,
               "generation": self.generation}
        return rec, [int(round(float(v))) for v in vec[4:]], mine


def _to(batch, device):
    if device.type == "cpu":
        return batch
    return tuple(t.to(device, non_blocking=True) for t in batch)
