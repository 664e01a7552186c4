"""``PerSampleGradNorms``: per-example gradient norms of a model, from layer inputs and output gradients.

Inside the context, after ``loss.backward()``, ``sq_norms()`` is ‖∇θ ℓ_i‖² (B,) over all trainable
parameters, where the loss is (1/B)·Σ ℓ_i (``"mean"``) or Σ ℓ_i (``"sum"``) over the batch dimension (dim 0
of each layer's input). Per-example gradients are never materialised for the whole batch (McCandlish et al.
App. A.1 needs only their norms). ``fused=True`` lets Linear/Conv/LayerNorm form their parameter gradients
and norms in one backward (see :mod:`elasticlab.gns.fused`); other layers, and all with ``fused=False``, use
hooks.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns.rules import rule_for


class _Slot:
    """What one module recorded in the current step."""

    def __init__(self, owner: PerSampleGradNorms, name: str, module: nn.Module, rule, need: tuple[str, ...]):
        self.owner, self.name, self.module, self.rule, self.need = owner, name, module, rule, need
        self.calls = 0
        self.norms: dict[str, torch.Tensor] = {}

    def called(self) -> None:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                f"module {self.name!r} ({type(self.module).__name__}) ran {self.calls} times in one forward: "
                "per-example norms of shared weights need the sum of the per-call gradients, which is not "
                "supported; call the model once per backward")

    def record(self, norms: dict, batch: int) -> None:
        scale = float(batch) ** 2 if self.owner.loss_reduction == "mean" else 1.0
        for pname, v in norms.items():
            if pname in self.need:
                v = v.detach()
                self.norms[pname] = v * scale if scale != 1.0 else v


class PerSampleGradNorms:
    """Context manager measuring per-example squared gradient norms of ``model``.

    ``strict``: a trainable parameter no rule covers is a ValueError naming its module; with
    ``strict=False`` it is left out and listed in ``skipped``. Frozen parameters are always skipped.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", strict: bool = True,
                 fused: bool = True):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"PerSampleGradNorms needs an nn.Module, got {type(model).__name__}")
        self.model, self.loss_reduction, self.strict, self.fused = model, loss_reduction, strict, fused
        self.skipped: list[str] = []
        self._slots: list[_Slot] = []
        for name, mod in model.named_modules():
            direct = [pn for pn, p in mod.named_parameters(recurse=False) if p.requires_grad]
            if not direct:
                continue
            rule = rule_for(mod)
            covered = tuple(pn for pn in direct if rule is not None and pn in rule.params)
            missing = [pn for pn in direct if pn not in covered]
            if missing:
                full = [f"{name}.{pn}" if name else pn for pn in missing]
                if strict:
                    raise ValueError(
                        f"no per-example gradient-norm rule for module {name or '(root)'!r} of type "
                        f"{type(mod).__name__} (parameters {full}); register one with "
                        "elasticlab.gns.register_rule, freeze them, or pass strict=False to leave them out")
                self.skipped.extend(full)
            if covered:
                self._slots.append(_Slot(self, name, mod, rule, covered))
        self._handles: list = []
        self._patched: list[tuple[nn.Module, object]] = []
        self._active = False

    # ------------------------------------------------------------------------------------------ hooks
    def _begin_step(self, *_):
        for s in self._slots:
            s.calls, s.norms = 0, {}

    def _forward_hook(self, slot: _Slot):
        def hook(module, inputs, output):
            slot.called()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                saved = tuple(i.detach() if isinstance(i, torch.Tensor) else i for i in inputs)

                def on_grad(g):
                    if not inputs or not isinstance(saved[0], torch.Tensor):
                        raise ValueError(f"module {slot.name!r}: expected a tensor input")
                    norms = slot.rule.norms(module, saved, g.detach(), slot.need)
                    slot.record(norms, saved[0].shape[0])
                output.register_hook(on_grad)
        return hook

    def __enter__(self) -> PerSampleGradNorms:
        if self._active:
            raise RuntimeError("PerSampleGradNorms is already active")
        self._handles.append(self.model.register_forward_pre_hook(self._begin_step))
        for s in self._slots:
            fwd = s.rule.fused(s.module, s) if (self.fused and s.rule.fused is not None) else None
            if fwd is not None:
                self._patched.append((s.module, s.module.__dict__.get("forward")))
                s.module.forward = fwd
            else:
                self._handles.append(s.module.register_forward_hook(self._forward_hook(s)))
        self._active = True
        self._begin_step()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for mod, old in self._patched:
            if old is None:
                del mod.forward
            else:
                mod.forward = old
        self._handles, self._patched, self._active = [], [], False

    # ------------------------------------------------------------------------------------------ results
    def param_sq_norms(self) -> dict[str, torch.Tensor]:
        """{parameter name: (B,)} per-example squared gradient norms of the last backward."""
        out = {}
        for s in self._slots:
            for pname, v in s.norms.items():
                out[f"{s.name}.{pname}" if s.name else pname] = v
        return out

    def layer_sq_norms(self) -> dict[str, torch.Tensor]:
        """{module name: (B,)}: per-example squared norms of each module's own trainable parameters."""
        out = {}
        for s in self._slots:
            if s.norms:
                vals = list(s.norms.values())
                total = vals[0]
                for v in vals[1:]:
                    total = total + v
                out[s.name] = total
        return out

    def sq_norms(self) -> torch.Tensor:
        """(B,) per-example ‖∇θ ℓ_i‖² over all covered trainable parameters, of the last backward."""
        layers = self.layer_sq_norms()
        if not layers:
            raise RuntimeError("no per-example norms recorded: run forward and loss.backward() inside the "
                               "context")
        sizes = {k: v.shape[0] for k, v in layers.items()}
        if len(set(sizes.values())) != 1:
            raise RuntimeError(f"layers disagree on the batch size (batch dimension must be first): {sizes}")
        vals = list(layers.values())
        total = vals[0].clone()
        for v in vals[1:]:
            total += v
        return total

    def grad_sq_norm(self, batch_size: int | None = None) -> float:
        """‖ḡ‖² of the batch-mean gradient from the covered parameters' ``.grad`` (which must hold this
        batch's gradient alone: zero them before the backward). With ``"sum"`` it divides by B²."""
        total = 0.0
        for s in self._slots:
            for pname in s.need:
                p = getattr(s.module, pname)
                if p is not None and p.grad is not None:
                    total += float(p.grad.detach().double().pow(2).sum())
        if self.loss_reduction == "sum":
            if batch_size is None:
                batch_size = int(self.sq_norms().shape[0])
            total /= batch_size ** 2
        return total

    def layer_grad_sq_norms(self, batch_size: int | None = None) -> dict[str, float]:
        """{module name: ‖ḡ‖²} per module, as :meth:`grad_sq_norm` (for per-layer GNS)."""
        div = 1.0
        if self.loss_reduction == "sum":
            div = float(batch_size if batch_size is not None else self.sq_norms().shape[0]) ** 2
        out = {}
        for s in self._slots:
            tot = 0.0
            for pname in s.need:
                p = getattr(s.module, pname)
                if p is not None and p.grad is not None:
                    tot += float(p.grad.detach().double().pow(2).sum())
            out[s.name] = tot / div
        return out
