"""Several forwards of the model feeding one backward: siamese or contrastive views (``loss(model(x1),
model(x2))``), micro-batches whose losses are summed before one backward. Each covered module then ran once
per forward, and an example's gradient is the sum over those calls, which the rules, seeing one call at a
time and keeping the last forward's state, do not form: the norms came out silently wrong (a two-view MLP:
up to 4× off). :class:`Forwards` numbers the model's forwards and hooks each one's outputs; a backward that
reaches the outputs of any forward but the last gives the readers an error to raise. A forward whose outputs
no backward reaches (an evaluation with gradients on) costs one hook and nothing more."""
from __future__ import annotations

import functools

from elasticlab.gns.broadcast import _tensors


class Forwards:
    """The model's forwards within one :class:`~elasticlab.gns.PerSampleGradNorms` context."""

    def __init__(self):
        self.count = 0                               # forwards begun so far
        self.error: RuntimeError | None = None       # set by a backward through an earlier forward's outputs

    def begin(self) -> None:
        self.count += 1
        self.error = None

    def end(self, output) -> None:
        """Hooks the forward's outputs (those with an autograd node)."""
        for t in _tensors(output):
            t.register_hook(functools.partial(self._reached, self.count))

    def _reached(self, n: int, grad) -> None:
        if n != self.count and self.error is None:
            self.error = RuntimeError(
                f"the backward went through the outputs of an earlier forward of the model ({self.count - n} "
                "before the last) as well: several forwards feeding one backward (two views of a siamese or "
                "contrastive model, micro-batches summed into one loss) make each layer's per-example "
                "gradient the sum over its calls, which is formed only within one forward of the model. "
                "Call the shared modules twice inside one forward (a wrapper whose forward takes both views; "
                "elasticlab.gns.repeated); where the examples of the forwards are distinct, concatenate "
                "their inputs into one batch")
