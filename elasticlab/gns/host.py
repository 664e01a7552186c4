"""Device values read to the host together: one stack and one transfer per device, not one per value (each
read of a CUDA value synchronises the host with the device)."""
from __future__ import annotations

import torch


def read(values: list[torch.Tensor]) -> list[float]:
    """``values`` (0-dim tensors, on any devices) as Python floats, in their order: stacked per device and
    read with one ``tolist`` each."""
    by_dev: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        by_dev.setdefault(v.device, []).append(i)
    out = [0.0] * len(values)
    for idx in by_dev.values():
        for i, x in zip(idx, torch.stack([values[i] for i in idx]).tolist()):
            out[i] = x
    return out
