"""The originals of a parametrized tensor (``torch.nn.utils.parametrize``): a layer's weight made from them
by a function, W = f(θ₁, θ₂, …), as weight normalisation makes it, W = g·v/‖v‖ (Salimans & Kingma 2016,
eq. 2; ``parametrizations.weight_norm``: wav2vec 2.0's and HuBERT's positional convolution), or
``spectral_norm``, ``orthogonal`` and parametrizations of one's own.

The layer's own rule sees ∇_W ℓ_b, not ∇_θ ℓ_b = J_f(θ)ᵀ ∇_W ℓ_b. The originals live in a
``ParametrizationList`` (``conv.parametrizations.weight.original0``); its slot hooks the layer that owns it
(``Rule.on_owner``), and its per-example gradients are the vjp of the owner's forward at each example's input
and output gradient with the originals in place (``torch.func.functional_call``; vmap over the examples, as
the generic rule does, :func:`elasticlab.gns.layers.generic.summed_norms`), which goes through f. Exact,
with the memory of B per-example gradients of the originals (chunked). The owner's other parameters (a
convolution's bias) keep their own rule. :data:`ENABLED` off: the originals are uncovered again (an error
naming them, or left out with ``strict=False``).
"""
from __future__ import annotations

import warnings

from torch import nn
from torch.nn.utils import parametrize

from elasticlab.gns.layers.generic import summed_norms
from elasticlab.gns.registry import Rule, register_fallback

ENABLED = True


def applies(module: nn.Module) -> bool:
    return ENABLED and isinstance(module, parametrize.ParametrizationList)


def originals(module: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, _ in module.named_parameters(recurse=False))


def owner_norms(owner: nn.Module, inputs: tuple, d, need) -> dict:
    """Hook rule on the owner's call: ‖∇θ ℓ_b‖² of each needed original, ``need`` named from the owner
    (``parametrizations.weight.original0``); the norms come back under the originals' own names."""
    return owner_summed(owner, [(inputs, d)], need)


def owner_summed(owner: nn.Module, calls: list, need) -> dict:
    """The same over several calls of the owner in one forward (:mod:`elasticlab.gns.repeated`)."""
    with warnings.catch_warnings():        # (vmap has no batching rule for weight_norm's backward: slower)
        warnings.filterwarnings("ignore", message="There is a performance drop")
        norms = summed_norms(owner, calls, need, what=(
            f"{type(owner).__name__}'s parametrized tensors take the per-example gradients of their "
            "originals by torch.func on its forward, but"))
    return {n.rsplit(".", 1)[-1]: v for n, v in norms.items()}


register_fallback(Rule(norms=owner_norms, params=originals, summed=owner_summed, kwargs=True, on_owner=True),
                  applies)
