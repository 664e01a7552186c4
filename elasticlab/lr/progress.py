"""Scale-invariant progress: AdaScale's tau (``tau += r_t``) = Pollux's statistical epochs.

One optimizer step at batch M advances ``gain`` steps at the initial batch M0 (``gain`` = AdaScale's r,
or S under the perfect-scaling assumption); statistical epochs = ``tau * M0 / |X|`` (Pollux).
"""
from __future__ import annotations

import math

from elasticlab.checks import number


class ScaleInvariantProgress:
    def __init__(self, init_batch: float):
        self.init_batch = number("init_batch", init_batch, lambda b: b > 0, "a finite number > 0")
        self.progress = 0.0  # tau, in steps at M0
        self.steps = 0  # optimizer steps taken
        self.samples = 0.0  # examples consumed

    def update(self, gain: float, batch: float) -> float:
        """Count one optimizer step of global batch ``batch`` and gain ``gain``; returns tau."""
        if not (gain >= 0 and math.isfinite(gain)):
            raise ValueError(f"gain must be a finite number >= 0, got {gain}")
        if not batch > 0:
            raise ValueError(f"batch must be > 0, got {batch}")
        self.progress += float(gain)
        self.steps += 1
        self.samples += float(batch)
        return self.progress

    def epochs(self, dataset_size: int) -> float:
        """Pollux's statistical epochs: progress in M0-steps times M0 over the dataset size."""
        if not dataset_size > 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        return self.progress * self.init_batch / dataset_size

    def state_dict(self) -> dict:
        return {"init_batch": self.init_batch, "progress": self.progress, "steps": self.steps,
                "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.init_batch = float(state["init_batch"])
        self.progress = float(state["progress"])
        self.steps = int(state["steps"])
        self.samples = float(state["samples"])

    def __repr__(self):
        return f"ScaleInvariantProgress(tau={self.progress:.3f}, steps={self.steps})"
