"""Under ``torch.compile``, a module whose own forward follows its bare parameters
(:mod:`.broadcast_params`: a ViT's root with its class token and position embedding) runs that forward
eagerly, since TorchDynamo cannot trace the :class:`~.broadcast_params.Followed` tensors; but its children
(the transformer blocks, the head), called from it with ordinary tensors, are still compiled, each as a
graph of its own. :class:`EagerParent` does this with TorchDynamo's frame callback: the parent's forward
is skipped by ``torch.compiler.disable(recursive=False)``, which leaves the callback in place; inside it the
callback is set aside, so the parent's own code and helper methods run eagerly, and given back for each
child's call (forward pre- and post-hooks), so the child's forward is compiled by the same
``torch.compile`` (its backend and options), except a call handed a tensor still followed (BEiT's layer
passes its relative position bias, a child's followed output, to its attention): that child runs eagerly.
Without a compile callback (eager training) it does nothing.
"""
from __future__ import annotations

import torch
from torch import nn

try:                                      # (TorchDynamo's frame callback: private, present since torch 2.0)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame
except ImportError:                       # pragma: no cover  (then the whole forward runs eagerly)
    get_eval_frame_callback = set_eval_frame = None

ENABLED = True                            # off: the parent's forward runs eagerly with all its children


def in_compiled_region() -> bool:
    """Whether the code runs within torch.compile: traced, or eagerly after a graph break (Dynamo's frame
    callback still set), where a tensor it returns goes on into compiled code."""
    if torch.compiler.is_compiling():
        return True
    return get_eval_frame_callback is not None and bool(get_eval_frame_callback())


def disable(fn):
    """The parent's forward, skipped by TorchDynamo but with its callback left in place (then set aside by
    :class:`EagerParent`); without the callback's API, skipped with everything it calls."""
    return torch.compiler.disable(fn, recursive=set_eval_frame is None)


class EagerParent:
    """A context for one module's forward: eager but for its direct children's calls (see the module)."""

    def __init__(self, module: nn.Module, handles: list, stays_eager=None):
        self.callback, self.inside, self.stays_eager, self._aside = None, 0, stays_eager, None
        # (not traced, since the callback is set inside; wrapped here, not at import, which would load Dynamo)
        child_in, child_out = (torch.compiler.disable(f, recursive=False) for f in (self._child_in,
                                                                                      self._child_out))
        for c in module.children():
            handles += [c.register_forward_pre_hook(child_in, prepend=True, with_kwargs=True),
                        c.register_forward_hook(child_out, always_call=True)]

    def __enter__(self):
        if not self.inside:                             # under torch.compile: set aside for the forward
            self._aside = CallbackAside().__enter__()
            self.callback = self._aside.callback or None
        self.inside += 1
        return self

    def __exit__(self, *exc):
        self.inside -= 1
        if not self.inside:
            self.callback = None
            self._aside.__exit__(*exc)

    def _child_in(self, child, args, kwargs):
        """A child's call compiled, unless ``stays_eager(args, kwargs)``: handed a tensor the parent's eager
        code is still following (a relative position bias a sibling returned), which Dynamo cannot trace."""
        if self.callback is not None and ENABLED and not (
                self.stays_eager is not None and self.stays_eager(args, kwargs)):
            set_eval_frame(self.callback)

    def _child_out(self, child, args, output):
        if self.callback is not None and ENABLED:
            set_eval_frame(None)


class CallbackAside:
    """Within a function TorchDynamo skipped with ``recursive=False`` (its frame callback still set): the
    callback set aside, so that what the function calls runs eagerly too, and given back after."""

    def __enter__(self):
        self.callback = get_eval_frame_callback() if set_eval_frame is not None else None
        if self.callback:
            set_eval_frame(None)
        return self

    def __exit__(self, *exc):
        if self.callback:
            set_eval_frame(self.callback)
