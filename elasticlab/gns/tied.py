"""Tied weights: a token embedding whose table is also the output layer's weight (GPT-2; Press & Wolf 2017),
and one table shared by several embeddings (T5's encoder and decoder, with or without its output layer).

One table W (V × E), several uses. Per example its gradient is the sum of the embeddings' parts
G_e = Σ_s e_{i_s} δe_sᵀ (s over the positions of every embedding call, concatenated) and the output layer's
G_h = Σ_t δh_t a_tᵀ, so

    ‖G_e + G_h‖² = ‖G_e‖² + ‖G_h‖² + 2 Σ_{s,t} δh_t[i_s] (a_t · δe_s),

where i_s are the example's token indices, δe_s the gradient of an embedding's output at s, a_t the output
layer's input and δh_t the gradient of its output at t. ‖G_e‖² is the embedding rule on the calls
concatenated along the positions (exact by linearity, as for a repeated module). The output layer's
backward comes first: its rule takes ‖G_h‖² and gathers δh at the indices of this step's embedding calls, an
(T, S) matrix per example (G1's B = 8, T = S = 1024: 32 MB in float32); each embedding's backward adds its
share of the cross term, and the last one of the step forms the table's norm. So the table's norm is the
first embedding's (in its layer's norms); the output layer keeps its bias. Under tensor parallelism (the
table split along the vocabulary, or along its width, one mesh dimension) each process forms the three terms
on its block of the table (:func:`~elasticlab.gns.sharded.local_call`: its rows' positions, its vocabulary
columns of δh, or its width of a and δe), and their sum over the processes is the whole table's
(:func:`~elasticlab.gns.sharded.reduce_norms`). All run on hooks, eagerly: under
``torch.compile`` the tied modules' hooks are skipped by Dynamo (a graph break at each tied module, whose
call then runs eagerly; the rest of the model compiles). Any other sharing of a parameter between covered
modules is refused (:func:`untie`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import by_position
from elasticlab.gns.layers.embedding import embedding_norms, scale_of, scaled_embedding_norms
from elasticlab.gns.layers.linear import linear_norms
from elasticlab.gns.sharded import local
from elasticlab.gns.slot import recomputing


class Tie:
    """``nn.Embedding`` slots ``embs`` and at most one ``nn.Linear`` slot ``head`` sharing one table: their
    hook rules replaced by ones that form the table's per-example norm together, kept by ``embs[0]``."""

    def __init__(self, embs: list, head):
        self.embs, self.head, self.keeper = embs, head, embs[0]
        self.members = [*embs, *([head] if head is not None else [])]
        self.by_module = {id(e.module): e for e in embs}
        for s in self.members:
            s.tied = True
        for e in embs:
            if e is not self.keeper:                         # the table's norm is the first embedding's
                e.need = tuple(p for p in e.need if p != "weight")
            e.rule = dataclasses.replace(e.rule, norms=lambda m, i, d, n, e=e: self._emb_norms(e, m, i, d),
                                         fused=None, unbatched=False)
        if head is not None:
            head.need = tuple(p for p in head.need if p != "weight")
            head.rule = dataclasses.replace(head.rule, norms=self._head_norms, fused=None)
        self.idx: dict[int, torch.Tensor] = {}
        self.block: tuple | None | bool = False            # (read at the first forward: :meth:`_block`)
        self._clear()

    def _clear(self) -> None:
        self.pending, self.seen, self.cross = [], 0, None
        self.gathered = self.a = self.head_sq = None
        self.cols: dict[int, tuple[int, int]] = {}

    def names(self) -> str:
        return " is ".join(repr(s.full("weight")) for s in self.members)

    def pre_hook(self, module, args, kwargs):
        """At an embedding's forward (eagerly, under torch.compile too): its indices of this step (the first
        embedding call of a step drops the last step's leftovers). Not at a checkpoint's recomputation (the
        same indices)."""
        if recomputing():
            return
        if self.block is False:
            self.block = self._block()
        if all(e.calls == 0 for e in self.embs):
            self.idx = {}
            self._clear()
        if not args:                                  # (emb(input=idx), Gemma's emb(input_ids=idx))
            args, _ = by_position(self.by_module[id(module)].arg_names, args, kwargs)
        self.idx[id(module)] = local(args[0])        # (parallelize_module's input may be a DTensor)

    def _block(self) -> tuple | None:
        """The block of the table each process holds under tensor parallelism (its members' layouts,
        :func:`~elasticlab.gns.sharded.tensor_parallel`): ("vocab" or "width", first, end), the same for every
        member, or None where none is split; members split alike or not at all else a ValueError naming
        them."""
        blocks = set()
        for s in self.members:
            mesh, dims, rows, cut = s.tp.get("weight", (None, (), None, None))
            if rows is not None:
                blocks.add(("vocab", *rows, id(mesh), dims))
            elif cut is not None:
                vocab = cut[0] == "out" and isinstance(s.module, nn.Linear)   # (a Linear's rows, a table's)
                blocks.add(("vocab" if vocab else "width", *cut[1:3], id(mesh), dims))
            else:
                blocks.add(None)
        if len(blocks) > 1:
            raise ValueError(f"tied weights ({self.names()}): the modules sharing the table hold different "
                             f"blocks of it under tensor parallelism ({sorted(map(str, blocks))}), so no "
                             "process sees one block's whole gradient; split them alike (the embedding "
                             "row-wise with the output layer column-wise, or column-wise with row-wise), "
                             "or untie them")
        blk = blocks.pop()
        return None if blk is None else blk[:3]

    def _calls(self) -> list:
        """The embedding slots that ran in this step, in order."""
        return [e for e in self.embs if e.calls and id(e.module) in self.idx]

    def _head_norms(self, module, inputs, d, need):
        """The output layer's hook rule: its bias as usual; ‖G_h‖² and δh_t[i_s] (B, T, S) kept."""
        out = linear_norms(module, inputs, d, (*need, "weight"))
        head_sq = out.pop("weight")
        calls = self._calls()
        if not calls:                      # no embedding ran (e.g. embeddings passed in): G_h alone
            self.keeper.record({"weight": head_sq}, d.shape[0])
            return out
        if self.seen:                      # an embedding's backward already ran: the norm misses G_h
            raise RuntimeError(f"tied weights ({self.names()}): the output layer's backward ran after the "
                               "embedding's, so the table's norm cannot take both parts; the output layer "
                               "must use the embedding's output")
        acc = kernels.acc_dtype(d.dtype)
        B = d.shape[0]
        idx = [self.idx[id(e.module)].reshape(B, -1).long() for e in calls]
        c0 = 0
        for e, i in zip(calls, idx):
            self.cols[id(e)] = (c0, c0 + i.shape[1])
            c0 += i.shape[1]
        d3, cat = d.reshape(B, -1, d.shape[-1]), torch.cat(idx, 1)
        if self.block and self.block[0] == "vocab":      # δh: this process's columns of the vocabulary
            # (an index in another process's rows reads any column: its δe_s is 0 here, sharded.local_call)
            cat = (cat - self.block[1]).clamp(0, d3.shape[-1] - 1)
        self.gathered = torch.gather(d3, 2, cat[:, None, :].expand(B, d3.shape[1], cat.shape[1])).to(acc)
        self.a, self.head_sq = inputs[0].reshape(B, -1, inputs[0].shape[-1]), head_sq
        return out

    def _emb_norms(self, e, module, inputs, d):
        """An embedding's hook rule: its call kept, its share of the cross term added; the step's last one
        records the table's norm at the keeper."""
        B = d.shape[0]
        c = 1.0 if type(module).forward is nn.Embedding.forward else scale_of(module, inputs[0])
        if c is None:
            raise RuntimeError(f"tied weights ({self.names()}): {e.full('weight')!r}'s module "
                               f"({type(module).__name__}) has a forward of its own that is not a scaled "
                               "lookup, so its part of the table's gradient is not known; untie or freeze it")
        idx, de = inputs[0].reshape(B, -1), d.reshape(B, -1, d.shape[-1]) * c
        self.pending.append((idx, de))
        self.seen += 1
        if self.gathered is not None and id(e) in self.cols:
            c0, c1 = self.cols[id(e)]
            dm = de.to(self.gathered.dtype)
            if module.padding_idx is not None:               # no gradient reaches the padding row
                dm = dm.masked_fill((idx == module.padding_idx).unsqueeze(-1), 0)
            k = torch.bmm(self.a.to(dm.dtype), dm.transpose(1, 2))               # a_t · δe_s: (B, T, S)
            part = (self.gathered[:, :, c0:c1] * k).sum((1, 2))
            self.cross = part if self.cross is None else self.cross + part
        if self.seen < sum(s.calls for s in self.embs):
            return {}
        pending = self.pending
        total = embedding_norms(module, (torch.cat([i for i, _ in pending], 1),),
                                torch.cat([g for _, g in pending], 1), ("weight",))["weight"]
        if self.head_sq is not None:
            total = total + self.head_sq + 2 * (self.cross if self.cross is not None else 0)
        self._clear()
        self.seen = sum(s.calls for s in self.embs)        # (a later output-layer backward: the error above)
        self.keeper.record({"weight": total}, B)
        return {}


