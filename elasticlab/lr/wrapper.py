"""The wrapper that applies a scaling rule to any torch optimizer, composed with its base schedule.

Per optimizer step the LR of every param group is ``lr_group * schedule(floor(tau)) * m_t``, where
``lr_group`` is whatever the group holds (so any torch LR scheduler keeps working: the scaled value is
set just for the step and the group's own value restored afterwards, as AdaptDL does), ``schedule`` an
optional function of scale-invariant progress tau (AdaScale: ``eta_t = r_t * lr(floor(tau_t))``),
and ``m_t`` the rule's multiplier at S = M/M0, ramped by :class:`~elasticlab.lr.dynamic_sgd.DynamicSGD`
after a batch change when a ramp is given.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from elasticlab.checks import number

from .adascale import AdaScale
from .base import get_rule, needs_gns
from .dynamic_sgd import DynamicSGD
from .progress import ScaleInvariantProgress


class ElasticLR:
    """``ElasticLR(optimizer, init_batch, rule="linear"|"sqrt"|"adascale"|rule, ramp=None|DynamicSGD,
    schedule=None, gns=None)``.

    The elastic runtime calls :meth:`on_batch_change` at a resize and :meth:`step` (or ``with
    elr.applied(): scaler.step(opt)``) every optimizer step, and checkpoints :meth:`state_dict` (plain
    types). ``gns``: live gradient statistics (phi, (sqr, var) or a GNS estimator object); it feeds an
    AdaScale rule and makes progress count AdaScale's gain r instead of the rule's nominal gain.
    """

    def __init__(self, optimizer, init_batch, rule="linear", ramp=None, schedule=None, gns=None,
                 global_batch=None):
        number("init_batch", init_batch, lambda b: b > 0, "a positive number")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a function of progress, got {schedule!r}")
        self.optimizer = optimizer
        self.init_batch = float(init_batch)
        self.gns = gns
        self.rule = get_rule(rule, stats=gns) if needs_gns(rule) else get_rule(rule)
        if isinstance(self.rule, AdaScale):
            if self.rule.init_batch is None:
                self.rule.init_batch = self.init_batch
            if self.rule.stats is None:
                self.rule.stats = gns
        if ramp in ("dynamic_sgd", True):
            ramp = DynamicSGD()
        if ramp is not None and not isinstance(ramp, DynamicSGD):
            raise TypeError(f"ramp must be a DynamicSGD, 'dynamic_sgd' or None, got {ramp!r}")
        self.ramp = ramp
        self.schedule = schedule
        self.global_batch = float(global_batch if global_batch is not None else init_batch)
        if not self.global_batch > 0:
            raise ValueError(f"global_batch must be > 0, got {global_batch!r}")
        self.progress = ScaleInvariantProgress(self.init_batch)
        self.last_lrs: list[float] | None = None
        self.last_multiplier = 1.0

    # ------------------------------------------------------------------ state of the rule
    @property
    def scale(self) -> float:
        return self.global_batch / self.init_batch

    @property
    def steps(self) -> int:
        return self.progress.steps

    def rule_multiplier(self) -> float:
        """The (ramped) rule multiplier for the next step, without the base schedule."""
        target = self.rule.multiplier(self.scale)
        return self.ramp(self.steps, target) if self.ramp is not None else target

    def multiplier(self) -> float:
        """The full LR multiplier of the next step: ramped rule multiplier x schedule(floor(tau))."""
        m = self.rule_multiplier()
        if self.schedule is not None:
            m *= float(self.schedule(math.floor(self.progress.progress)))
        return m

    def gain(self) -> float:
        """Progress of the next step in steps at M0: AdaScale's r from ``gns`` if given, else the rule's."""
        if self.gns is not None and not isinstance(self.rule, AdaScale):
            return AdaScale(self.gns, self.init_batch).gain(self.scale)
        return self.rule.gain(self.scale)

    def lrs(self) -> list[float]:
        m = self.multiplier()
        return [g["lr"] * m for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ events
    def on_batch_change(self, new_global_batch) -> None:
        """The global batch becomes ``new_global_batch`` from the next step on (starts a ramp)."""
        new = float(new_global_batch)
        if not (new > 0 and math.isfinite(new)):
            raise ValueError(f"new_global_batch must be a positive number, got {new_global_batch!r}")
        if new == self.global_batch:
            return
        if self.ramp is not None:
            self.ramp.begin(self.steps, new / self.global_batch, self.rule_multiplier())
            if self.ramp.momentum == "reset":
                self._reset_momentum()
        self.global_batch = new

    @contextmanager
    def applied(self):
        """Set the scaled LRs for one optimizer step; restore the groups' LRs and count the step after."""
        m = self.multiplier()
        gain = self.gain()
        groups = self.optimizer.param_groups
        base = [g["lr"] for g in groups]
        new = [lr * m for lr in base]
        if self.ramp is not None and self.ramp.momentum == "correct" and self.last_lrs is not None:
            self._correct_momentum(new)
        for g, lr in zip(groups, new):
            g["lr"] = lr
        try:
            yield new
        finally:
            for g, lr in zip(groups, base):
                g["lr"] = lr
        self.last_lrs = new
        self.last_multiplier = m
        self.progress.update(gain, self.global_batch)

    def step(self, closure=None):
        """``optimizer.step(closure)`` at the scaled LR."""
        with self.applied():
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def _momentum_buffers(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    yield group, p, buf

    def _reset_momentum(self):
        for _, p, _ in list(self._momentum_buffers()):
            del self.optimizer.state[p]["momentum_buffer"]
        for state in self.optimizer.state.values():
            if "exp_avg" in state:
                state["exp_avg"].zero_()

    def _correct_momentum(self, new_lrs):
        """Goyal et al. 2017's momentum correction: with ``p -= lr * v``, rescaling v by lr_old/lr_new
        makes the update equal to the lr-inside-momentum form, so stale gradients keep their old step."""
        index = {id(g): i for i, g in enumerate(self.optimizer.param_groups)}
        for group, _, buf in self._momentum_buffers():
            i = index[id(group)]
            old, new = self.last_lrs[i], new_lrs[i]
            if new > 0 and old != new:
                buf.mul_(old / new)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "init_batch": self.init_batch,
            "global_batch": self.global_batch,
            "rule": type(self.rule).__name__,
            "progress": self.progress.state_dict(),
            "ramp": None if self.ramp is None else self.ramp.state_dict(),
            "last_lrs": None if self.last_lrs is None else [float(v) for v in self.last_lrs],
            "last_multiplier": float(self.last_multiplier),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = type(self.rule).__name__
        if state["rule"] != mine:
            raise ValueError(f"checkpoint is for rule {state['rule']!r}, this wrapper has {mine!r}")
        self.init_batch = float(state["init_batch"])
        self.global_batch = float(state["global_batch"])
        self.progress.load_state_dict(state["progress"])
        if (state["ramp"] is None) != (self.ramp is None):
            raise ValueError("checkpoint and wrapper disagree on whether a Dynamic SGD ramp is used")
        if self.ramp is not None:
            self.ramp.load_state_dict(state["ramp"])
        self.last_lrs = None if state["last_lrs"] is None else list(state["last_lrs"])
        self.last_multiplier = float(state["last_multiplier"])

    def __repr__(self):
        return (f"ElasticLR(rule={self.rule!r}, ramp={self.ramp!r}, M0={self.init_batch:g}, "
                f"M={self.global_batch:g}, {self.progress!r})")
