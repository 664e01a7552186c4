"""What a cluster reports (the panel, the benchmark and the tests read it): jobs, metrics, history, the
scheduling rounds, the event log, the summary and each job's exactly-once sample check.

:class:`ClusterReports` is a base of :class:`~elasticlab.cluster.scheduler.Scheduler`; it only reads the
scheduler's state (``_jobs``, ``_history``, ``_rounds``, ``_events``, ``slots``, ``policy_name``,
``restart_cost``) under its lock, whatever the backend (a local slot pool or Ray nodes).
"""
from __future__ import annotations

from elasticlab.cluster.view import TERMINAL, LiveJob, LiveState


class ClusterReports:
    """Read-only views of a scheduler's jobs and decisions (see the module docstring)."""

    def job(self, name: str):
        """The live job handle (an ElasticJob) of ``name``, None while it is queued."""
        return self._get(name).handle

    def jobs(self) -> list[dict]:
        """One row per job: state, slots, batch, step, epoch, GNS, predicted goodput, JCT so far, restarts."""
        now = self.now()
        with self._lock:
            jobs = list(self._jobs.values())
        rows = []
        for j in jobs:
            st = j.handle.status() if j.handle is not None else {}
            rows.append({"name": j.name, "state": str(j.state),
                         "slots": j.held if j.state not in TERMINAL else 0,
                         "world_size": j.world_size, "target": j.target[0],
                         "global_batch": st.get("global_batch"), "accum_steps": st.get("accum_steps"),
                         "step": st.get("step", 0), "epoch": st.get("epoch", 0), "gns": st.get("gns"),
                         "goodput": j.predicted_goodput() if j.state == LiveState.RUNNING else None,
                         "jct": j.jct(now), "restarts": j.restarts, "service": j.attained_service,
                         "error": j.error})
        return rows

    def metrics(self) -> dict:
        """Cluster metrics now: slots used, queue length, running/finished/failed/dropped, average JCT."""
        with self._lock:
            jobs = list(self._jobs.values())
        done = [j.finish_time - j.submission_time for j in jobs if j.state == LiveState.FINISHED]
        return {"t": self.now(), "slots": self.slots, "slots_used": sum(j.held for j in jobs
                                                                         if j.state not in TERMINAL),
                "queued": sum(j.state == LiveState.QUEUED for j in jobs),
                "running": sum(j.state in (LiveState.STARTING, LiveState.RUNNING) for j in jobs),
                "paused": sum(j.state == LiveState.PAUSED for j in jobs),
                "finished": len(done), "failed": sum(j.state == LiveState.FAILED for j in jobs),
                "dropped": sum(j.state == LiveState.DROPPED for j in jobs),
                "avg_jct": sum(done) / len(done) if done else None,
                "restart_cost_s": self.restart_cost.estimate, "policy": self.policy_name}

    def history(self) -> list[dict]:
        """``[{"t", "slots": {job: world size}, "batch": {job: global batch}}]``, one row per change."""
        with self._lock:
            return [dict(r) for r in self._history]

    def rounds(self) -> list[dict]:
        """Every scheduling decision: time, allocation, batches, the restart delay used, DP seconds."""
        with self._lock:
            return [dict(r) for r in self._rounds]

    def events(self, since: int = 0) -> list[dict]:
        """Cluster events (submit, refused, drop, start, resize, set_batch, pause, resume, finished,
        failed, stop, round) from index ``since``."""
        return self._events.since(since)

    def summary(self) -> dict:
        """JCT per job, average JCT of the finished jobs, makespan, resizes and the measured restart cost."""
        with self._lock:
            jobs = list(self._jobs.values())
        jct = {j.name: (j.finish_time - j.submission_time) for j in jobs if j.state == LiveState.FINISHED}
        ends = [j.finish_time for j in jobs if j.finish_time is not None]
        return {"policy": self.policy_name, "slots": self.slots,
                "jct": jct, "avg_jct": sum(jct.values()) / len(jct) if jct else None,
                "states": {j.name: str(j.state) for j in jobs},
                "makespan": (max(ends) - min(j.submission_time for j in jobs)) if ends and jobs else None,
                "restarts": {j.name: j.restarts for j in jobs},
                "restart_cost": self.restart_cost.as_dict(), "rounds": len(self._rounds),
                "errors": {j.name: j.error for j in jobs if j.error}}

    def sample_check(self, name: str) -> dict:
        """Exactly-once check of a job's sample record (:func:`elasticlab.elastic.check_exactly_once`); of a
        job that finished its epochs (no ``max_steps``), each of them must be complete."""
        from elasticlab.elastic import check_exactly_once
        from elasticlab.elastic.sampler import read_record
        from elasticlab.elastic.task import build

        j = self._get(name)
        path = j.handle.record_path if j.handle is not None else None
        if not path:
            raise ValueError(f"job {name!r} has no sample record (submit it with record_samples=True)")
        rows = read_record(path)
        n = len(build(j.spec.entrypoint, j.spec.entry_kwargs))
        ran_out = j.state == "finished" and j.spec.max_steps is None
        return check_exactly_once(rows, n, epochs=j.spec.epochs if ran_out else None)

    def _get(self, name: str) -> LiveJob:
        with self._lock:
            if name not in self._jobs:
                raise ValueError(f"no job named {name!r}; jobs: {sorted(self._jobs)}")
            return self._jobs[name]

    def _record_history(self, now: float) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        slots, batch = {}, {}
        for j in jobs:
            ws = j.world_size
            slots[j.name] = ws
            if j.handle is not None and ws:
                batch[j.name] = j.handle.status().get("global_batch")
        with self._lock:
            last = self._history[-1] if self._history else None
            if last is None or last["slots"] != slots or last["batch"] != batch:
                self._history.append({"t": now, "slots": slots, "batch": batch})
