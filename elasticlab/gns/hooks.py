"""The forward hook of a slot on its hook rule (:class:`~elasticlab.gns.PerSampleGradNorms` installs it where
a layer has no fused form, or runs with ``fused=False``): at each call it counts the call, and registers on
the output a tensor hook that, in the backward, runs the rule on the call's inputs (kept by
:func:`~elasticlab.gns.capture.kept`) and the output's gradient. On the way: a rule's own evaluation of the
module is left out (:class:`~elasticlab.gns.slot.Quiet`); a call without the batch is followed to its
broadcast (:mod:`.layers.broadcast_params`); a recomputation packs what its forward did; under
``torch.compile`` the norms leave the backward through the sink (:mod:`.sink`); the broadcast audit notes
the output. A rule with ``kwargs`` also gets the call's keyword arguments, as a dict after its positional
ones (the generic rule: forwards that read tensors passed by keyword, Whisper's positional embedding).
"""
from __future__ import annotations

import torch

from elasticlab.gns.capture import kept, pack_again
from elasticlab.gns.folds import fold_for
from elasticlab.gns.layers.broadcast_params import follow_call, unbatched
from elasticlab.gns.sink import tap
from elasticlab.gns.slot import Quiet, recomputing


def install(owner, slot):
    """The hook on ``slot``'s module (its handle)."""
    return slot.host.register_forward_hook(forward_hook(owner, slot), with_kwargs=True)


def forward_hook(owner, slot):
    def hook(module, args, kwargs, output):
        if Quiet.depth:                   # a rule's own evaluation of the module (generic rule)
            return
        inputs = (*args, kwargs) if slot.rule.kwargs and kwargs else args
        unb = slot.rule.unbatched and unbatched(slot, inputs, output)   # (layers.broadcast_params)
        counted = slot.called(unb)
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if unb:
            return follow_call(slot, inputs, output, counted)
        compiling = torch.compiler.is_compiling()
        if not counted:                   # a recomputation packs what its forward did (capture.kept)
            if not compiling and recomputing():
                pack_again(inputs)
            return
        # compiled: the norms leave the backward as a gradient (elasticlab.gns.sink)
        if compiling and (t := tap(slot, module, inputs, output)) is not None:
            return t
        if not compiling and owner._audit.notes is not None:
            owner._audit.note(slot, inputs, output)
        first = inputs[0] if inputs else None
        if not (isinstance(first, torch.Tensor) or slot.rule.kwargs and isinstance(first, dict)):
            raise ValueError(f"module {slot.name!r}: expected a tensor input")
        get = kept(inputs)
        fold = fold_for(slot, first) if slot.rule.folds else None   # rows (B·T, …): read as (B, T, …)

        def on_grad(g):
            saved = get()
            if fold is not None:
                R = g.shape[0]
                saved = tuple(fold.unfold(t) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == R
                              else t for t in saved)
                g = fold.unfold(g)
            if slot.shared:                     # formed with its other calls when read
                slot.pending.append((saved, g.detach()))
                return
            norms = slot.rule.norms(module, saved, g.detach(), slot.call_need)
            slot.record(norms, saved[0].shape[0] if isinstance(saved[0], torch.Tensor) else g.shape[0])
        output.register_hook(on_grad)
    return hook
