"""A simulated training job, replaying measured behaviour (Pollux artifact model, pollux-artifact.md §5.2).

Per interval: true step time of its placement and per-GPU batch (traces), true gradient statistics at its
global batch and epoch, goodput = gain / T_iter in M0-steps per second (AdaScale gain, Pollux Eq. (2)
times scale); progress += goodput * dt; epoch boundaries and completion come from the validation tables.
Any re-allocation costs ``restart_delay`` seconds without progress (GPU time is still charged).

Simplification against the artifact: the scheduler's throughput model is fitted once per application to
all its traces (``Application.throughput_model``) instead of refitted per job from its own observations;
prior-driven exploration survives as the cap of twice the largest GPU count profiled (``max_replicas``).
The gradient statistics the agent sees are the true ones, as in the artifact.

``batch_mode``: "fixed" (the user's batch from the workload), "goodput" (re-optimised for goodput with
the fitted throughput model and the true GNS, Pollux agent), "throughput" (the largest-throughput batch in
range, ignoring statistical efficiency: Saxena's objective), "initial" (M0 whatever the GPU count).
"""
from __future__ import annotations

import numpy as np

from elasticlab.goodput.agent import MODES, BatchChoice, BatchLimits, GoodputAgent
from elasticlab.sim.traces import Application

__all__ = ["SimJob", "BATCH_MODES"]

#: The batch modes, one list: :data:`elasticlab.goodput.agent.MODES`.
BATCH_MODES = MODES


