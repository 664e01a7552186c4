"""Per-example squared norms of a weight that F.linear applies to rows gathered from the examples (a mixture
of experts: ``F.linear(h[tok], gate_up_proj[e])``, the tokens routed to expert e), without forming any
example's gradient. Example b's gradient from one use u is G_b = D_bᵀ X_b over its rows (X_b the inputs,
D_b the output gradients), so over the uses of one step (a slice used again: an expert applied twice)

    ‖Σ_u G_b^u‖² = Σ_{u,v} Σ_{r ∈ u_b, r' ∈ v_b} (x_r·x_r')(d_r·d_r')

(the Gram form of Li et al. 2022, per example and across uses). It costs n_b² (in + out) per example
against n_b·in·out for G_b, and holds the rows (X, D) until the step's last use instead of B gradients of
the weight: the tokens an expert gets from one example are far fewer than in·out/(in + out).

The examples' rows are padded with zeros to the most any example has (B, m, ·), so that each use's own
terms are one batched Gram (kernel ``seq_linear_gram_norms``) and each pair of uses' cross terms two
batched products, whatever B is; zero rows add nothing. Where padding would hold more than
:data:`PAD_LIMIT` times the rows (one example has most of them), the examples are taken one at a time.
"""
from __future__ import annotations

import torch

from elasticlab.gns import kernels

FORM = "auto"          # "gram" | "products" (each example's G_b formed): forced, for tests and comparisons
PAD_LIMIT = 4          # padded rows B·m at most this many times the rows n (else a loop over the examples)


def by_example(key: torch.Tensor, groups: int) -> tuple[torch.Tensor, list[int]]:
    """The order that sorts rows by ``key`` (each row's group: its example, or expert·B + example), stable,
    and how many rows each of the ``groups`` has, on the host (the one host read of a call)."""
    return torch.argsort(key, stable=True), torch.bincount(key, minlength=groups).tolist()


class RowsUse:
    """One use: the rows sorted by example (``X`` (n, in), ``D`` (n, out), in the accumulation dtype) and
    how many each of the B examples has (``counts``, on the host); held padded to (B, m, ·) where that fits
    :data:`PAD_LIMIT`."""
    __slots__ = ("X", "D", "counts", "starts", "padded", "dtype", "device")

    def __init__(self, X: torch.Tensor, D: torch.Tensor, counts: list[int]):
        self.X, self.D, self.counts, self.dtype, self.device = X, D, counts, X.dtype, X.device
        self.starts, s = [], 0
        for c in counts:
            self.starts.append(s)
            s += c
        B, m = len(counts), max(counts, default=0)
        self.padded = None
        if m and B * m <= PAD_LIMIT * max(s, 1):
            ex = torch.repeat_interleave(torch.arange(B, device=X.device),
                                         torch.tensor(counts, device=X.device), output_size=s)
            pos = torch.arange(s, device=X.device) - torch.tensor(self.starts, device=X.device)[ex]
            self.padded = tuple(t.new_zeros(B, m, t.shape[1]).index_put_((ex, pos), t) for t in (X, D))
            self.X = self.D = None                     # (held once: padded)

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.counts[b]
        if not c:
            return None
        if self.padded is not None:
            return self.padded[0][b, :c], self.padded[1][b, :c]
        s = self.starts[b]
        return self.X[s:s + c], self.D[s:s + c]


def takes(X: torch.Tensor, D: torch.Tensor, counts: list[int]) -> bool:
    """Whether the Gram form serves this use: the cheaper where every example's rows are fewer than
    in·out/(in+out) (:data:`FORM` "auto")."""
    if FORM != "auto":
        return FORM == "gram"
    din, dout = X.shape[1], D.shape[1]
    return max(counts, default=0) * (din + dout) <= din * dout


def _cross(u: RowsUse, v: RowsUse) -> torch.Tensor:
    """(B,) Σ_{r ∈ u_b, r' ∈ v_b} (x_r·x_r')(d_r·d_r'), batched over the examples in chunks."""
    (xu, du), (xv, dv) = u.padded, v.padded
    B, out = xu.shape[0], xu.new_empty(xu.shape[0])
    for b0, b1 in kernels._chunks(B, 2 * xu.shape[1] * xv.shape[1]):
        gx = torch.bmm(xu[b0:b1], xv[b0:b1].transpose(1, 2))
        out[b0:b1] = (gx * torch.bmm(du[b0:b1], dv[b0:b1].transpose(1, 2))).sum((1, 2))
    return out


def _loop(use: RowsUse, others: list, batch: int) -> torch.Tensor:
    """:meth:`RowGrams.add`'s terms an example at a time (padding would not fit)."""
    new = torch.zeros(batch, dtype=use.dtype, device=use.device)
    for b in range(batch):
        mine = use.rows(b)
        if mine is None:
            continue
        xb, db = mine
        total = ((xb @ xb.t()) * (db @ db.t())).sum()
        for other in others:
            theirs = other.rows(b)
            if theirs is not None:
                total = total + 2 * ((xb @ theirs[0].t()) * (db @ theirs[1].t())).sum()
        new[b] = total
    return new


class RowGrams:
    """The uses of one weight (or slice) in a step, and the running (B,) squared norms of their sum."""

    def __init__(self, batch: int):
        self.batch, self.uses, self.sq = batch, [], None

    def add(self, use: RowsUse) -> torch.Tensor:
        """Adds ``use``: its own terms and twice its cross terms with the uses before it; the (B,) norms."""
        if use.padded is not None and all(o.padded is not None for o in self.uses):
            new = kernels.seq_linear_gram_norms(*use.padded)
            for other in self.uses:
                new = new + 2 * _cross(use, other)
        else:
            new = _loop(use, self.uses, self.batch)
        self.uses.append(use)
        self.sq = new if self.sq is None else self.sq + new
        return self.sq
