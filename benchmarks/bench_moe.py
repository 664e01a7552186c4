"""Cost of per-example gradient norms on a mixture of experts (Shazeer et al. 2017; Mixtral's block, Jiang
et al. 2024): a router on the B·T tokens (a leaf of no registered type: the generic rule, its rows read per
example) and E experts whose (E, 2H, D) and (E, D, H) weights are applied by F.linear to the tokens routed
to each (each example's share taken by its rows, ``folds.row_examples``), top-k of E, L blocks with
residuals.

Methods, timed interleaved in one run: ``plain`` (forward + backward), ``psgn`` (``PerSampleGradNorms``,
``sq_norms()`` read each step; the experts' norms by the Gram form over each example's rows where it is the
cheaper, :mod:`elasticlab.gns.layers.row_grams`), ``psgn-hooks`` (hooks only, ``fused=False``),
``psgn-products`` (each example's gradient of each expert formed instead), and ``loop`` (one backward per
example, the way without elasticlab: torch.func's vmap does not run the routing's data-dependent loop). Each
round times ``--steps`` steps of one method (wall clock); the median over ``--rounds`` rounds of the mean
step is reported with the ratio to plain. Last line: ``RESULT {json}``.

    python benchmarks/bench_moe.py [--batch 8] [--seq 128] [--dim 256] [--hidden 512] [--experts 8]
        [--top-k 2] [--blocks 2] [--rounds 5] [--steps 3] [--threads 2] [--grouped]

``--grouped``: the experts by two grouped matmuls (``F.grouped_mm``, Hugging Face's default implementation)
instead of F.linear expert by expert; their norms always by the Gram form (``psgn-products`` is then the
same).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.layers import row_grams


class Router(nn.Module):
    """Softmax over E experts, top-k renormalised (Mixtral's): logits, weights and indices."""

    def __init__(self, D: int, E: int, k: int):
        super().__init__()
        self.weight, self.k = nn.Parameter(torch.randn(E, D) / D ** 0.5), k

    def forward(self, h):
        logits = F.linear(h, self.weight)
        top, idx = torch.topk(logits.softmax(-1), self.k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx


class Experts(nn.Module):
    """SwiGLU experts stored as 3-D weights, applied expert by expert to the tokens routed to it."""

    def __init__(self, D: int, H: int, E: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(E, 2 * H, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(E, D, H) / H ** 0.5)
        self.act = nn.SiLU()

    def forward(self, h, idx, w):
        out = torch.zeros_like(h)
        for e in range(self.gate_up.shape[0]):
            tok, pos = torch.where(idx == e)
            if tok.numel():
                a, b = F.linear(h[tok], self.gate_up[e]).chunk(2, dim=-1)
                out.index_add_(0, tok, F.linear(self.act(a) * b, self.down[e]) * w[tok, pos, None])
        return out


class GroupedExperts(Experts):
    """The same experts in two grouped matmuls (Hugging Face's default ``grouped_mm``): the routed tokens
    sorted by expert, ``offs`` the groups' ends."""

    def forward(self, h, idx, w):
        k, E = idx.shape[1], self.gate_up.shape[0]
        ids, perm = torch.sort(idx.reshape(-1))
        offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
        a, b = F.grouped_mm(h[perm // k], self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(self.act(a) * b, self.down.transpose(-2, -1), offs=offs) * w.reshape(-1)[perm, None]
        return torch.zeros_like(h).index_add(0, perm // k, y)


class MoE(nn.Module):
    def __init__(self, D: int, H: int, E: int, k: int, L: int, classes: int = 10, grouped: bool = False):
        super().__init__()
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, classes)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(L))
        self.gates = nn.ModuleList(Router(D, E, k) for _ in range(L))
        self.experts = nn.ModuleList((GroupedExperts if grouped else Experts)(D, H, E) for _ in range(L))

    def forward(self, x):
        h = self.inp(x)
        rows = h.reshape(-1, h.shape[-1])
        for norm, gate, experts in zip(self.norms, self.gates, self.experts):
            z = norm(rows)
            _, w, idx = gate(z)
            rows = rows + experts(z, idx, w)
        return self.head(rows.reshape(h.shape).mean(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 8), ("seq", 128), ("dim", 256), ("hidden", 512), ("experts", 8),
                          ("top-k", 2), ("blocks", 2), ("rounds", 5), ("steps", 3), ("threads", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--grouped", action="store_true", help="the experts by grouped_mm (HF's default)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = MoE(a.dim, a.hidden, a.experts, a.top_k, a.blocks, grouped=a.grouped)
    x, y = torch.randn(a.batch, a.seq, a.dim), torch.randint(0, 10, (a.batch,))

    def plain():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    def loop():
        model.zero_grad()
        for b in range(a.batch):
            F.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).backward()

    contexts = {"psgn": PerSampleGradNorms(model), "psgn-hooks": PerSampleGradNorms(model, fused=False)}

    def with_norms(name, form="auto"):
        def step():
            row_grams.FORM = form
            try:
                plain()
                contexts[name].sq_norms()
            finally:
                row_grams.FORM = "auto"
        return step

    contexts["psgn-products"] = PerSampleGradNorms(model)
    methods = {"plain": plain, "psgn": with_norms("psgn"), "psgn-hooks": with_norms("psgn-hooks"),
               "psgn-products": with_norms("psgn-products", "products"), "loop": loop}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in tqdm(range(a.rounds), desc="rounds"):
        for name, step in methods.items():
            ctx = contexts.get(name)
            if ctx is not None:
                ctx.__enter__()
            try:
                step()                                          # (warm: the first step's checks)
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step()
                times[name].append((time.perf_counter() - t0) / a.steps)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
    med = {m: statistics.median(v) for m, v in times.items()}
    for m, v in med.items():
        print(f"{m:13s} {v * 1e3:9.1f} ms   {v / med['plain']:5.2f}x plain")
    print("RESULT " + json.dumps({"config": vars(a), "ms": {m: round(v * 1e3, 2) for m, v in med.items()},
                                  "ratio": {m: round(v / med["plain"], 3) for m, v in med.items()}}))


if __name__ == "__main__":
    main()
