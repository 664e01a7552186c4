"""Reference per-example squared gradient norms by ``torch.func`` (vmap of grad), for tests and benchmarks,
and by a loop of one backward per example where vmap does not batch a layer (``nn.LSTM``'s ATen kernel),
per parameter (:func:`loop_param_sq_norms`, :func:`example_param_sq_norms` from any per-example losses) or
in total (:func:`loop_sq_norms`).

Both materialise per-example gradients: exact but memory-hungry (vmap) or slow (the loop).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def func_param_sq_norms(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                        chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """{trainable param name: (B,) ‖∇ ℓ_i‖²} with ℓ_i = loss_fn(model(x_i[None]), y_i[None]) (a sum-reduced
    per-example loss)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    g = vmap(grad(one), in_dims=(None, 0, 0), chunk_size=chunk_size)(params, x, y)
    return {k: v.reshape(v.shape[0], -1).pow(2).sum(1) for k, v in g.items()}


def func_sq_norms(model: nn.Module, loss_fn, x, y, chunk_size: int | None = None) -> torch.Tensor:
    """(B,) ‖∇θ ℓ_i‖² over all trainable parameters, by torch.func."""
    vals = list(func_param_sq_norms(model, loss_fn, x, y, chunk_size).values())
    return torch.stack(vals).sum(0)


def example_param_sq_norms(model: nn.Module, losses) -> dict[str, torch.Tensor]:
    """{trainable param name: (B,) ‖∇ ℓ_i‖²} from ``losses``, an iterable of the B per-example scalar losses
    ℓ_i (a generator forms each one when its turn comes): one backward per example. The graph is retained,
    so the losses may share one forward (examples that do not interact, such as EmbeddingBag's bags). A
    parameter ℓ_i does not reach has a zero."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        del loss                                   # its graph goes now, unless the losses share a forward
        rows.append([p.new_zeros(()) if g is None else g.detach().pow(2).sum()
                     for p, g in zip(params.values(), grads)])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def loop_param_sq_norms(model: nn.Module, loss_fn, x: torch.Tensor,
                        y: torch.Tensor) -> dict[str, torch.Tensor]:
    """{trainable param name: (B,) ‖∇ ℓ_i‖²}, ℓ_i = loss_fn(model(x_i[None]), y_i[None]) (as
    :func:`func_param_sq_norms`): one forward and backward per example."""
    return example_param_sq_norms(model, (loss_fn(model(x[i:i + 1]), y[i:i + 1]) for i in range(x.shape[0])))


def loop_sq_norms(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) ‖∇θ ℓ_i‖², ℓ_i = loss_fn(model(x_i[None]), y_i[None]): one forward and backward per example."""
    return torch.stack(list(loop_param_sq_norms(model, loss_fn, x, y).values())).sum(0)