class SimJob:
    def __init__(self, name: str, app: Application, submission_time: float, num_replicas: int | None = None,
                 batch_size: int | None = None, batch_mode: str = "fixed", restart_delay: float = 30.0):
        if batch_mode not in BATCH_MODES:
            raise ValueError(f"batch_mode must be one of {BATCH_MODES}, got {batch_mode!r}")
        if batch_mode == "fixed" and batch_size is None:
            raise ValueError(f"job {name!r}: batch_mode 'fixed' needs a batch_size")
        self.name = name
        self.app = app
        self.submission_time = float(submission_time)
        self.target_replicas = num_replicas
        self.target_batch = batch_size
        self.batch_mode = batch_mode
        self.restart_delay = float(restart_delay)
        self.placement: tuple = ()
        self.atomic_bsz = 0
        self.accum_steps = 0
        self.progress = 0.0
        self.epoch = 0
        self.current_time = 0.0
        self.rescale_time = 0.0
        self.attained_service = 0.0  # GPU-seconds
        self.run_time = 0.0  # wall seconds holding GPUs
        self.num_restarts = -1  # the first start is not a restart
        self.completion_time: float | None = None
        self.agent = GoodputAgent(
            BatchLimits(app.init_batch_size, max(app.max_batch_size, app.init_batch_size),
                        (app.min_local_bsz, app.max_local_bsz)),
            model=app.throughput_model, grad_stats=app.grad_stats(app.init_batch_size, 0),
            split=app.batch_split)
        self.start_time: float | None = None
        self.gpu_limit: int | None = None  # a hard cap on GPUs (the artifact pins NCF to 1 under Pollux)
        # memos of pure functions of the job's inputs (issue 19: a curve or batch is recomputed only when
        # its inputs changed); each key holds every input the value depends on
        self._memo: dict = {}
        self._step_key = None
        self._step_val = None
        self._stats_key = None
        self._stats_val = None
        self._tables: dict = {}
        self._gpn = None  # GPUs per node of the scheduler's last curve (the tables' node size)

    # ---- state
    @property
    def placement(self) -> tuple:
        """GPUs per node (length = the cluster's nodes; () when the job holds none)."""
        return self._placement

    @placement.setter
    def placement(self, value):
        self._placement = tuple(value)
        self._gpus = int(sum(self._placement))  # cached: read several times per step on 1000s of nodes
        self._nodes = len(self._placement) - self._placement.count(0)

    @property
    def gpus(self) -> int:
        return self._gpus

    @property
    def nodes(self) -> int:
        return self._nodes

    @property
    def batch_size(self) -> int:
        return self.gpus * self.atomic_bsz * (self.accum_steps + 1)

    @property
    def done(self) -> bool:
        return self.completion_time is not None

    @property
    def restarts(self) -> int:
        return max(self.num_restarts, 0)

    def age(self, now: float) -> float:
        return max(now - self.submission_time, 0.0)

    def __repr__(self):
        return (f"SimJob({self.name!r}, gpus={self.gpus}, batch={self.batch_size}, epoch={self.epoch}/"
                f"{self.app.max_epochs}, progress={self.progress:.0f}/{self.app.max_progress:.0f})")

    # ---- models the scheduler may use (the job's GoodputAgent)
    @property
    def grad_params(self):
        """The true gradient statistics ``(sqr, var)`` at the current batch and epoch."""
        return self.agent.grad_stats

    @grad_params.setter
    def grad_params(self, value):
        self.agent.grad_stats = value

    @property
    def max_profiled_replicas(self) -> int:
        return self.agent.max_profiled

    @max_profiled_replicas.setter
    def max_profiled_replicas(self, value: int):
        self.agent.max_profiled = int(value)

    def _memoized(self, kind, args, compute, mode=None):
        """``compute()`` once per distinct (kind, args, agent inputs); read-only arrays are shared."""
        a = self.agent
        # the agent reads max_profiled only through its sign ("has run": > 0; linear curves at 0), so a job
        # that grows keeps its memo; throughput mode ignores the gradient statistics (phi = inf)
        mp = a.max_profiled
        stats = None if mode == "throughput" else a.grad_stats
        key = (kind, args, stats, (mp > 0) - (mp < 0), id(a.model), self.target_batch)
        try:
            hit = self._memo.get(key)
        except TypeError:  # statistics set to an unhashable object: no memo
            return compute()
        if hit is None:
            if len(self._memo) > 32:  # inputs drift over epochs; curves span the cluster: keep a few
                self._memo.clear()
            hit = compute()
            if isinstance(hit, np.ndarray):
                hit.setflags(write=False)
            self._memo[key] = hit
        return hit

    def goodput_curve(self, max_gpus: int, gpus_per_node: int, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """Predicted goodput in M0-steps per second (progress rate) at g = 0..max_gpus GPUs
        (:meth:`GoodputAgent.goodput_curve`; fixed-batch jobs: their batch split over g GPUs); read-only,
        computed once per distinct input."""
        mode = mode or self.batch_mode
        return self._memoized("goodput", (max_gpus, gpus_per_node, mode, upto),
                              lambda: self._goodput_curve(max_gpus, gpus_per_node, mode, upto), mode)

    def speedup_curve(self, max_gpus: int, gpus_per_node: int, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """Pollux Eq. (8) (:meth:`GoodputAgent.speedup_curve`); linear (= g) before the job has run;
        read-only, computed once per distinct input."""
        mode = mode or self.batch_mode
        return self._memoized("speedup", (max_gpus, gpus_per_node, mode, upto),
                              lambda: self._speedup_curve(max_gpus, gpus_per_node, mode, upto), mode)

    # ---- the agent's choices, read from one table per input (issue 19)
    #: Serve batch choices and curves of the batch-adaptive modes from :meth:`_table` (False: ask the agent
    #: each time; the same numbers, tests/sim/test_engine_scale.py).
    use_tables = True

    def _tabled(self, mode) -> bool:
        a = self.agent
        return self.use_tables and mode in ("goodput", "throughput") and a.model is not None \
            and a.max_profiled > 0

    def _table(self, mode, top, gpus_per_node, build=True):
        """The agent's ``optimize`` (goodput, per-GPU batch, accumulation steps) in one vectorised call, at
        g = 1..``top`` GPUs packed on ceil(g / ``gpus_per_node``) nodes and at g = 2..``gpus_per_node``
        spread over several nodes: what the agent's curve reads, and its batch choice for any placement of
        up to ``top`` GPUs (the throughput model sees nodes only as "more than one", and the optimisation is
        elementwise, so an entry is bit for bit the scalar call's). Kept per input (the gradient statistics
        change whenever the batch does): the scheduler's curve builds it and the new allocation's batch
        choice reads it. ``build=False``: None unless one covering ``top`` is kept."""
        a = self.agent
        key = (mode, None if mode == "throughput" else a.grad_stats, id(a.model), gpus_per_node)
        try:
            hit = self._tables.get(key)
        except TypeError:  # unhashable statistics: computed, not kept
            key, hit = None, None
        if hit is not None and hit[0] >= top:
            return hit
        if not build:
            return None
        T, gpn = int(top), int(gpus_per_node)
        gg = np.arange(1, T + 1, dtype=float)
        spread = np.arange(2, min(gpn, T) + 1, dtype=float)
        nodes = np.concatenate([np.where(gg <= gpn, 1.0, 2.0), np.full(len(spread), 2.0)])
        good, b, s = a.optimize(nodes, np.concatenate([gg, spread]), mode)
        hit = (T, gpn, good, b, s)
        if key is not None:
            if len(self._tables) > 8:
                self._tables.clear()
            self._tables[key] = hit
        return hit

    def _goodput_curve(self, max_gpus, gpus_per_node, mode, upto):
        """:meth:`GoodputAgent.goodput_curve`, read from :meth:`_table` where it applies."""
        a = self.agent
        if not self._tabled(mode):
            return a.goodput_curve(max_gpus, gpus_per_node, mode, upto, fixed_batch=self.target_batch)
        out = np.zeros(max_gpus + 1)
        top = max_gpus if upto is None else max(min(int(upto), max_gpus), 0)
        if top < 1:
            return out
        self._gpn = gpus_per_node
        good = self._table(mode, top, gpus_per_node)[2]
        out[1:top + 1] = good[:top]
        out /= float(a.limits.init)
        # the agent's nan_to_num, only where it has something to do (the table's goodputs are finite)
        return out if np.isfinite(out).all() else np.nan_to_num(out, nan=0.0, posinf=0.0)

    def _speedup_curve(self, max_gpus, gpus_per_node, mode, upto):
        """:meth:`GoodputAgent.speedup_curve` over :meth:`_goodput_curve`."""
        if self._tabled(mode):
            good = self._goodput_curve(max_gpus, gpus_per_node, mode, upto)
            if good[1] > 0:
                return good / good[1]
        return self.agent.speedup_curve(max_gpus, gpus_per_node, mode, upto, fixed_batch=self.target_batch)

    def _best_batch(self, gpus, nodes, mode) -> BatchChoice:
        """:meth:`GoodputAgent.best_batch` (no current batch), read from the kept :meth:`_table` of the
        current input where there is one (the scheduler's curve built it); else the agent's."""
        a = self.agent
        t = self._table(mode, gpus, self._gpn, build=False) if self._gpn and self._tabled(mode) else None
        if t is not None:
            T, gpn, good, b, s = t
            if gpus > gpn:  # several nodes: the packed entry
                i = gpus - 1 if nodes > 1 else None
            else:
                i = gpus - 1 if nodes <= 1 else T + gpus - 2
            choice = None if i is None else a.choice_of(gpus, mode, good[i], b[i], s[i])
            if choice is not None:  # the agent's choice; else its fallback below
                return choice
        return a.best_batch(gpus, nodes, mode, fixed_batch=self.target_batch)

    def remaining_progress(self) -> float:
        """Scale-invariant progress (M0-steps) left: known from the user's declared number of epochs."""
        return max(self.app.max_progress - self.progress, 0.0)

    def max_replicas(self, cap: int = 64) -> int:
        """Pollux's exploration limit: at most twice the largest GPU count profiled so far (>= 1)."""
        app = self.app
        lim = self.agent.exploration_limit(cap)
        if self.gpu_limit is not None:
            lim = min(lim, self.gpu_limit)
        if self.batch_mode in ("goodput", "throughput"):
            lim = min(lim, app.max_batch_size // app.min_local_bsz)
        elif self.batch_mode == "fixed":
            lim = min(lim, max(self.target_batch // app.min_local_bsz, 1))
        return max(int(lim), 1)

    def remaining_iterations(self, batch_size: float | None = None) -> float:
        """Oracle optimizer steps left at a fixed global batch (Optimus+Oracle), from the true GNS tables."""
        app = self.app
        m = float(batch_size or self.target_batch or app.init_batch_size)
        scale = m / app.init_batch_size
        sqr, var = app.grad_stats_table(m)
        gains = (var + sqr) / (var / scale + sqr)
        bounds = app._boundaries
        left = 0.0
        for e in range(self.epoch, app.max_epochs):
            lo = max(bounds[e], self.progress)
            left += max(bounds[e + 1] - lo, 0.0) / gains[e]
        return left

    # ---- batch size
    def update_batch(self):
        """Choose (per-GPU batch, accumulation steps) for the current placement (artifact §5.2 step 5):
        the agent's choice (:meth:`GoodputAgent.best_batch`)."""
        r = self.gpus
        if r == 0:
            self.atomic_bsz, self.accum_steps = 0, 0
            return
        nodes, mode = self.nodes, self.batch_mode
        choice = self._memoized("batch", (r, nodes, mode), lambda: self._best_batch(r, nodes, mode), mode)
        self.atomic_bsz, self.accum_steps = choice.per_gpu, choice.accum

    # ---- dynamics
    def reallocate(self, placement: tuple):
        placement = tuple(map(int, placement))
        if sum(placement) > 0:
            self.placement = placement
            self.update_batch()
            self.rescale_time = self.restart_delay
            self.num_restarts += 1
        else:
            self.placement = ()
            self.atomic_bsz = self.accum_steps = 0

    def step(self, seconds: float):
        """Advance ``seconds`` of simulated time."""
        if not self.placement or self.done:
            self.current_time += seconds
            return
        if self.start_time is None:
            self.start_time = self.current_time
        r = self.gpus
        delay = min(self.rescale_time, seconds)
        self.current_time += delay
        self.attained_service += delay * r
        self.run_time += delay
        self.rescale_time -= delay
        seconds -= delay
        app = self.app
        while seconds > 0 and not self.done:
            batch = self.batch_size
            scale = batch / app.init_batch_size
            key = (self.placement, self.atomic_bsz)
            if key != self._step_key:
                self._step_key, self._step_val = key, app.step_time(self.placement, self.atomic_bsz)
            step, sync = self._step_val
            total = step + (step - sync) * self.accum_steps
            key = (batch, self.epoch)
            if key != self._stats_key:
                self._stats_key, self._stats_val = key, app.grad_stats(batch, self.epoch)
            sqr, var = self._stats_val
            gain = (var + sqr) / (var / scale + sqr)
            self.grad_params = (sqr, var)
            self.agent.observe(r)
            goodput = gain / total  # M0-steps per second
            nxt = app.progress_at(self.epoch + 1)
            if self.progress + goodput * seconds < nxt:
                self.progress += goodput * seconds
                self._spend(seconds, r)
                seconds = 0
            else:
                delta = min(float(round((nxt - self.progress) / goodput)), seconds)
                self.epoch += 1
                self.progress = nxt
                if self.epoch >= app.max_epochs:
                    self.completion_time = self.current_time + delta
                self._spend(delta, r)
                seconds -= delta
            if not self.done and self.batch_mode != "fixed":
                self.update_batch()
        self.current_time += seconds

    def _spend(self, dt, r):
        self.current_time += dt
        self.attained_service += dt * r
        self.run_time += dt
