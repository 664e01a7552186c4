"""The first training step eager under ``torch.compile``, so that nobody has to write one.

What only an eager forward shows is learned in one eager step and reused by the compiled steps after it:
the layout of rows that fold the batch (``gns.folds``), a batch-less output broadcast over the batch
(``gns.layers.expand_plan``), a module called several times (``gns.repeated``). Compiled from the first
step, those calls are refused by name. :class:`EagerFirst` holds ``torch.compiler.set_stance("force_eager")``
from the moment a :class:`~elasticlab.gns.PerSampleGradNorms` none of whose steps was read yet is entered
until a step is read, the model's next training forward begins, or the context is left; then the stance it
found is back (where the root's forward never runs, a submodule called by a LightningModule: at the read).
Every ``torch.compile`` region of the process runs eagerly meanwhile (the stance is global): one step at
eager speed, and the compile happens at the next.
"""
from __future__ import annotations

import torch


class EagerFirst:
    """Whether one :class:`~elasticlab.gns.PerSampleGradNorms` holds the stance. Holders are counted
    process-wide, so that contexts released in any order (a benchmark's, entered together) give back the
    stance found before the first of them."""
    _holders = 0
    _stance = None                 # the set_stance object of the first holder (its ``prev``: the stance)

    def __init__(self, enabled: bool):
        self.enabled, self.held, self.done = enabled, False, False

    def hold(self) -> None:
        """At the context's entry, until a step of it was read or its next training forward began."""
        if not self.enabled or self.done or self.held:
            return
        if EagerFirst._holders == 0:
            try:
                EagerFirst._stance = torch.compiler.set_stance("force_eager")
            except RuntimeError:         # (entered inside a compiled region, which cannot change the stance)
                return
        EagerFirst._holders += 1
        self.held = True

    def release(self, done: bool) -> None:
        """After a step (``done``: read, or the next training forward begun), or at the exit: the last holder
        gives back the stance found before the first."""
        self.done = self.done or done
        if not self.held:
            return
        self.held = False
        EagerFirst._holders -= 1
        if EagerFirst._holders == 0:
            stance, EagerFirst._stance = EagerFirst._stance, None
            stance.__exit__(None, None, None)
