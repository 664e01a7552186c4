"""Learning dynamics of deep linear and linearised ReLU nets (P3: Basu et al. 2019; Saxe et al. 2014;
Du et al. 2018; Arora et al. 2018). Derivations: ``theory/``.

Pieces: :class:`MLP` (linear/ReLU/leaky nets on a flat float64 parameter vector), :func:`train`
(deterministic full-batch GD in numba, recorded as a :class:`Trajectory`), tasks and initialisations,
conserved quantities (``invariants``), Saxe's closed forms (``saxe``), SVD modes (``modes``), phase
detection (``phases``), linearisation through activation masks (``linearise``), and the P3-T1..T6
experiments (``experiments``).
"""
from .init import aligned_init, random_init
from .invariants import (
    balancedness,
    balancedness_drift,
    invariant_drift,
    layer_invariants,
    neuron_invariants,
    step_change,
)
from .linearise import (
    activation_masks,
    effective_maps,
    exactness_error,
    linearised_forward,
    mask_change,
    masked_layer_norms,
)
from .mlp import MLP, loss
from .modes import crossing_times, mode_strengths, singular_values
from .phases import Burst, Phases, detect_phases
from .saxe import half_time, mode_curves, mode_strength, plateau_time, time_to
from .tasks import SaxeTask, regression_task, saxe_task, whitened_inputs
from .train import Trajectory, gradient, record_steps, train

__all__ = [
    "MLP", "loss", "Trajectory", "train", "gradient", "record_steps",
    "SaxeTask", "saxe_task", "whitened_inputs", "regression_task", "random_init", "aligned_init",
    "balancedness", "balancedness_drift", "layer_invariants", "neuron_invariants", "invariant_drift",
    "step_change", "mode_strength", "mode_curves", "time_to", "half_time", "plateau_time",
    "mode_strengths", "singular_values", "crossing_times", "Burst", "Phases", "detect_phases",
    "activation_masks", "effective_maps", "linearised_forward", "exactness_error", "masked_layer_norms",
    "mask_change",
]