def _group(uses) -> Tie | None:
    """A :class:`Tie` when ``uses`` (the (slot, name) uses of one parameter) are the tables of
    ``nn.Embedding`` modules alike in padding (plain, or scaling the lookup: Gemma's, BART's) and at most one
    ``nn.Linear``'s weight, else None."""
    if any(n != "weight" for _, n in uses):
        return None
    embs = [s for s, _ in uses if isinstance(s.module, nn.Embedding)
            and s.rule.norms in (embedding_norms, scaled_embedding_norms)]
    heads = [s for s, _ in uses if type(s.module) is nn.Linear]
    if not embs or len(heads) > 1 or len(embs) + len(heads) != len(uses):
        return None
    if len({(e.module.padding_idx, e.module.scale_grad_by_freq) for e in embs}) != 1:
        return None
    return Tie(embs, heads[0] if heads else None)


def untie(slots: list, strict: bool, skipped: list[str]) -> list[Tie]:
    """The parameters that several covered slots need: a :class:`Tie` for a table shared by embeddings and at
    most one Linear; any other sharing is a ValueError naming them (``strict``), else left out (listed in
    ``skipped``)."""
    owners: dict[int, list] = {}
    for s in slots:
        for pn in s.need:
            owners.setdefault(id(getattr(s.module, pn)), []).append((s, pn))
    ties = []
    for uses in (p for p in owners.values() if len(p) > 1):
        tie = _group(uses)
        if tie is not None:
            ties.append(tie)
            continue
        names = [s.full(pn) for s, pn in uses]
        if strict:
            raise ValueError(
                f"parameter {names[0]!r} is also {', '.join(map(repr, names[1:]))} (tied weights): its "
                "per-example gradient is the sum of the modules' parts, whose norm is not the sum of their "
                "norms, and only a table shared by embeddings and at most one Linear has a rule for it; "
                "untie or freeze it, or pass strict=False to leave it out (listed in skipped)")
        skipped.extend(names)
        for s, pn in uses:
            s.need = tuple(p for p in s.need if p != pn)
    return ties
