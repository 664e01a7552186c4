"""Per-example squared norms of a weight that F.linear applies to rows gathered from the examples (a mixture
of experts: ``F.linear(h[tok], gate_up_proj[e])``, the tokens routed to expert e), without forming any
example's gradient. Example b's gradient from one use u is G_b = D_bᵀ X_b over its rows (X_b the inputs,
D_b the output gradients), so over the uses of one step (a slice used again: an expert applied twice)

    ‖Σ_u G_b^u‖² = Σ_{u,v} Σ_{r ∈ u_b, r' ∈ v_b} (x_r·x_r')(d_r·d_r')

(the Gram form of Li et al. 2022, per example and across uses). It costs n_b² (in + out) per example
against n_b·in·out for G_b, and holds the rows (X, D) until the step's last use instead of B gradients of
the weight: the tokens an expert gets from one example are far fewer than in·out/(in + out).
"""
from __future__ import annotations

import torch


class RowsUse:
    """One use: the rows sorted by example (``X`` (n, in), ``D`` (n, out), in the accumulation dtype) and
    how many each of the B examples has (``counts``, on the host)."""
    __slots__ = ("X", "D", "counts", "starts")

    def __init__(self, X: torch.Tensor, D: torch.Tensor, counts: list[int]):
        self.X, self.D, self.counts = X, D, counts
        self.starts, s = [], 0
        for c in counts:
            self.starts.append(s)
            s += c

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        c = self.counts[b]
        if not c:
            return None
        s = self.starts[b]
        return self.X[s:s + c], self.D[s:s + c]


FORM = "auto"          # "gram" | "products" (each example's G_b formed): forced, for tests and comparisons


def takes(X: torch.Tensor, D: torch.Tensor, counts: list[int]) -> bool:
    """Whether the Gram form serves this use: the cheaper where every example's rows are fewer than
    in·out/(in+out) (:data:`FORM` "auto")."""
    if FORM != "auto":
        return FORM == "gram"
    din, dout = X.shape[1], D.shape[1]
    return max(counts, default=0) * (din + dout) <= din * dout


class RowGrams:
    """The uses of one weight (or slice) in a step, and the running (B,) squared norms of their sum."""

    def __init__(self, batch: int):
        self.batch, self.uses, self.sq = batch, [], None

    def add(self, use: RowsUse) -> torch.Tensor:
        """Adds ``use``: its own terms and twice its cross terms with the uses before it; the (B,) norms."""
        X = use.X
        new = torch.zeros(self.batch, dtype=X.dtype, device=X.device)
        for b in range(self.batch):
            mine = use.rows(b)
            if mine is None:
                continue
            xb, db = mine
            total = ((xb @ xb.t()) * (db @ db.t())).sum()
            for other in self.uses:
                theirs = other.rows(b)
                if theirs is not None:
                    total = total + 2 * ((xb @ theirs[0].t()) * (db @ theirs[1].t())).sum()
            new[b] = total
        self.uses.append(use)
        self.sq = new if self.sq is None else self.sq + new
        return self.sq
