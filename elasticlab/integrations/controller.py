"""``BatchSizeController``: the next global batch size and its learning rate from the measured GNS.

Without a throughput model the target is ``fraction · B_simple``: McCandlish et al. (2018, §2.3) find that a
run at B = B_crit ≈ B_simple takes 2·S_min steps and 2·E_min examples, the balance of the two, and
B_noise grows as the loss falls, so a batch that follows it grows during training (Gray et al. 2024's
GNS-guided batch-size schedule; by default the batch never shrinks and at most doubles per decision).
With a fitted :class:`~elasticlab.goodput.ThroughputModel`, Pollux's choice (Qiao et al. 2021, Eq. (1)):
the batch of highest goodput on the given GPUs (:meth:`~elasticlab.goodput.GoodputAgent.best_batch`).
The LR follows any rule of :data:`elasticlab.lr.RULES` (``linear``, ``sqrt``, ``adascale`` from the live
GNS, ``dynamic_sgd``'s ramp to linear): :meth:`lr_multiplier`, or :meth:`elastic_lr` to drive an optimizer.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from elasticlab.checks import number, whole
from elasticlab.goodput import ThroughputModel, noise_scale
from elasticlab.goodput.agent import BatchLimits, GoodputAgent
from elasticlab.lr import ElasticLR, get_rule, rule_info


class Proposal(NamedTuple):
    """A decision: ``batch`` (global), LR multiplier of the rule at S = batch/M0 (a ramp's target),
    the B_simple it was made from, whether it differs from the current batch, and why."""

    batch: int
    lr_multiplier: float
    b_simple: float
    changed: bool
    reason: str
    per_gpu: int
    accum_steps: int


class BatchSizeController:
    """``init_batch`` = M0 (the batch the LR was tuned for). ``max_batch``/``min_batch``: the range;
    ``multiple_of``: proposals are multiples of it (e.g. devices × per-device minimum). ``fraction``: target
    = fraction · B_simple. ``max_growth``: at most this factor per decision; ``hysteresis``: a relative change
    below it keeps the current batch; ``monotone``: never shrink. ``throughput_model`` + ``gpus``/``nodes``
    (+ ``max_per_gpu_batch``): decide by goodput instead. ``lr_rule``: a job rule of ``elasticlab.lr``.
    """

    def __init__(self, init_batch: int, max_batch: int, lr_rule: str = "sqrt", min_batch: int | None = None,
                 multiple_of: int = 1, fraction: float = 1.0, max_growth: float = 2.0,
                 hysteresis: float = 0.1, monotone: bool = True,
                 throughput_model: ThroughputModel | None = None, gpus: int = 1, nodes: int = 1,
                 max_per_gpu_batch: int | None = None, ramp_per_k: float = 8.0):
        init_batch, max_batch, multiple_of, gpus, nodes = (
            whole(name, v, 1, "an integer >= 1") for name, v in (
                ("init_batch", init_batch), ("max_batch", max_batch), ("multiple_of", multiple_of),
                ("gpus", gpus), ("nodes", nodes)))
        min_batch = init_batch if min_batch is None else whole("min_batch", min_batch, 1, "an integer >= 1")
        if not min_batch <= init_batch <= max_batch:
            raise ValueError(f"need 1 <= min_batch <= init_batch <= max_batch, got min_batch={min_batch!r}, "
                             f"init_batch={init_batch!r}, max_batch={max_batch!r}")
        number("fraction", fraction, lambda f: f > 0, "a positive number")
        number("max_growth", max_growth, lambda g: g > 1, "a finite number > 1")
        number("hysteresis", hysteresis, lambda h: 0 <= h < 1, "in [0, 1)")
        number("ramp_per_k", ramp_per_k, lambda k: k >= 0, "a finite number of steps >= 0")
        if max_per_gpu_batch is not None:
            whole("max_per_gpu_batch", max_per_gpu_batch, 1, "an integer >= 1 or None")
        if -(-min_batch // multiple_of) * multiple_of > max_batch:
            raise ValueError(f"no multiple of multiple_of={multiple_of} lies in [min_batch, max_batch] = "
                             f"[{min_batch}, {max_batch}]: widen the range or lower multiple_of")
        if throughput_model is not None and not isinstance(throughput_model, ThroughputModel):
            raise ValueError("throughput_model must be a ThroughputModel, got "
                             f"{type(throughput_model).__name__}")
        self.rule = rule_info(lr_rule)                       # ValueError naming the rules for an unknown one
        self.init_batch, self.max_batch, self.min_batch = init_batch, max_batch, min_batch
        self.multiple_of, self.fraction, self.max_growth = multiple_of, float(fraction), float(max_growth)
        self.hysteresis, self.monotone, self.ramp_per_k = float(hysteresis), monotone, float(ramp_per_k)
        self.gpus, self.nodes = gpus, nodes
        self.agent = None
        if throughput_model is not None:
            local = (1, max_per_gpu_batch or (1 << 30))
            self.agent = GoodputAgent(BatchLimits(init_batch, max_batch, local=local), throughput_model)
            self.agent.observe(gpus)
        self.batch = init_batch
        self._accum = (0, 0)                                  # (per-GPU batch, accumulation steps) of Pollux
        self.lr: ElasticLR | None = None
        self._lr_gns = False                                  # self.lr's AdaScale reads what propose gets
        self.proposals: list[Proposal] = []

    # ------------------------------------------------------------------------------------------ LR
    def lr_multiplier(self, batch: int, gns=None) -> float:
        """The rule's LR multiplier at S = batch/M0 (for a ramp, the value it ramps to)."""
        info = rule_info(self.rule.ramp_to) if self.rule.is_ramp else self.rule
        rule = get_rule(info.name, stats=gns, init_batch=self.init_batch) if info.needs_gns else \
            get_rule(info.name)
        return float(rule.multiplier(batch / self.init_batch))

    def elastic_lr(self, optimizer, gns=None) -> ElasticLR:
        """An :class:`~elasticlab.lr.ElasticLR` on ``optimizer`` with this rule (Dynamic SGD: its ramp),
        kept in ``self.lr`` and told of every batch change by :meth:`apply`; step inside
        ``with ctl.lr.applied():``. AdaScale reads ``gns``, or, where none is given, what :meth:`propose`
        and :meth:`step` are given (the monitor)."""
        self._lr_gns = gns is None and self.rule.needs_gns     # (fed by propose)
        if self.rule.is_ramp:
            ramp = self.rule.cls(steps_per_k=self.ramp_per_k)
            self.lr = ElasticLR(optimizer, self.init_batch, rule=self.rule.ramp_to, ramp=ramp, gns=gns,
                                global_batch=self.batch)
        else:
            self.lr = ElasticLR(optimizer, self.init_batch, rule=self.rule.name, gns=gns,
                                global_batch=self.batch)
        return self.lr

    # ------------------------------------------------------------------------------------------ batch
    def _round(self, b: float, lo: int) -> int:
        """``b`` rounded down to a multiple of ``multiple_of`` within [lo, max_batch]: up to the first one at
        or above ``lo`` where it falls below; the current batch where no multiple lies in the range."""
        m = self.multiple_of
        new = int(b // m) * m
        if new < lo:
            new = -(-lo // m) * m
        return new if new <= self.max_batch else self.batch

    def propose(self, gns) -> Proposal:
        """The next global batch from ``gns`` (a :class:`~elasticlab.gns.GNSMonitor`, an estimator, or
        B_simple itself); the current batch while the GNS is not yet measured."""
        if self.lr is not None and self._lr_gns and gns is not None:
            self.lr.gns = self.lr.rule.stats = gns            # AdaScale's statistics: the live GNS
        phi = _phi(gns)
        cur = self.batch
        if phi is None:
            p = Proposal(cur, self.lr_multiplier(cur, gns), math.nan, False, "no GNS measured yet",
                         *self._accum)
        elif self.agent is not None:
            p = self._by_goodput(phi, gns)
        else:
            p = self._by_noise_scale(phi, gns)
        self.proposals.append(p)
        return p

    def _by_noise_scale(self, phi: float, gns) -> Proposal:
        cur = self.batch
        target = min(max(self.fraction * phi, self.min_batch), self.max_batch)
        why = f"{self.fraction:g}·B_simple = {self.fraction * phi:.4g}"
        if self.monotone and target < cur:
            target, why = cur, why + ", never shrinking"
        if target > cur * self.max_growth:
            target, why = cur * self.max_growth, why + f", at most x{self.max_growth:g} per decision"
        new = self._round(target, max(self.min_batch, cur) if self.monotone else self.min_batch)
        if cur and abs(new - cur) < self.hysteresis * cur:
            new, why = cur, why + f", within {self.hysteresis:.0%} of the current batch"
        return Proposal(new, self.lr_multiplier(new, gns), phi, new != cur, why, *self._accum)

    def _by_goodput(self, phi: float, gns) -> Proposal:
        self.agent.grad_stats = phi
        cur = self._accum if self._accum != (0, 0) else None
        c = self.agent.best_batch(self.gpus, self.nodes, mode="goodput", current=cur,
                                  hysteresis=1.0 + self.hysteresis)
        why = f"highest predicted goodput on {self.gpus} GPU(s) at B_simple = {phi:.4g}"
        return Proposal(int(c.global_batch), self.lr_multiplier(int(c.global_batch), gns), phi,
                        int(c.global_batch) != self.batch, why, int(c.per_gpu), int(c.accum))

    def apply(self, proposal: Proposal) -> None:
        """Adopt ``proposal`` (the caller changes its data loader); an :meth:`elastic_lr` follows it."""
        if not (isinstance(proposal.batch, int) and proposal.batch >= 1):
            raise ValueError(f"a proposal's batch must be an integer >= 1, got {proposal.batch!r}")
        self.batch = proposal.batch
        self._accum = (proposal.per_gpu, proposal.accum_steps)
        if self.lr is not None:
            self.lr.on_batch_change(proposal.batch)

    def step(self, gns) -> Proposal:
        """:meth:`propose` and, when it changes the batch, :meth:`apply`."""
        p = self.propose(gns)
        if p.changed:
            self.apply(p)
        return p


def _phi(gns) -> float | None:
    """B_simple from whatever holds it; None before the first measurement (NaN)."""
    if gns is None:
        return None
    try:
        phi = noise_scale(gns)
    except ValueError:                                        # NaN statistics: nothing measured yet
        return None
    return phi if math.isfinite(phi) or phi == math.inf else None
