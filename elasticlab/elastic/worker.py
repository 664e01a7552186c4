"""The training loop that runs in every worker process: step boundaries, checkpoints, resume.

:class:`Trainer` holds one worker's state (model, optimizer, LR rule, GNS estimator, sampler, step
counter, RNG) and runs one synchronous DDP step at a time. Two drivers use it:

* :func:`pool_worker` — a long-lived process of an :class:`~elasticlab.elastic.job.ElasticJob`'s pool:
  it waits for a ``join`` message, forms a gloo/NCCL group on a fresh store, loads the checkpoint it was
  told to, trains until rank 0 relays ``leave`` at a step boundary, then leaves the group and waits
  again (no re-import of torch on a resize).
* :func:`torchrun_main` — the same loop under ``torchrun`` (``--nnodes=MIN:MAX --rdzv_backend=c10d``):
  membership changes restart the workers, which resume from the newest valid checkpoint.

Every step ends with one all-reduce of ``[loss·n, Σ local |g|², n, control…]``: rank 0 puts the
controller's command in it, so every rank sees the same command after the same step.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import random
import time

import numpy as np

from elasticlab.elastic.checkpoint import CheckpointDir
from elasticlab.elastic.checkpoint import load as load_checkpoint
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.sampler import ElasticSampler, micro_batches
from elasticlab.elastic.scaling import make_gns, make_lr

# Control codes relayed by rank 0 through the per-step all-reduce.
CMD_NONE, CMD_LEAVE, CMD_SET_BATCH, CMD_CHECKPOINT = 0, 1, 2, 3


def default_options(**over) -> dict:
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

    # ---- group membership -------------------------------------------------------------------
    def form(self, rank: int, world_size: int, store, generation) -> None:
        """Join a process group of ``world_size`` through ``store`` (a fresh one per generation)."""
        import torch.distributed as dist

        self._use_device(rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=self.opts["timeout_s"]))
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self._wrap()

    def form_from_env(self) -> None:
        """Join the group torchrun describes in the environment (env:// rendezvous)."""
        import torch
        import torch.distributed as dist

        self._use_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.opts["timeout_s"]))
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


# ---- the pool worker ---------------------------------------------------------------------------

