"""Conserved quantities of gradient flow and their drift under finite steps.

Linear nets (Arora et al. 2018, Thm. 1; Du et al. 2018, Thm. 2.2): C_j = W_{j+1}ᵀW_{j+1} − W_jW_jᵀ is
constant, so is its trace ‖W_{j+1}‖²_F − ‖W_j‖²_F. Homogeneous nets (linear, ReLU, leaky ReLU; Du et al.
Thm. 2.1): per hidden neuron i of layer j, ‖W_j[i,:]‖² + b_j[i]² − ‖W_{j+1}[:,i]‖² is constant (the bias
counts as an incoming weight). A GD step of size η changes each of these by exactly η² times the same
expression in the gradients (theory/02_relu_linearisation.md, Eq. (2.6)).
"""
from __future__ import annotations

import numpy as np

__all__ = ["balancedness", "balancedness_drift", "layer_invariants", "neuron_invariants",
           "invariant_drift", "step_change"]


def _wb(obj, biases=None):
    """(weights, biases) from a Trajectory/MLP or explicit lists."""
    if hasattr(obj, "weights") and not isinstance(obj, list | tuple):
        return obj.weights, obj.biases
    return list(obj), biases


def balancedness(weights) -> list:
    """C_j = W_{j+1}ᵀW_{j+1} − W_jW_jᵀ for j = 1..L−1 (works on stacks with a leading time axis)."""
    ws, _ = _wb(weights)
    sw = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    return [sw(ws[j + 1]) @ ws[j + 1] - ws[j] @ sw(ws[j]) for j in range(len(ws) - 1)]


def balancedness_drift(traj) -> np.ndarray:
    """max_{ab} |C_j(t) − C_j(0)|_{ab}, shape (R, L−1) (P3-T1)."""
    cs = balancedness(traj.weights)
    if not cs:
        return np.zeros((len(traj.steps), 0))
    return np.stack([np.abs(c - c[0]).max(axis=(1, 2)) for c in cs], axis=1)


def neuron_invariants(weights, biases=None) -> list:
    """Per hidden layer j, the vector ‖W_j[i,:]‖² + b_j[i]² − ‖W_{j+1}[:,i]‖² (Du et al. 2018, Thm. 2.1)."""
    ws, bs = _wb(weights, biases)
    out = []
    for j in range(len(ws) - 1):
        inc = np.sum(ws[j] ** 2, axis=-1)
        if bs is not None:
            inc = inc + bs[j] ** 2
        out.append(inc - np.sum(ws[j + 1] ** 2, axis=-2))
    return out


def layer_invariants(weights, biases=None) -> np.ndarray:
    """‖W_j‖²_F + ‖b_j‖² − ‖W_{j+1}‖²_F for j = 1..L−1 (sum of the neuron invariants), shape (..., L−1)."""
    inv = neuron_invariants(weights, biases)
    return np.stack([v.sum(axis=-1) for v in inv], axis=-1)


def invariant_drift(traj, per_neuron: bool = False) -> np.ndarray:
    """|I(t) − I(0)| of the layer invariants (R, L−1), or, with ``per_neuron``, the max over neurons."""
    if per_neuron:
        inv = neuron_invariants(traj)
        return np.stack([np.abs(v - v[0]).max(axis=-1) for v in inv], axis=1)
    li = layer_invariants(traj)
    return np.abs(li - li[0])


def step_change(net, grad, lr: float, per_neuron: bool = False):
    """Exact change of the invariants in one GD step θ ← θ − η∇L: η² times the invariant of the gradient.

    ``grad`` is laid out like ``net.params``. Returns per layer (or, with ``per_neuron``, per neuron) values.
    """
    g = net.__class__(net.widths, net.slope, net.has_bias, grad)
    inv = neuron_invariants(g)
    lr2 = float(lr) ** 2
    return [lr2 * v for v in inv] if per_neuron else lr2 * np.array([v.sum() for v in inv])
