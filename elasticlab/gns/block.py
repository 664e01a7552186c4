"""``NormBlock``: the per-example norm rows of every fused layer of a model in one tensor, one reset and one
read a step.

The fused layers' C++ autograd functions write each layer's per-example squared norms into a (2, B) buffer,
row 0 its weight's and row 1 its bias' (:meth:`elasticlab.gns.slot.Slot.buffer`). Here those buffers are
the rows of one (slots, 2, B) block: at each forward one multiply sets the rows the layers need to NaN
(until their backward writes them, so a read before it gives NaN) and leaves the others 0; :meth:`read` is
then f·Σ over the needed rows for every example, one matrix-vector product (weight 0 for a row nothing
needs). A row a backward writes but nothing needs (a frozen weight's beside a trained bias, as in BitFit) is
zeroed before the product, one more launch, since 0·inf would make every example NaN. A step of a small
model thus adds two launches, not one per layer. Layers of another batch size, dtype or device than the
block's keep their own buffers.
"""
from __future__ import annotations

import torch

ROWS = ("weight", "bias")


class NormBlock:
    """The shared rows of the slots of one :class:`~elasticlab.gns.PerSampleGradNorms`."""

    def __init__(self, slots: list):
        self.slots = slots
        self.tensor: torch.Tensor | None = None            # (slots, 2, B)
        self.key: tuple | None = None                       # (B, dtype, device)
        self.gen = 0                                        # bumped at each (re)allocation
        self.users: set[int] = set()                        # slot indices holding rows of it
        self._mask: torch.Tensor | None = None              # (slots, 2, 1): NaN in needed rows, else 0
        self._stray: torch.Tensor | None = None             # (2·slots, 1) bool: written, not needed (or None)
        self._weights: dict[float, torch.Tensor] = {}       # f -> (2·slots,): f in needed rows, else 0
        self._open = True                                   # no slot has asked for rows yet this step

    def begin(self) -> None:
        """At each forward: the needed rows NaN until this step's backward writes them."""
        self._open = True
        if self.tensor is not None:
            self.tensor.mul_(self._reset_mask())

    def rows(self, slot, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """``slot``'s (2, B) rows, or None when the block has another (B, dtype, device). The first request
        of a step may (re)allocate the block for its key (a new batch size)."""
        key = (batch, dtype, device)
        first, self._open = self._open, False
        if key != self.key:
            if not first:
                return None
            self.tensor = torch.zeros((len(self.slots), 2, batch), dtype=dtype, device=device)
            self.key, self.users, self._mask, self._weights = key, set(), None, {}
            self.gen += 1
        rows = self.tensor[slot.index]
        if slot.index not in self.users:                    # NaN now; in the reset mask from the next step
            self.users.add(slot.index)
            self._mask, self._weights = None, {}
            for r, p in enumerate(ROWS):
                if p in slot.need:
                    rows[r].fill_(float("nan"))
        return rows

    def read(self) -> torch.Tensor | None:
        """(B,) f·Σ of the needed rows (one matrix-vector product) when every recorded norm of this step is a
        row of the block as a C++ backward wrote it; else None (the caller's general path)."""
        if self.tensor is None or not self.users:
            return None
        for s in self.slots:
            if (not s.on_block) if s.index in self.users else bool(s.norms):
                return None
        blk = self.tensor
        f = self.slots[next(iter(self.users))].factor()
        w = self._weights.get(f)
        if w is None:        # f in the rows the users need, 0 in the others (a backward may write them)
            w = self._weights[f] = self._reset_mask().isnan().flatten().to(blk.dtype) * f
        flat = blk.view(2 * blk.shape[0], blk.shape[2])
        if self._stray is not None:
            flat = flat.masked_fill(self._stray, 0)
        return torch.mv(flat.t(), w)

    def _reset_mask(self) -> torch.Tensor:
        """(slots, 2, 1) multiplier of the reset: NaN in the users' needed rows, 0 elsewhere (a row no
        backward needs is 0, or what a backward wrote there, never read: its weight in :meth:`read` is 0)."""
        if self._mask is None:
            m = torch.zeros(len(self.slots), 2, 1, dtype=torch.float64)
            stray = torch.zeros(len(self.slots), 2, 1, dtype=torch.bool)
            for i in self.users:
                slot = self.slots[i]
                for r, p in enumerate(ROWS):
                    if p in slot.need:
                        m[i, r] = float("nan")
                    elif isinstance(getattr(slot.module, p, None), torch.Tensor):
                        stray[i, r] = True              # a parameter nothing needs: its row may be written
            self._mask = _to_device(m.to(self.tensor.dtype), self.tensor.device)
            self._stray = _to_device(stray.view(-1, 1), self.tensor.device) if bool(stray.any()) else None
        return self._mask


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host synchronisation: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory waits for the device). The mask is rebuilt in the forward
    of the step after its users change, so that step must not wait (``tests/gns/test_no_host_sync.py``)."""
    if device.type != "cuda":
        return t.to(device)
    try:
        pinned = t.pin_memory()
    except RuntimeError:                     # no page-locked memory to be had: the plain (waiting) copy
        return t.to(device)
    return pinned.to(device, non_blocking=True)