def pool_worker(conn, worker_id: int, entrypoint: str, entry_kwargs: dict, options: dict) -> None:
    """Main function of a long-lived worker process (see the module docstring)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops the job
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    import torch

    torch.set_num_threads(int(options.get("threads", 1)))
    import elasticlab.gns.ddp  # noqa: F401  (imported now, not on the first join: resizes stay fast)
    from elasticlab.elastic.task import build

    torch.manual_seed(options["seed"])
    try:
        trainer = Trainer(build(entrypoint, entry_kwargs), options)
    except Exception as e:  # report instead of dying silently
        conn.send(("error", worker_id, None, f"building the task failed: {e!r}"))
        return
    conn.send(("ready", worker_id, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the controller is gone: exit rather than linger as an orphan
            return
        if msg[0] == "exit":
            return
        if msg[0] != "join":
            continue
        gen = msg[1]["generation"]
        try:
            _run_generation(trainer, conn, worker_id, msg[1])
        except Exception as e:
            import traceback

            where = "".join(traceback.format_exception(e)[-3:]).strip()
            with contextlib.suppress(Exception):
                conn.send(("error", worker_id, gen, f"{e!r}\n{where}"))
        finally:
            trainer.leave()
        with contextlib.suppress(Exception):
            conn.send(("idle", worker_id, gen))


def _run_generation(tr: Trainer, conn, worker_id: int, j: dict) -> None:
    import torch
    import torch.distributed as dist

    gen, rank, world = j["generation"], j["rank"], j["world_size"]
    store = dist.TCPStore("127.0.0.1", j["port"], is_master=False,
                          timeout=datetime.timedelta(seconds=tr.opts["timeout_s"]))
    tr.form(rank, world, dist.PrefixStore(f"gen{gen}/", store), gen)
    ckdir = CheckpointDir(j["checkpoint_dir"], keep=tr.opts["keep_checkpoints"])
    if j.get("checkpoint"):
        tr.load_state_dict(load_checkpoint(j["checkpoint"]))
    else:
        torch.manual_seed(tr.opts["seed"])
    if j.get("batch"):
        tr.set_batch(BatchConfig(*j["batch"]))
    if rank == 0:
        conn.send(("resumed", gen, tr.step, tr.probe_loss(), j.get("checkpoint")))
        if not j.get("checkpoint"):  # a generation-0 checkpoint, so that every later one can resume
            path = ckdir.save(tr.state_dict(), tr.step)
            conn.send(("checkpoint", gen, tr.step, str(path), None, "initial"))
    epochs, max_steps = tr.opts["epochs"], tr.opts["max_steps"]
    every = tr.opts["checkpoint_every"]
    schedule = {int(k): int(v) for k, v in (tr.opts.get("schedule") or {}).items()}
    while True:
        if tr.sampler.epoch >= epochs or (max_steps is not None and tr.step >= max_steps):
            if rank == 0:
                path = ckdir.save(tr.state_dict(), tr.step)
                conn.send(("finished", gen, tr.step, str(path), tr.probe_loss()))
            return
        control = (CMD_NONE, 0, 0)
        if rank == 0 and conn.poll():
            msg = conn.recv()
            if msg[0] == "ctl" and msg[1] == gen:  # a control left over from an aborted generation is dropped
                control = tuple(msg[2:])
        if rank == 0 and control[0] == CMD_NONE and schedule.get(tr.step + 1, world) != world:
            # a scheduled resize after step tr.step+1: leave after it, and tell the controller the size
            conn.send(("schedule", gen, tr.step + 1, schedule[tr.step + 1]))
            control = (CMD_LEAVE, 0, 0)
        rec, cmd, mine = tr.train_step(control)
        if tr.opts["record_samples"]:
            conn.send(("samples", {"epoch": rec["epoch"], "step": rec["step"], "rank": rank,
                                   "world_size": world, "indices": mine.tolist(), "generation": gen}))
        if rank == 0:
            conn.send(("step", rec))
        code = cmd[0]
        if code == CMD_SET_BATCH:
            tr.set_batch(BatchConfig(cmd[1], cmd[2]))
        if code == CMD_LEAVE:
            if rank == 0:
                probe = tr.probe_loss()
                path = ckdir.save(tr.state_dict(), tr.step)
                conn.send(("checkpoint", gen, tr.step, str(path), probe, "leave"))
                conn.send(("left", gen, tr.step))
            return
        if rank == 0 and (code == CMD_CHECKPOINT or (every and tr.step % every == 0)):
            path = ckdir.save(tr.state_dict(), tr.step)
            conn.send(("checkpoint", gen, tr.step, str(path), None, "periodic"))


# ---- torchrun ------------------------------------------------------------------------------------

def torchrun_main(entrypoint, *, checkpoint_dir: str, record_samples: str | None = None,
                  entry_kwargs: dict | None = None, **options) -> dict:
    """Train ``entrypoint``'s task as one torchrun worker; resume from the newest valid checkpoint.

    Run under ``torchrun --nnodes=MIN:MAX --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT``: on a
    membership change torchrun restarts every worker at the new world size and each one resumes here,
    losing at most the steps since the last checkpoint. A SIGTERM (how torchrun stops workers before a
    restart) is relayed through the step's all-reduce: every rank stops at the same step boundary after
    rank 0 has checkpointed, so a planned membership change loses no step. Rank 0 prints one JSON line
    per step on stdout when ``options["log_steps"]`` is set; the return value summarises the run.
    """
    import signal

    import torch

    from elasticlab.elastic.task import build

    log_steps = options.pop("log_steps", False)
    opts = default_options(**options)
    torch.set_num_threads(opts["threads"])
    torch.manual_seed(opts["seed"])
    tr = Trainer(build(entrypoint, entry_kwargs), opts)
    tr.form_from_env()
    ckdir = CheckpointDir(checkpoint_dir, keep=opts["keep_checkpoints"])
    path, bad = ckdir.latest()
    if path is not None:
        tr.load_state_dict(load_checkpoint(path))
    rec_fd = None
    if record_samples:
        rec_fd = os.open(record_samples, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    every = opts["checkpoint_every"]
    resumed = tr.step
    if tr.rank == 0:
        print(json.dumps({"event": "resume", "step": tr.step, "world_size": tr.world_size,
                          "checkpoint": str(path) if path else None, "corrupt": [str(p) for p, _ in bad],
                          "time": time.time()}), flush=True)
    stop_requested = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    try:
        max_steps = opts["max_steps"]
        while tr.sampler.epoch < opts["epochs"] and (max_steps is None or tr.step < max_steps):
            rec, cmd, mine = tr.train_step((CMD_LEAVE, 0, 0) if stop_requested else (CMD_NONE, 0, 0))
            if rec_fd is not None:
                os.write(rec_fd, (json.dumps({"epoch": rec["epoch"], "step": rec["step"], "rank": tr.rank,
                                              "world_size": tr.world_size, "indices": mine.tolist(),
                                              "generation": tr.generation}) + "\n").encode())
            if tr.rank == 0:
                if log_steps:
                    print(json.dumps({"event": "step", **rec}), flush=True)
                if every and tr.step % every == 0 and cmd[0] == CMD_NONE:
                    ckdir.save(tr.state_dict(), tr.step)
            if cmd[0] != CMD_NONE:  # a rank got SIGTERM (the sum counts them): checkpoint, leave together
                if tr.rank == 0:
                    print(json.dumps({"event": "leave", "step": tr.step, "time": time.time()}), flush=True)
                break
        if tr.rank == 0:
            ckdir.save(tr.state_dict(), tr.step)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if rec_fd is not None:
            os.close(rec_fd)
        tr.leave()
    return {"steps": tr.step, "resumed_from": resumed, "world_size": tr.world_size,
            "stopped_early": bool(stop_requested)}
