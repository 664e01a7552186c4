"""Tied weights: a token embedding whose table is the output layer's weight (GPT-2; Press & Wolf 2017).

One table W (V × E), two uses. Per example its gradient is the sum of the embedding's part
G_e = Σ_s e_{i_s} δe_sᵀ and the output layer's G_h = Σ_t δh_t a_tᵀ, so

    ‖G_e + G_h‖² = ‖G_e‖² + ‖G_h‖² + 2 Σ_{s,t} δh_t[i_s] (a_t · δe_s),

where i_s are the example's token indices, δe_s the gradient of the embedding's output at s, a_t the output
layer's input and δh_t the gradient of its output at t. The output layer's backward comes first: its rule
takes ‖G_h‖² and gathers δh at the embedding's indices of this step, an (T, S) matrix per example (G1's
B = 8, T = S = 1024: 32 MB in float32); the embedding's backward adds ‖G_h‖² and the cross term to its own
norm. So the table's norm is the embedding's (in its layer's norms); the output layer keeps its bias. Both
run on hooks, eagerly (under ``torch.compile`` a tied pair is an error). Any other sharing of a parameter
between covered modules is refused (:func:`untie`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.embedding import embedding_norms
from elasticlab.gns.layers.linear import linear_norms


class Tie:
    """An ``nn.Embedding`` slot and an ``nn.Linear`` slot sharing the embedding's table as the Linear's
    weight: their hook rules replaced by ones that form the table's per-example norm together."""

    def __init__(self, emb, head):
        self.emb, self.head = emb, head
        emb.tied = head.tied = True
        self.idx = self.gathered = self.a = self.head_sq = None
        self.traced = False
        head.need = tuple(p for p in head.need if p != "weight")      # the table's norm is the embedding's
        head.rule = dataclasses.replace(head.rule, norms=self._head_norms, fused=None)
        emb.rule = dataclasses.replace(emb.rule, norms=self._emb_norms, fused=None)

    def pre_hook(self, module, args):
        """At the embedding's forward: this step's indices, the last step's leftovers dropped, and whether
        the forward is being traced (the flag a traced hook sets is replayed after the graph ran)."""
        self.traced = torch.compiler.is_compiling()
        self.idx, self.gathered, self.a, self.head_sq = args[0], None, None, None

    def check(self) -> None:
        """After the model's forward: a RuntimeError if this step was compiled (eager only)."""
        if self.traced:
            raise RuntimeError(f"tied weights ({self.emb.full('weight')!r} is {self.head.full('weight')!r}): "
                               "their per-example norms are taken eagerly, not under torch.compile; untie "
                               "them, or run the model without compiling it")

    def _head_norms(self, module, inputs, d, need):
        """The output layer's hook rule: its bias as usual; ‖G_h‖² and δh_t[i_s] (B, T, S) kept."""
        out = linear_norms(module, inputs, d, (*need, "weight"))
        self.head_sq = out.pop("weight")
        if self.emb.calls == 0:            # the embedding did not run (e.g. embeddings passed in): G_h alone
            self.emb.record({"weight": self.head_sq}, d.shape[0])
            return out
        if "weight" in self.emb.norms:     # the embedding's backward already ran: its norm misses G_h
            raise RuntimeError(f"tied weights ({self.emb.full('weight')!r} is {self.head.full('weight')!r}): "
                               "the output layer's backward ran after the embedding's, so the table's norm "
                               "cannot take both parts; the output layer must use the embedding's output")
        acc = kernels.acc_dtype(d.dtype)
        B = d.shape[0]
        d3, idx = d.reshape(B, -1, d.shape[-1]), self.idx.reshape(B, -1).long()
        self.gathered = torch.gather(d3, 2, idx[:, None, :].expand(B, d3.shape[1], idx.shape[1])).to(acc)
        self.a = inputs[0].reshape(B, -1, inputs[0].shape[-1])
        return out

    def _emb_norms(self, module, inputs, d, need):
        """The embedding's hook rule, plus ‖G_h‖² and the cross term where the output layer ran."""
        out = embedding_norms(module, inputs, d, need)
        if "weight" in out and self.gathered is not None:
            B = d.shape[0]
            de = d.reshape(B, -1, d.shape[-1]).to(self.gathered.dtype)
            if module.padding_idx is not None:               # no gradient reaches the padding row
                de = de.masked_fill((inputs[0].reshape(B, -1) == module.padding_idx).unsqueeze(-1), 0)
            k = torch.bmm(self.a.to(de.dtype), de.transpose(1, 2))               # a_t · δe_s: (B, T, S)
            cross = (self.gathered * k).sum((1, 2))
            out["weight"] = out["weight"] + self.head_sq + 2 * cross
        self.gathered = self.a = self.head_sq = None
        return out


def _pair(pairs) -> Tie | None:
    """A :class:`Tie` when ``pairs`` (the (slot, name) uses of one parameter) are an embedding's table and a
    Linear's weight, else None."""
    if len(pairs) != 2:
        return None
    (e, en), (h, hn) = sorted(pairs, key=lambda p: not isinstance(p[0].module, nn.Embedding))
    if type(e.module) is nn.Embedding and type(h.module) is nn.Linear and en == hn == "weight":
        return Tie(e, h)
    return None


def untie(slots: list, strict: bool, skipped: list[str]) -> list[Tie]:
    """The parameters that several covered slots need: a :class:`Tie` for an embedding's table that is a
    Linear's weight; any other sharing is a ValueError naming them (``strict``), else left out (listed in
    ``skipped``)."""
    owners: dict[int, list] = {}
    for s in slots:
        for pn in s.need:
            owners.setdefault(id(getattr(s.module, pn)), []).append((s, pn))
    ties = []
    for pairs in (p for p in owners.values() if len(p) > 1):
        tie = _pair(pairs)
        if tie is not None:
            ties.append(tie)
            continue
        names = [s.full(pn) for s, pn in pairs]
        if strict:
            raise ValueError(
                f"parameter {names[0]!r} is also {', '.join(map(repr, names[1:]))} (tied weights): its "
                "per-example gradient is the sum of the modules' parts, whose norm is not the sum of their "
                "norms, and only an embedding tied to a Linear's weight has a rule for it; untie or freeze "
                "it, or pass strict=False to leave it out (listed in skipped)")
        skipped.extend(names)
        for s, pn in pairs:
            s.need = tuple(p for p in s.need if p != pn)
    return ties
