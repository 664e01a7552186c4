"""The worker processes' main functions; the training loop itself is :class:`~.trainer.Trainer`.

* :func:`pool_worker` — a long-lived process of an :class:`~elasticlab.elastic.job.ElasticJob`'s pool:
  it waits for a :class:`~.messages.Join`, forms a gloo/NCCL group on a fresh store, loads the checkpoint
  it was told to, trains until rank 0 relays :attr:`~.messages.Command.LEAVE` at a step boundary, then
  leaves the group and waits again (no re-import of torch on a resize).
* :func:`torchrun_main` — the same loop under ``torchrun`` (``--nnodes=MIN:MAX --rdzv_backend=c10d``):
  membership changes restart the workers, which resume from the newest valid checkpoint.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time

from elasticlab.elastic import messages as M
from elasticlab.elastic.checkpoint import CheckpointDir
from elasticlab.elastic.checkpoint import load as load_checkpoint
from elasticlab.elastic.messages import CMD_CHECKPOINT, CMD_LEAVE, CMD_NONE, CMD_SET_BATCH
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.sampler import read_record, recorded_through
from elasticlab.elastic.trainer import Trainer, default_options

__all__ = ["pool_worker", "torchrun_main", "run_generation", "Trainer", "default_options"]


# ---- the pool worker ---------------------------------------------------------------------------

def pool_worker(conn, worker_id: int, entrypoint: str, entry_kwargs: dict, options: dict) -> None:
    """Main function of a long-lived worker process (see the module docstring)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops the job
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # gloo's sockets on the loopback interface: by default gloo binds the address the host name resolves
    # to (possibly an external one); a pool's workers are all on this machine.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", options.get("gloo_ifname") or "lo")
    # c10d's TCPStore client formats its socket addresses with getnameinfo(), a reverse DNS lookup of
    # ::ffff:127.0.0.1 that /etc/hosts does not answer; when the DNS reply is lost, glibc waits its
    # default 5 s before retrying -- issue 16's 5.05 s resizes. One try of 1 s instead, and c10d stops
    # looking names up in this process after the first lookup that fails (benchmarks/bench_resize.py
    # --store-connect measures it).
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    import torch

    torch.set_num_threads(int(options.get("threads", 1)))
    import elasticlab.gns.ddp  # noqa: F401  (imported now, not on the first join: resizes stay fast)
    from elasticlab.elastic.task import EntrypointError, build

    torch.manual_seed(options["seed"])
    try:
        trainer = Trainer(build(entrypoint, entry_kwargs), options)
    except Exception as e:  # report instead of dying silently
        tb = "" if isinstance(e, EntrypointError) else _format_tb(e)     # the message names the bad value
        conn.send(M.Error(worker_id, None, f"building the task failed: {e!r}", "build", tb))
        return
    conn.send(M.Ready(worker_id, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the controller is gone: exit rather than linger as an orphan
            return
        if isinstance(msg, M.Exit):
            return
        if not isinstance(msg, M.Join):
            continue
        gen = msg.generation
        try:
            run_generation(trainer, conn, msg)
        except Exception as e:
            kind, path = getattr(e, "elastic_kind", None) or error_kind(e), getattr(e, "elastic_path", None)
            with contextlib.suppress(Exception):
                conn.send(M.Error(worker_id, gen, f"{e!r}", kind, _format_tb(e), path))
        finally:
            trainer.leave()
        with contextlib.suppress(Exception):
            conn.send(M.Idle(worker_id, gen))


def _format_tb(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(e)).strip()


def error_kind(e: BaseException) -> str:
    """``"comm"`` for a failure of a collective or of the store under the training step (a peer died or
    left, a timeout), else ``"task"`` (see :data:`~.messages.ERROR_KINDS`)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return "comm"
    text = str(e)
    if isinstance(e, RuntimeError) and any(s in text for s in (
            "gloo/transport", "Connection reset by peer", "Connection closed by peer", "ProcessGroupGloo",
            "ProcessGroupNCCL", "NCCL error", "c10d")):
        return "comm"
    return "task"


def _tag(e: BaseException, kind: str, path: str | None = None) -> BaseException:
    e.elastic_kind, e.elastic_path = kind, path
    return e


def _fault_point(opts: dict, point: str, gen: int, rank: int) -> None:
    """Fault injection for tests and the soak: ``options["inject_faults"]`` is a list of
    ``(point, generation, rank)``; the worker SIGKILLs itself when it reaches a listed one. Points:
    ``joined`` (Join received), ``store`` (connected to the store), ``formed`` (process group formed),
    ``wrapped`` (DDP built), ``loaded`` (checkpoint loaded, before the first step), ``stepped:N`` (step N
    trained -- its all-reduce and update done -- before its sample rows are sent)."""
    for p, g, r in opts.get("inject_faults") or ():
        if p == point and g == gen and r == rank:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


def _save(ckdir: CheckpointDir, tr: Trainer):
    try:
        return ckdir.save(tr.state_dict(), tr.step)
    except OSError as e:  # unwritable, vanished or full checkpoint directory
        raise _tag(e, "checkpoint_io") from None


def run_generation(tr: Trainer, conn, j: M.Join) -> None:
    """Train as one rank of generation ``j.generation`` until it ends (leave, finish or an error)."""
    import torch.distributed as dist

    gen, rank, world = j.generation, j.rank, j.world_size
    opts = tr.opts
    _fault_point(opts, "joined", gen, rank)
    state = None
    if j.checkpoint:  # read before joining: an unloadable file is reported before anyone waits on us
        try:
            state = load_checkpoint(j.checkpoint)
        except Exception as e:
            raise _tag(e, "checkpoint_load", j.checkpoint) from None
    t0 = time.perf_counter()
    try:
        store = dist.TCPStore(j.host, j.port, is_master=False,
                              timeout=datetime.timedelta(seconds=opts["timeout_s"]))
        _fault_point(opts, "store", gen, rank)
        tr.form(rank, world, dist.PrefixStore(f"gen{gen}/", store), gen, on_formed=lambda: _fault_point(
            opts, "formed", gen, rank))
    except Exception as e:
        raise _tag(e, "formation") from None
    formed_s = time.perf_counter() - t0
    _fault_point(opts, "wrapped", gen, rank)
    try:
        ckdir = CheckpointDir(j.checkpoint_dir, keep=opts["keep_checkpoints"])
    except OSError as e:
        raise _tag(e, "checkpoint_io") from None
    if state is not None:
        try:
            tr.load_state_dict(state)
        except Exception as e:  # a state that does not fit this task (keys, shapes)
            raise _tag(e, "checkpoint_load", j.checkpoint) from None
    else:  # no checkpoint: every rank from the task's initial state, whatever it trained before
        tr.reset()
    if j.batch:
        tr.set_batch(BatchConfig(*j.batch))
    _fault_point(opts, "loaded", gen, rank)
    if rank == 0:
        conn.send(M.Resumed(gen, tr.step, tr.probe_loss(), j.checkpoint, formed_s,
                            str(dist.get_backend()) if dist.is_initialized() else None))
        if not j.checkpoint:  # a step-0 checkpoint, so that every later one can resume
            path = _save(ckdir, tr)
            conn.send(M.Checkpointed(gen, tr.step, str(path), None, "initial"))
    epochs, max_steps = opts["epochs"], opts["max_steps"]
    every = opts["checkpoint_every"]
    schedule = {int(k): int(v) for k, v in (opts.get("schedule") or {}).items()}
    while True:
        if tr.sampler.epoch >= epochs or (max_steps is not None and tr.step >= max_steps):
            if rank == 0:
                path = _save(ckdir, tr)
                conn.send(M.Finished(gen, tr.step, str(path), tr.probe_loss()))
            return
        control = (CMD_NONE, 0, 0)
        if rank == 0 and conn.poll():
            msg = conn.recv()
            if isinstance(msg, M.Control) and msg.generation == gen:  # an aborted generation's is dropped
                control = msg.vector
        if rank == 0 and control[0] == CMD_NONE and schedule.get(tr.step + 1, world) != world:
            # a scheduled resize after step tr.step+1: leave after it, and tell the controller the size
            conn.send(M.Scheduled(gen, tr.step + 1, schedule[tr.step + 1]))
            control = (CMD_LEAVE, 0, 0)
        rec, cmd, mine = tr.train_step(control)
        if opts.get("inject_faults"):
            _fault_point(opts, f"stepped:{tr.step}", gen, rank)
        if opts["record_samples"]:
            conn.send(M.Samples({"epoch": rec["epoch"], "step": rec["step"], "rank": rank,
                                 "world_size": world, "indices": mine.tolist(), "generation": gen}))
        if rank == 0:
            conn.send(M.Step(rec))
        code = cmd[0]
        if code == CMD_SET_BATCH:
            tr.set_batch(BatchConfig(cmd[1], cmd[2]))
        if code == CMD_LEAVE:
            if rank == 0:
                probe = tr.probe_loss()
                path = _save(ckdir, tr)
                conn.send(M.Checkpointed(gen, tr.step, str(path), probe, "leave"))
                conn.send(M.Left(gen, tr.step))
            return
        if rank == 0 and (code == CMD_CHECKPOINT or (every and tr.step % every == 0)):
            path = _save(ckdir, tr)
            conn.send(M.Checkpointed(gen, tr.step, str(path), None, "periodic"))


# ---- torchrun ------------------------------------------------------------------------------------
def _recorded_through(record_samples: str | None, tr: Trainer) -> int | None:
    """:func:`~.sampler.recorded_through` of the sample record (shared by every rank, like the checkpoint
    folder), the same on every rank: the smallest any rank read (a line cut short by a death is passed
    over). None without a record."""
    import torch
    import torch.distributed as dist

    if not record_samples:
        return None
    through = recorded_through(read_record(record_samples, missing_ok=True, lenient=True))
    if tr.world_size > 1:
        t = torch.tensor([-1 if through is None else through], dtype=torch.int64, device=tr.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        through = None if int(t) < 0 else int(t)
    return through


def torchrun_main(entrypoint, *, checkpoint_dir: str, record_samples: str | None = None,
                  entry_kwargs: dict | None = None, **options) -> dict:
    """Train ``entrypoint``'s task as one torchrun worker; resume from the newest valid checkpoint.

    Run under ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
    --local-addr=127.0.0.1`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see
    :mod:`elasticlab.cluster.torchrun`): on a membership change torchrun restarts every worker at the new
    world size and each one resumes here, losing at most the steps since the last checkpoint. A SIGTERM
    (how torchrun stops workers before a restart) is relayed through the step's all-reduce: every rank
    stops at the same step boundary after rank 0 has checkpointed, so a planned membership change loses no
    step. With ``record_samples`` (one file for every rank, like the checkpoint folder) a restart goes on
    from the newest checkpoint at or before the record's last step with every rank's rows, so the rows of a
    rank killed between a step's update and their write are not lost: that step runs again. Rank 0 prints
    one JSON line per step on stdout when ``options["log_steps"]`` is set; the return
    value summarises the run. The group's store listens on ``MASTER_ADDR`` only
    (:func:`~elasticlab.elastic.rendezvous.worker_store`); a non-loopback ``MASTER_ADDR`` needs
    ``$ELASTICLAB_TORCHRUN_TOKEN``. Under torch's shared agent store (the variable unset) the agent's
    store listens on every interface: a warning says so.
    """
    import signal
    import warnings

    import torch

    from elasticlab.elastic.rendezvous import worker_store
    from elasticlab.elastic.task import build

    log_steps = options.pop("log_steps", False)
    opts = default_options(**options)
    torch.set_num_threads(opts["threads"])
    torch.manual_seed(opts["seed"])
    tr = Trainer(build(entrypoint, entry_kwargs), opts)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn("torchrun's agent hosts the workers' store, listening on every interface: set "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a store bound to MASTER_ADDR only",
                      stacklevel=2)
        tr.form_from_env()
    else:
        tr.form_from_env(store=worker_store(opts["timeout_s"]))
    ckdir = CheckpointDir(checkpoint_dir, keep=opts["keep_checkpoints"])
    through = _recorded_through(record_samples, tr)
    path, bad, gap = ckdir.latest_recorded(through)  # gap: the newest, and the record misses rows
    if path is not None:
        tr.load_state_dict(load_checkpoint(path))
    elif tr.rank == 0:  # a step-0 checkpoint, as the local job's: a restart before the first periodic one
        ckdir.save(tr.state_dict(), tr.step)  # resumes there, not past a step whose rows were lost
    rec_fd = None
    if record_samples:
        rec_fd = os.open(record_samples, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    every = opts["checkpoint_every"]
    resumed = tr.step
    if tr.rank == 0:
        print(json.dumps({"event": "resume", "step": tr.step, "world_size": tr.world_size,
                          "checkpoint": str(path) if path else None, "corrupt": [str(p) for p, _ in bad],
                          "recorded_through": through, "time": time.time()}), flush=True)
        if gap:
            print(json.dumps({"event": "record_gap", "recorded_through": through, "checkpoint": str(path),
                              "time": time.time()}), flush=True)
    stop_requested = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    try:
        max_steps = opts["max_steps"]
        while tr.sampler.epoch < opts["epochs"] and (max_steps is None or tr.step < max_steps):
            rec, cmd, mine = tr.train_step((CMD_LEAVE, 0, 0) if stop_requested else (CMD_NONE, 0, 0))
            if opts.get("inject_faults"):  # the generation of a fault point: torchrun's restart count
                _fault_point(opts, f"stepped:{tr.step}", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                             tr.rank)
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
