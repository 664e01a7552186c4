"""The generations of a :class:`~elasticlab.cluster.ray.job.RayJob`, run in its controller thread.

:class:`RayGenerations` is a base of ``RayJob`` (as ``elastic/generation.py`` and ``elastic/faults.py`` are
of the local job's controller): form a generation (the allocator's nodes, the gang's placement group, one
``Join`` per rank), drain its actors' messages and notice the dead ones, and when it ends finish, pause,
re-form at the requested size, or recover from a fault from the newest valid checkpoint on the workers that
remain (the steps since that checkpoint counted in ``lost_steps``). It works on the job's fields (``_gang``,
``_workers``, ``_ranks``, ``_runs``, ``_ended``, ``_pending``, ...) set by ``RayJob.__init__``.
"""
from __future__ import annotations

import json
import time

from elasticlab.elastic import messages as M


class RayGenerations:
    """Form, drain and end a Ray job's generations (see the module docstring)."""

    def _form(self, n: int, batch, checkpoint: str | None) -> None:
        """Reserve the slots and start the next generation of ``n`` workers. If the allocator's nodes cannot
        be had (a node just died and Ray does not know yet), try again with Ray placing the workers, then
        with the live workers only."""
        tag, err = f"{self._gen + 1}", None
        for attempt in range(3):
            plan = self._placement_of(n) if self._placement_of is not None and attempt == 0 else None
            if plan and self._suspect & set(plan):
                plan = None
            keep, need = self._gang.choose(n, plan, avoid=self._suspect)
            if attempt == 2:  # the live workers, or one anywhere
                need = [] if keep else [None]
            try:
                ranks = self._gang.allocate(keep, need, tag)
                break
            except Exception as e:  # GetTimeoutError: the slots cannot be had (now)
                err = e
                self._events.emit("place_failed", attempt=attempt, want=n, have=len(keep),
                                  error=repr(e)[:300])
                for w in [w for w in self._workers if not self._gang.alive(w)]:
                    self._suspect.add(self._workers[w]["node"])
                    self._kill([w])
        else:
            raise RuntimeError(f"no placement for {n} workers: {err!r}")
        new = [w for w in ranks if w not in keep]
        if new:
            self._events.emit("actors_start", workers=new, nodes=[self._workers[w]["node"] for w in new])
        self._gen += 1
        self._ranks, self._ended = ranks, None
        # the step up to which each rank's sample rows have reached the controller (from the start step)
        self._gen_start, self._recorded = self._seen, dict.fromkeys(range(len(ranks)), self._seen)
        host = self._host
        self._runs = {w: self._workers[w]["actor"].run.remote(M.Join(
            self._gen, r, len(self._ranks), self._port, checkpoint, str(self.checkpoint_dir.directory),
            batch, host)) for r, w in enumerate(self._ranks)}
        self._events.emit("generation", generation=self._gen, world_size=len(self._ranks),
                          nodes=[self._workers[w]["node"] for w in self._ranks], checkpoint=checkpoint)

    def _pump(self) -> None:
        """Drain the generation's actors, notice the ones that died, note how the generation ends. The
        runs that have returned are read first: a run counted as done was drained after it sent its last
        rows (its Samples of the final step would be lost otherwise)."""
        import ray

        done = ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=0)[0] \
            if self._runs else []
        refs = {w: self._workers[w]["actor"].drain.remote() for w in self._ranks if w in self._workers}
        dead = {}
        for w, ref in refs.items():
            try:
                msgs = ray.get(ref, timeout=30)
            except Exception as e:  # RayActorError: the actor (or its node) is gone
                dead[w] = repr(e)
                continue
            for m in msgs:
                self._on_message(w, m)
        if self._rec is not None:   # the record on disk as drained (read once the job is over: sample_check)
            self._rec.flush()
        for w, ref in list(self._runs.items()):
            if ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    dead.setdefault(w, repr(e))
                del self._runs[w]
        dead = list(dead.items())
        if dead and self._ended is None:
            self._ended = "fault"
            self._events.emit("fault", generation=self._gen, dead=[w for w, _ in dead],
                              message=dead[0][1][:300])
        self._suspect.update(self._workers[w]["node"] for w, _ in dead if w in self._workers)
        self._kill([w for w, _ in dead])

    def _on_message(self, wid: int, m) -> None:
        if isinstance(m, M.Step):
            self._on_step(m.record)
        elif isinstance(m, M.Samples):
            step = int(m.row["step"])
            self._seen = max(self._seen, step)
            if m.row.get("generation") == self._gen:
                rank = int(m.row["rank"])
                self._recorded[rank] = max(self._recorded.get(rank, step), step)
            if self._rec is not None:
                self._rec.write(json.dumps(m.row) + "\n")
        elif isinstance(m, M.Checkpointed):
            self._ckpt = m.path
            self._events.emit("checkpoint", step=m.step, path=m.path, reason=m.reason,
                              generation=m.generation)
        elif isinstance(m, M.Resumed):
            self._events.emit("resume", generation=m.generation, step=m.step, checkpoint=m.checkpoint,
                              backend=m.backend)
        elif isinstance(m, M.Finished):
            self._ended = self._ended or "finished"
        elif isinstance(m, M.Left):
            self._ended = self._ended or "left"
        elif isinstance(m, M.Error) and m.generation == self._gen:
            if self._ended in (None, "left", "finished"):
                self._ended = "fault"
                self._events.emit("fault", generation=self._gen, dead=[], message=m.text[:300])
            with self._lock:
                self._error = m.text

    def _next(self) -> bool:
        """The generation ended: finish, pause, re-form at the requested size, or resume after a fault.
        False when the job is over."""
        how, p = self._ended, self._pending
        if how == "finished":
            with self._lock:
                self._state = "finished"
            self._events.emit("finished", step=self._last.get("step"))
            return False
        if how == "fault":
            return self._recover()
        # left at a step boundary, for a request
        if p is not None and p["kind"] == "pause":  # the slots go back; up to `warm` workers stay idle
            self._gang.release()
            self._gang.trim([])
            # no generation while paused: the loop waits for resume() instead of re-forming this one
            self._ranks, self._runs, self._ended = [], {}, None
            with self._lock:
                self._state = "paused"
            self._events.emit("pause", step=self._last.get("step"))
            self._resolve(self._last.get("step", 0))
            return True
        n = p["n"] if p is not None and p["kind"] == "resize" else len(self._ranks)
        self._target = n
        self._form(n, p.get("batch") if p else None, self._ckpt)
        if p is not None:
            p["sent"], p["got"] = "formed", len(self._ranks)
        return True

    def _recover(self) -> bool:
        """After a fault: end the generation's other workers if they are stuck, then go on from the newest
        valid checkpoint on the workers that are alive."""

        end = time.monotonic() + self.fault_grace_s
        while self._runs and time.monotonic() < end:
            self._pump()
            time.sleep(0.05)
        self._kill(list(self._runs))  # still in a collective with a dead peer
        self._runs = {}
        self._pump()  # what the survivors sent last
        path, through = self._restart_checkpoint()
        ck_step = 0
        if path is not None:
            from elasticlab.elastic.checkpoint import load

            ck_step = int(load(path)["step"])
        lost = max(self._seen - ck_step, 0)  # steps done since the checkpoint: they run again
        self._seen = ck_step
        self._faults += 1
        self._streak += 1
        self._lost += lost
        p = self._pending
        if p is not None:
            self._resolve(error=RuntimeError(f"a fault interrupted the {p['kind']}"))
        if self._streak > self.max_faults:
            raise RuntimeError(f"{self._streak} faults in a row without a step: {self._error}")
        alive = [w for w in self._workers if self._gang.alive(w)]
        self._suspect.update(self._workers[w]["node"] for w in self._workers if w not in alive)
        self._kill([w for w in self._workers if w not in alive])
        n = max(min(len(alive), self._target), 1) if alive else max(min(self._target, 1), 1)
        self._events.emit("restart", generation=self._gen + 1, world_size=n, checkpoint=str(path),
                          lost_steps=lost, recorded_through=through)
        try:
            self._form(n, None, str(path) if path is not None else None)
        except RuntimeError as e:   # no placement yet (a lost node's slots still held): a fault, tried again
            self._events.emit("fault", generation=self._gen, dead=[], message=str(e)[:300])
            self._ended, self._runs = "fault", {}             # (up to max_faults in a row, as any fault)
        return True

    def _restart_checkpoint(self):
        """The checkpoint to go on from after a fault, and the step through which every rank's sample rows
        arrived (None when the job keeps no sample record). A rank's rows wait in its actor's mailbox until
        the next drain, and a dead node's are lost with it: so the newest checkpoint at or before that step,
        whose steps the record then holds for every rank (the later ones run again), or none (from the
        start) if the generation began there; else the newest, and a ``record_gap`` event says so."""
        if self._rec is None or not self._recorded:
            return self.checkpoint_dir.latest()[0], None
        through = min(self._recorded.values())
        path, _, gap = self.checkpoint_dir.latest_recorded(through)
        if gap and self._gen_start == 0:
            path = None                                       # (from the start: the record holds it all)
        elif gap:
            self._events.emit("record_gap", generation=self._gen, recorded_through=through,
                              checkpoint=str(path))
        return path, through

    def _kill(self, wids) -> None:
        self._gang.kill(wids)
