"""RayCluster: the scheduling loop of :class:`~elasticlab.cluster.scheduler.Scheduler` over Ray nodes.

The policies see the Ray cluster as the simulator's shape: the alive nodes that have the slot resource
(``"slot"``, a custom resource, in tests; ``"GPU"`` on a GPU cluster), each with its count of that
resource (``Cluster(num_nodes, slots_per_node)``). After each round, :func:`elasticlab.alloc.placement.place`
turns the jobs' slot counts into per-node counts (jobs whose count did not change keep their nodes), and a
job's next generation takes exactly those nodes (:class:`~elasticlab.cluster.ray.job.RayJob`). A node that
disappears is noticed every ``node_poll_s``: the capacity drops, its jobs resume from their checkpoints on
the nodes that remain (their own fault path) and the next round re-allocates.
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

from elasticlab.alloc.placement import place
from elasticlab.cluster.scheduler import Scheduler, Shape
from elasticlab.cluster.view import TERMINAL, LiveJob
from elasticlab.elastic.policies import BatchConfig


def connect(address: str | None = "auto", **init_kwargs) -> bool:
    """``ray.init(address)`` unless Ray is initialised already: ``"auto"`` joins the cluster this machine
    belongs to (``ray start``), an address ``host:port`` that one, None starts a local Ray. Returns whether
    this call initialised Ray."""
    import ray

    if ray.is_initialized():
        return False
    init_kwargs.setdefault("log_to_driver", False)
    init_kwargs.setdefault("include_dashboard", False)
    ray.init(address=address, **init_kwargs)
    return True


def ray_nodes(resource: str = "slot") -> list[dict]:
    """The alive Ray nodes that have ``resource``: ``{"node_id", "ip", "slots"}``, in Ray's order."""
    import ray

    out = []
    for n in ray.nodes():
        k = int(n.get("Resources", {}).get(resource, 0))
        if n.get("Alive") and k > 0:
            out.append({"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "slots": k})
    return out


class RayCluster(Scheduler):
    """The autoscaler over a Ray cluster (see the module docstring).

    ``address``: ``"auto"`` (a running cluster), ``"host:port"``, or None (start a local Ray); ignored when
    Ray is initialised already. ``resource``: what a slot is. ``workdir``: checkpoints (every node must
    reach it: a shared file system on a real cluster) and sample records. The other arguments are
    :class:`~elasticlab.cluster.scheduler.Scheduler`'s; ``job_kwargs`` go to each
    :class:`~elasticlab.cluster.ray.job.RayJob` (e.g. ``fault_grace_s``)."""

    def __init__(self, policy: str = "goodput", interval: float = 2.0, *, address: str | None = "auto",
                 resource: str = "slot", node_poll_s: float = 1.0, init_kwargs: dict | None = None,
                 job_kwargs: dict | None = None, **kwargs):
        if not (isinstance(resource, str) and resource):
            raise ValueError(f"resource must name a Ray resource (e.g. 'slot' or 'GPU'), got {resource!r}")
        self._own_ray = connect(address, **(init_kwargs or {}))
        self.resource = resource
        self.node_poll_s = float(node_poll_s)
        self.job_kwargs = dict(job_kwargs or {})
        self._nodes = ray_nodes(resource)
        if not self._nodes:
            raise ValueError(f"no alive Ray node has the resource {resource!r}; start the nodes with "
                             f"resources={{{resource!r}: N}} (or name the resource they have)")
        self.slots = sum(n["slots"] for n in self._nodes)
        self._plan: dict[str, list[str]] = {}
        self._last_scan = time.monotonic()
        self._apply_lock, self._held = threading.Lock(), False
        super().__init__(policy, interval, **kwargs)

    @contextlib.contextmanager
    def hold(self):
        """While inside: the loop sends the jobs no request (no resize, pause, resume, set_batch, start);
        a request already sent runs on. Rounds are still decided and applied after. For a test or a
        benchmark that needs the jobs' placement to stay put (e.g. to remove a node a job trains on)."""
        with self._apply_lock:  # an _apply under way finishes first
            self._held = True
        try:
            yield self
        finally:
            with self._apply_lock:
                self._held = False

    def _apply(self, now: float) -> None:
        with self._apply_lock:
            if not self._held:
                super()._apply(now)

    # ---- what the policies and the panel see ---------------------------------------------------------
    def nodes(self) -> list[dict]:
        """The alive nodes with the slot resource: ``{"node_id", "ip", "slots", "jobs": {job: workers}}``."""
        with self._lock:
            nodes = [dict(n) for n in self._nodes]
            handles = {j.name: j.handle for j in self._jobs.values()
                       if j.handle is not None and j.state not in TERMINAL}
        for n in nodes:
            n["jobs"] = {}
        by_id = {n["node_id"]: n for n in nodes}
        for name, h in handles.items():
            for node in h.nodes():
                if node in by_id:
                    by_id[node]["jobs"][name] = by_id[node]["jobs"].get(name, 0) + 1
        return nodes

    def shape(self) -> Shape:
        with self._lock:
            nodes = list(self._nodes)
        if not nodes:
            return Shape(1, 1)
        return Shape(len(nodes), max(n["slots"] for n in nodes))

    def metrics(self) -> dict:
        out = super().metrics()
        out["nodes"] = len(self._nodes)
        return out

    # ---- backend hooks -------------------------------------------------------------------------------
    def _observe(self, now: float) -> None:
        if time.monotonic() - self._last_scan < self.node_poll_s:
            return
        self._last_scan = time.monotonic()
        nodes = ray_nodes(self.resource)
        old, new = {n["node_id"] for n in self._nodes}, {n["node_id"] for n in nodes}
        if old != new:
            with self._lock:
                self._nodes = nodes
                self.slots = sum(n["slots"] for n in nodes)
                self._plan = {k: v for k, v in self._plan.items() if set(v) <= new}
                self._dirty = True
            for nid in sorted(old - new):
                self._events.emit("node_lost", node=nid, slots=self.slots, nodes=len(nodes))
            for nid in sorted(new - old):
                self._events.emit("node_added", node=nid, slots=self.slots, nodes=len(nodes))
        self._reconcile_held()

    def _reconcile_held(self) -> None:
        """A job that lost workers to a fault holds only the slots it runs on (no request in flight)."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.handle is not None and j.state == "running"
                    and j.pending is None]
        for j in jobs:
            ws = j.handle.status()["world_size"]
            if 0 < ws < j.held:
                with self._lock:
                    j.held = ws
                    self._dirty = True

    def _placed(self, counts: dict[str, int]) -> dict | None:
        with self._lock:
            nodes = list(self._nodes)
            handles = {j.name: j.handle for j in self._jobs.values() if j.handle is not None}
        if not nodes:
            return None
        index = {n["node_id"]: i for i, n in enumerate(nodes)}
        per = max(n["slots"] for n in nodes)
        previous = {}
        for name, h in handles.items():
            if name in counts and h.state not in TERMINAL:
                p = [0] * len(nodes)
                for node in h.nodes():
                    if node in index:
                        p[index[node]] += 1
                previous[name] = tuple(p)
        counts = {k: v for k, v in counts.items() if v > 0}
        try:
            out = place(counts, previous, len(nodes), per)
        except ValueError as e:  # e.g. more slots than the nodes now have: Ray places them this round
            self._events.emit("placement_failed", error=str(e))
            return None
        plan = {name: [nodes[i]["node_id"] for i, k in enumerate(p) for _ in range(k)]
                for name, p in out.items()}
        with self._lock:
            self._plan = plan
        return {name: list(p) for name, p in out.items()}

    def placement_of(self, name: str, n: int) -> list[str] | None:
        """The node id of each of ``n`` workers of job ``name`` by the last round's placement (None: that
        round placed the job at another size, or a node of it is gone)."""
        with self._lock:
            plan = self._plan.get(name)
            alive = {x["node_id"] for x in self._nodes}
        if plan is None or len(plan) != n or not set(plan) <= alive:
            return None
        return list(plan)

    def _launch_job(self, j: LiveJob, n: int, batch: BatchConfig):
        from elasticlab.cluster.ray.job import RayJob

        spec = j.spec
        if spec.backend != "pool":
            raise ValueError(f"job {spec.name!r}: the Ray cluster runs its own workers; backend "
                             f"{spec.backend!r} is for LocalCluster")
        ckpt = Path(self.workdir) / spec.name
        ckpt.mkdir(parents=True, exist_ok=True)
        record = spec.record_samples
        if record is True:
            record = str(ckpt / "samples.jsonl")
        job = RayJob(spec.entrypoint, workers=n, checkpoint_dir=str(ckpt), global_batch=batch.global_batch,
                     accum_steps=batch.accum_steps, entry_kwargs=spec.entry_kwargs,
                     placement_of=lambda k, name=spec.name: self.placement_of(name, k),
                     resource=self.resource,
                     record_samples=record or None, name=spec.name, epochs=spec.epochs,
                     max_steps=spec.max_steps, checkpoint_every=spec.checkpoint_every, seed=spec.seed,
                     timeout_s=spec.timeout_s, lr_rule=spec.lr_rule, warm=spec.warm, **self.job_kwargs)
        return job.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and every job (their actors end); shut Ray down if this cluster started it."""
        super().stop(timeout)
        if self._own_ray:
            import ray

            ray.shutdown()
            self._own_ray = False
