"""RayJob: one elastic job as a gang of Ray actors forming one torch.distributed group per generation.

The job handle the scheduler drives (``status``, ``metrics``, ``events``, ``step_times``, ``resize``,
``set_batch``, ``pause``, ``resume``, ``stop``), as :class:`~elasticlab.elastic.ElasticJob` and
:class:`~elasticlab.cluster.torchrun.TorchrunJob` have it. A controller thread in the driver runs it:

* a *generation* is ``n`` actors (:class:`~elasticlab.cluster.ray.actor.RayWorker`) forming one gloo group
  (NCCL on GPUs) on the job's c10d store, hosted by the driver on its node's Ray address only (store.py);
* placement (:mod:`~elasticlab.cluster.ray.gang`): each generation reserves one placement group, a bundle
  per rank held to the node the allocator chose; a resize reuses the live actors on those nodes and starts
  only the missing ones (``warm`` idle actors are kept after a shrink, holding no slot);
* resize / pause: rank 0 is told at a step boundary (the step's all-reduce), checkpoints and every rank
  leaves; the next generation loads that checkpoint and the exactly-once sampler goes on from its cursor;
* fault: a worker dies (its node is gone) or raises -- the others leave the broken group (or are ended if
  stuck in it), and the job resumes from the
  newest valid checkpoint on the workers that remain; the steps since that checkpoint are replayed
  (counted in ``lost_steps``; the sample record keeps both, the later generation counts). With a sample
  record, the newest checkpoint whose steps the controller holds every rank's rows of (a dead actor's
  undrained rows are lost with it).

Checkpoints go to ``checkpoint_dir``, which every node must reach (a shared file system). This module holds
the handle and the requests; forming, draining and ending the generations is its base
:class:`~elasticlab.cluster.ray.generation.RayGenerations`.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from elasticlab.cluster.ray.gang import Gang
from elasticlab.cluster.ray.generation import RayGenerations
from elasticlab.cluster.ray.store import node_store
from elasticlab.elastic import messages as M
from elasticlab.elastic.checkpoint import CheckpointDir
from elasticlab.elastic.records import EventLog, RecordLog, step_time_rows
from elasticlab.elastic.states import TERMINAL, JobStatus, wait_terminal
from elasticlab.elastic.trainer import default_options


@dataclasses.dataclass(frozen=True, eq=False)
class RayJobStatus(JobStatus):
    """:meth:`RayJob.status`: the common fields, the Ray node of each rank, the faults and the steps they
    cost (replayed from the last checkpoint)."""

    nodes: tuple = ()
    faults: int = 0
    lost_steps: int = 0
    checkpoint_dir: str | None = None
    record_samples: str | None = None


class RayJob(RayGenerations):
    """A job run by Ray actors (see the module docstring). ``placement_of(n)`` gives the node id of each of
    ``n`` workers (the allocator's placement) or None (Ray chooses); ``resource``: the slot resource
    (``"GPU"`` on a GPU cluster: NCCL, one GPU per actor); ``coupled``: each actor holds its slot from
    its allocation's bundle (default: for ``"GPU"`` only; see :mod:`~elasticlab.cluster.ray.gang`)."""

    supports_batch = True

    def __init__(self, entrypoint: str, *, workers: int, checkpoint_dir: str, global_batch: int,
                 accum_steps: int = 0, entry_kwargs: dict | None = None, placement_of=None,
                 resource: str = "slot", record_samples: str | None = None, name: str = "job",
                 place_timeout_s: float = 30.0, start_timeout_s: float = 180.0, fault_grace_s: float = 5.0,
                 max_faults: int = 5, warm: int = 0, coupled: bool | None = None, **options):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if not (isinstance(resource, str) and resource):
            raise ValueError(f"resource must name a Ray resource (e.g. 'slot' or 'GPU'), got {resource!r}")
        self.entrypoint, self.entry_kwargs, self.name = entrypoint, dict(entry_kwargs or {}), name
        self.checkpoint_dir = CheckpointDir(checkpoint_dir)
        self.record_path = str(record_samples) if record_samples else None
        self.opts = default_options(**options, record_samples=bool(record_samples))
        self.resource, self._placement_of = resource, placement_of
        self.place_timeout_s, self.start_timeout_s = float(place_timeout_s), float(start_timeout_s)
        self.fault_grace_s, self.max_faults = float(fault_grace_s), int(max_faults)
        self._target, self._batch = workers, (int(global_batch), int(accum_steps))
        self._lock = threading.RLock()
        self._metrics, self._events = RecordLog(), EventLog()
        self._state, self._error = "new", None
        self._last: dict = {}
        self._gang = Gang(name, resource, entrypoint, self.entry_kwargs, self.opts, place_timeout_s,
                          start_timeout_s, warm, coupled)
        self._workers = self._gang.workers  # id -> {"actor", "node"}
        self._gen, self._ranks, self._runs = 0, [], {}  # generation, worker ids by rank, id -> run ref
        self._ended = None  # how the generation ended: "left", "finished", "fault"
        self._ckpt: str | None = None
        self._faults = self._lost = self._streak = self._seen = 0  # _seen: the last step any rank reported
        self._gen_start, self._recorded = 0, {}  # the generation's first step; each rank's rows reached
        self._suspect: set = set()  # nodes where a worker of this job died
        self._requests: list[dict] = []  # from the caller, taken by the controller thread
        self._pending: dict | None = None  # the request in flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._rec = None

    # ---- the job-handle interface ------------------------------------------------------------------
    def start(self) -> RayJob:
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"job already started (state {self._state!r})")
            self._state = "starting"
        self._store, self._host, self._port = node_store()
        if self.record_path:
            Path(self.record_path).parent.mkdir(parents=True, exist_ok=True)
            self._rec = open(self.record_path, "a")  # noqa: SIM115 (closed when the controller ends)
        self._thread = threading.Thread(target=self._main, name=f"ray-job-{self.name}", daemon=True)
        self._thread.start()
        return self

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def _request(self, kind: str, **info) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._state in TERMINAL:
                raise RuntimeError(f"cannot {kind}: the job is {self._state}")
            if self._pending is not None or self._requests:
                raise RuntimeError(f"cannot {kind}: a {(self._pending or self._requests[0])['kind']} is in "
                                   "flight")
            self._requests.append({"kind": kind, "fut": fut, "t0": time.perf_counter(), **info})
        return fut

    def resize(self, n: int, *, global_batch: int | None = None, accum_steps: int | None = None) -> Future:
        """Re-form the group at ``n`` workers (on the allocator's nodes) at a step boundary; the future gives
        ``{"world_size", "step", "latency_s"}`` once the first step at the new size is done."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"world size must be an integer >= 1, got {n!r}")
        if self.state not in ("running", "starting"):
            raise RuntimeError(f"cannot resize: the job is {self.state}")
        batch = None if global_batch is None else (int(global_batch), int(accum_steps or 0))
        return self._request("resize", n=n, batch=batch)

    def set_batch(self, global_batch: int, *, accum_steps: int = 0) -> Future:
        """Go on with ``(global_batch, accum_steps)`` after the next step (no re-forming)."""
        if global_batch < 1 or accum_steps < 0:
            raise ValueError(f"need global_batch >= 1 and accum_steps >= 0, got {global_batch}, "
                             f"{accum_steps}")
        if self.state != "running":
            raise RuntimeError(f"cannot set the batch: the job is {self.state}")
        return self._request("set_batch", batch=(int(global_batch), int(accum_steps)))

    def pause(self) -> Future:
        """Checkpoint at a step boundary and end every actor (their slots go back to the cluster)."""
        if self.state != "running":
            raise RuntimeError(f"cannot pause: the job is {self.state}")
        return self._request("pause")

    def resume(self, n: int | None = None) -> Future:
        """A new generation of ``n`` workers from the newest checkpoint."""
        if self.state != "paused":
            raise RuntimeError(f"cannot resume: the job is {self.state}, not paused")
        return self._request("resume", n=int(n or self._target))

    def stop(self, timeout: float = 10.0) -> None:
        """End every actor and the controller (a finished or failed job keeps its state)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            if self._state not in ("finished", "failed"):
                self._state = "stopped"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished, stopped or failed, and its controller thread ended (the sample
        record closed); True unless the timeout passed."""
        end = None if timeout is None else time.monotonic() + timeout
        if not wait_terminal(lambda: self.state, timeout):
            return False
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return True

    def status(self) -> RayJobStatus:
        with self._lock:
            r, running = self._last, self._state == "running"
            return RayJobStatus(
                state=self._state, world_size=int(r.get("world_size") or 0) if running else 0,
                target_world_size=self._target, step=r.get("step", 0), epoch=r.get("epoch", 0),
                loss=r.get("loss"), samples_per_s=r.get("samples_per_s"), global_batch=r.get("global_batch"),
                accum_steps=r.get("accum_steps"), per_worker_batch=r.get("per_worker_batch"),
                gns=r.get("gns"), generation=r.get("generation"), error=self._error,
                nodes=tuple(self._workers[w]["node"] for w in self._ranks if w in self._workers),
                faults=self._faults, lost_steps=self._lost, checkpoint_dir=str(self.checkpoint_dir.directory),
                record_samples=self.record_path)

    def nodes(self) -> list[str]:
        """The Ray node id of each rank of the current generation."""
        return list(self.status().nodes)

    def live_nodes(self) -> list[str]:
        """The node of each rank while a generation trains undisturbed: it has stepped, no request is in
        flight and none of its workers has ended; [] otherwise (between generations, during a resize or a
        fault, once the job is over). Steady while nobody sends the job a request (``RayCluster.hold``)."""
        with self._lock:
            if self._state != "running" or self._pending is not None or self._requests:
                return []
            if self._last.get("generation") != self._gen:
                return []
        ranks, runs = list(self._ranks), dict(self._runs)
        if self._ended is not None or not ranks or set(runs) != set(ranks):
            return []
        return [self._workers[w]["node"] for w in ranks if w in self._workers]

    def metrics(self, since: int = 0) -> list[dict]:
        return self._metrics.since(since)

    def events(self, since: int = 0) -> list[dict]:
        return self._events.since(since)

    def step_times(self, skip_first: int = 1, aggregate: bool = False) -> list[tuple]:
        """``(nodes, gpus, per_gpu_batch, accum_steps, iter_time)`` rows for the throughput-model fit."""
        return step_time_rows(self._metrics.since(0), skip_first, aggregate)

    # ---- requests and the controller thread (the generations: generation.py) ------------------------
    def _on_step(self, rec: dict) -> None:
        with self._lock:
            self._last = rec
            if self._state in ("starting",):
                self._state = "running"
            p = self._pending
        self._streak = 0
        self._seen = max(self._seen, int(rec["step"]))
        self._metrics.append(rec)
        if p is None:
            return
        if p["kind"] in ("resize", "resume") and p.get("sent") == "formed" and rec["world_size"] == p["got"]:
            lat = time.perf_counter() - p["t0"]
            if p["kind"] == "resume":       # a resume from pause: the elastic job's event kind "resumed"
                self._events.emit("resumed", world_size=p["got"], step=rec["step"], latency_s=lat)
            else:
                self._events.emit("resize", from_size=p.get("from_size"), to_size=p["got"], step=rec["step"],
                                  latency_s=lat)
            self._resolve({"world_size": p["got"], "step": rec["step"], "latency_s": lat})
        elif p["kind"] == "set_batch" and (rec["global_batch"], rec["accum_steps"]) == p["batch"]:
            self._events.emit("set_batch", global_batch=p["batch"][0], accum_steps=p["batch"][1])
            self._resolve({"global_batch": p["batch"][0], "accum_steps": p["batch"][1], "step": rec["step"]})

    def _resolve(self, result=None, error: Exception | None = None) -> None:
        with self._lock:
            p, self._pending = self._pending, None
        if p is not None and not p["fut"].done():
            p["fut"].set_exception(error) if error is not None else p["fut"].set_result(result)

    def _control(self, command, batch=(0, 0)) -> None:
        if self._ranks and self._ranks[0] in self._workers:
            self._workers[self._ranks[0]]["actor"].control.remote(M.Control(self._gen, command, *batch))

    def _main(self) -> None:
        try:
            self._form(self._target, self._batch, None)
            if self._gang.warm > len(self._ranks):  # idle workers ahead of the grows, on the slot nodes
                import ray

                self._gang.prestart([n["NodeID"] for n in ray.nodes() if n.get("Alive") and
                                     n.get("Resources", {}).get(self.resource, 0) >= 1])
            while not self._stop.is_set():
                self._take_request()
                self._pump()
                if self._ended is not None and (not self._runs or self._ended == "fault"):
                    if not self._next():
                        break
                time.sleep(0.05)
        except Exception as e:
            with self._lock:
                self._error = self._error or repr(e)
                self._state = "failed"
            self._events.emit("failed", message=repr(e))
        finally:
            self._resolve(error=RuntimeError(f"the job is {self.state}"))
            self._gang.close()
            if self._rec is not None:
                self._rec.close()
            self._store = None  # its server (and listening socket) goes with it
            with self._lock:
                if self._state not in TERMINAL:
                    self._state = "stopped"

    def _take_request(self) -> None:
        with self._lock:
            if self._pending is not None or not self._requests:
                return
            p = self._pending = self._requests.pop(0)
        ws = int(self._last.get("world_size") or 0)
        if p["kind"] in ("resize", "pause"):
            p["from_size"], p["sent"] = ws, "leave"
            self._control(M.CMD_LEAVE)
        elif p["kind"] == "set_batch":
            self._control(M.CMD_SET_BATCH, p["batch"])
        elif p["kind"] == "resume":
            p["from_size"], p["sent"], p["got"] = 0, "formed", p["n"]
            with self._lock:
                self._state = "running"
            path, _ = self.checkpoint_dir.latest()
            self._form(p["n"], None, str(path) if path is not None else None)
            p["got"] = len(self._ranks)
