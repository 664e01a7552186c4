"""A ``torch.amp.GradScaler``'s loss scale (Micikevicius et al. 2018), read without a host sync: what
:class:`~elasticlab.gns.PerSampleGradNorms` and :class:`~elasticlab.gns.GNSMonitor` divide out."""
from __future__ import annotations

import torch


def current(scaler) -> torch.Tensor | None:
    """This step's scale: None without an enabled scaler; a copy of its device tensor once it has been used
    (no host sync), else its initial scale (a 0-dim float64 CPU tensor)."""
    if scaler is None or not scaler.is_enabled():
        return None
    t = getattr(scaler, "_scale", None)
    if t is None:
        return torch.tensor(float(scaler.get_scale()), dtype=torch.float64)
    return t.detach().clone()


def unscaled(scaler) -> bool:
    """Whether ``scaler.unscale_`` already ran for one of its optimizers this step (the gradients hold no
    scale)."""
    states = getattr(scaler, "_per_optimizer_states", {}) or {}
    return any(getattr(st.get("stage"), "name", "") == "UNSCALED" for st in states.values())
