"""What both callbacks log: the ``gns/*`` metrics of one :class:`~elasticlab.gns.GNSMonitor` record, and
the controller's proposal from it."""
from __future__ import annotations

import math


def metrics(record: dict, log_layers: bool, controller=None, monitor=None) -> dict[str, float]:
    """``gns/b_simple``, ``gns/grad_sq``, ``gns/trace_cov`` (+ ``gns/layer/<module>``, and with a controller
    ``gns/proposed_batch`` and ``gns/lr_multiplier``); non-finite values are left out. Adds the proposal's
    batch and multiplier to ``record`` too (so ``history`` keeps them)."""
    out = {f"gns/{k}": float(record[k]) for k in ("b_simple", "grad_sq", "trace_cov")}
    if log_layers:
        out.update({f"gns/layer/{name or 'root'}": float(v) for name, v in record.get("layers", {}).items()})
    if controller is not None:
        p = controller.step(monitor)
        record["proposed_batch"], record["lr_multiplier"] = p.batch, p.lr_multiplier
        out["gns/proposed_batch"], out["gns/lr_multiplier"] = float(p.batch), float(p.lr_multiplier)
    return {k: v for k, v in out.items() if math.isfinite(v)}

