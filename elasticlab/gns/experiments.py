"""Estimator experiments on synthetic linear regression with a known B_simple (papers.md P5-T1, P5-T2);
the steps/examples trade-off on streaming least squares (P5-T3) and the LayerNorm-only GNS of a tiny
char-level transformer (P5-T5), at the end of the file.

A finite population of N examples defines the truth exactly: G = mean_i g_i, Σ = population covariance of
the per-example gradients g_i = x_i (x_iᵀw − y_i) of ℓ_i = ½(x_iᵀw − y_i)², so B_simple = tr Σ/‖G‖²
(McCandlish Eq. 2.9). Batches are drawn with replacement, which makes both estimators exactly unbiased.
"""
from __future__ import annotations

import numpy as np

from elasticlab.gns.estimator import two_batch_estimates


def linear_regression_population(dim: int = 20, size: int = 200_000, noise: float = 0.52,
                                 offset: float = 0.3127, seed: int = 0):
    """Per-example gradients (size, dim) at a fixed w, and the exact (‖G‖², tr Σ, B_simple)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, dim))
    w_true = rng.standard_normal(dim)
    y = x @ w_true + noise * rng.standard_normal(size)
    w = w_true + offset * rng.standard_normal(dim)
    g = x * (x @ w - y)[:, None]
    G = g.mean(0)
    trace_cov = float(((g - G) ** 2).sum(1).mean())
    g2 = float(G @ G)
    return g, {"grad_sq": g2, "trace_cov": trace_cov, "b_simple": trace_cov / g2}


def draw_estimates(g: np.ndarray, b_small: int, b_big: int = 64, draws: int = 3000, seed: int = 1):
    """(‖G‖²_est, S_est) arrays over ``draws`` batches of b_big, each split into b_big/b_small micro-batches
    (as replicas or accumulation steps); b_small=1 is the per-example form."""
    if b_big % b_small or b_small >= b_big:
        raise ValueError(f"b_small must divide b_big and be smaller: got b_small={b_small}, b_big={b_big}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, g.shape[0], size=(draws, b_big))
    batch = g[idx]                                                  # (draws, b_big, D)
    micro = batch.reshape(draws, b_big // b_small, b_small, -1).mean(2)
    small = (micro ** 2).sum(-1).mean(1)                            # mean over micro-batches of ‖G_small‖²
    big = (batch.mean(1) ** 2).sum(-1)
    return two_batch_estimates(small, big, b_small, b_big)


def unbiasedness(draws: int = 3000, settings=((1, 64), (8, 64), (32, 64)), seed: int = 0) -> dict:
    """P5-T1: mean ‖G‖²_est, S_est and the ratio-of-means B_simple per (b_small, b_big), with the truth."""
    g, truth = linear_regression_population(seed=seed)
    out = {"truth": truth, "settings": {}}
    for i, (bs, bb) in enumerate(settings):
        g2, s = draw_estimates(g, bs, bb, draws, seed=seed + 1 + i)
        out["settings"][(bs, bb)] = {"grad_sq": float(g2.mean()), "trace_cov": float(s.mean()),
                                     "b_simple": float(s.mean() / g2.mean())}
    return out


def variance_ordering(draws: int = 3000, b_big: int = 64, b_smalls=(32, 16, 8, 4, 2, 1),
                      seed: int = 0) -> dict:
    """P5-T2 (Gray et al. Fig. 2): std of S_est and of ‖G‖²_est across draws, per b_small at fixed b_big."""
    g, truth = linear_regression_population(seed=seed)
    std_s, std_g2 = {}, {}
    for bs in b_smalls:
        g2, s = draw_estimates(g, bs, b_big, draws, seed=seed + 100)   # same batches for every split
        std_s[bs], std_g2[bs] = float(s.std()), float(g2.std())
    return {"truth": truth, "std_trace_cov": std_s, "std_grad_sq": std_g2}


# ------------------------------------------------------------------------------------------------ P5-T3
def lsq_curvatures(dim: int = 16, kappa: float = 10.0) -> np.ndarray:
    """Eigenvalues h of H = E[x xᵀ] (inputs x ~ N(0, diag h)), log-spaced from 1 down to 1/kappa."""
    return np.logspace(0.0, -np.log10(kappa), dim)


def lsq_noise_scales(h: np.ndarray, err: np.ndarray, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact (B_simple, B_noise) of streaming least squares at error(s) e = w − w* (rows of ``err``):
    with x ~ N(0, H), y = xᵀw* + noise·ε, the per-example gradient g = x(xᵀe − noise·ε) has G = He and
    Σ = HeeᵀH + (eᵀHe + noise²)H, so B_simple = 1 + tr H (eᵀHe + σ²)/eᵀH²e (Eq. 2.9) and
    B_noise = 1 + tr H² (eᵀHe + σ²)/eᵀH³e (Eq. 2.8)."""
    e2 = np.asarray(err, dtype=float) ** 2
    c = e2 @ h + noise**2
    return 1.0 + h.sum() * c / (e2 @ h**2), 1.0 + (h**2).sum() * c / (e2 @ h**3)


def lsq_steps_to_target(h: np.ndarray, noise: float, batch: int, lrs, target: float, replicas: int = 8,
                        max_steps: int = 100_000, seed: int = 0) -> tuple[float, float]:
    """SGD on streaming least squares at every LR of ``lrs`` at once (``replicas`` runs each, from
    e₀ ~ N(0, I), fresh batches of ``batch`` examples per step). Returns (S, best LR): the first step at
    which the replica-mean excess loss ½eᵀHe of some LR reaches ``target``, interpolated linearly in
    log loss within that step (the first LR to reach it is the tuned one); (inf, nan) if none does."""
    rng = np.random.default_rng(seed)
    lrs = np.asarray(lrs, dtype=float)
    n, dim, sqrt_h = len(lrs), len(h), np.sqrt(h)
    err = np.repeat(rng.standard_normal((1, replicas, dim)), n, axis=0)      # same start for every LR
    eta = lrs[:, None, None]
    prev = np.full(n, 0.5 * (err[0] ** 2 @ h).mean())
    for t in range(1, max_steps + 1):
        x = rng.standard_normal((n, replicas, batch, dim)) * sqrt_h
        r = np.einsum("lrbd,lrd->lrb", x, err) - noise * rng.standard_normal((n, replicas, batch))
        err = err - eta * np.einsum("lrbd,lrb->lrd", x, r) / batch
        loss = 0.5 * (err**2 @ h).mean(1)
        loss = np.where(np.isfinite(loss), loss, np.inf)
        hit = loss <= target
        if hit.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                frac = np.log(prev / target) / np.log(prev / loss)
            s = np.where(hit, t - 1 + np.clip(frac, 0.0, 1.0), np.inf)
            i = int(np.argmin(s))
            return float(s[i]), float(lrs[i])
        if not np.isfinite(loss).any():
            break
        prev = loss
    return float("inf"), float("nan")


def fit_steps_examples(batches, steps) -> dict:
    """Least-squares fit in log space of S(B) = S_min(1 + B_crit/B), i.e. E(B) = B·S(B) = E_min(1 + B/B_crit)
    with E_min = B_crit·S_min (McCandlish Eq. 2.11–2.12). Returns S_min, E_min, B_crit, R² of log S, each
    point's S/S_fit (the factor by which the point (S, E) sits off the hyperbola along E = B·S) and its
    (S/S_min − 1)(E/E_min − 1), which the model puts at 1."""
    from scipy.optimize import minimize_scalar

    b = np.asarray(batches, dtype=float)
    ls = np.log(np.asarray(steps, dtype=float))

    def offset(log_bc):
        f = np.log1p(np.exp(log_bc) / b)
        return f, float(np.mean(ls - f))

    def sse(log_bc):
        f, c = offset(log_bc)
        return float(((ls - c - f) ** 2).sum())

    grid = np.linspace(np.log(b.min()) - 3, np.log(b.max()) + 3, 200)
    g0 = grid[int(np.argmin([sse(v) for v in grid]))]
    res = minimize_scalar(sse, bounds=(g0 - 0.1, g0 + 0.1), method="bounded")
    f, c = offset(res.x)
    s_min, b_crit = float(np.exp(c)), float(np.exp(res.x))
    e_min = s_min * b_crit
    steps = np.exp(ls)
    return {
        "s_min": s_min,
        "e_min": e_min,
        "b_crit": b_crit,
        "r2_log": 1.0 - res.fun / float(((ls - ls.mean()) ** 2).sum()),
        "ratio_to_fit": steps / np.exp(c + f),
        "product": (steps / s_min - 1.0) * (b * steps / e_min - 1.0),
    }


def steps_examples_tradeoff(batches=tuple(2**k for k in range(11)), n_lrs: int = 40, replicas: int = 16,
                            dim: int = 16, kappa: float = 10.0, noise: float = 0.1,
                            target_frac: float = 0.01, beta: float = 0.99, seed: int = 0) -> dict:
    """P5-T3: for each batch B, SGD with the LR tuned on a log grid (1e-3 … 2/h_max, the stability limit)
    until the expected excess loss falls to ``target_frac`` of its initial value; S(B), E(B) = B·S(B) and
    the fit of :func:`fit_steps_examples`. B_simple is measured by :class:`~elasticlab.gns.GNSEstimator`
    from the per-example gradient norms ‖x_i r_i‖² of the largest batch's tuned run (the run closest to
    the S_min trajectory, whose steps are the measure ds in B_crit = ∫B_noise ds/∫ds, Eq. 2.12); one
    estimator per replica, read once at the target (with ``beta`` near 1 over a short run, the ratio of its
    EMAs is the ratio of training means). The exact ratio-of-means B_simple along those runs, and the
    step means of the exact B_simple and B_noise, are returned too."""
    from elasticlab.gns.estimator import GNSEstimator

    h = lsq_curvatures(dim, kappa)
    target = target_frac * 0.5 * h.sum()          # E[½ e₀ᵀHe₀] = ½ tr H for e₀ ~ N(0, I)
    lrs = np.logspace(-3, 0, n_lrs) * 2.0 / h.max()
    steps, best = [], []
    for i, b in enumerate(batches):
        s, lr = lsq_steps_to_target(h, noise, int(b), lrs, target, replicas, seed=seed + 1 + i)
        steps.append(s)
        best.append(lr)
    steps = np.array(steps)
    fit = fit_steps_examples(batches, steps)

    # B_simple along the largest batch's tuned run, per replica, from per-example gradient norms
    b, lr = int(batches[-1]), best[-1]
    rng = np.random.default_rng(seed + 1000)
    measured, exact_simple, exact_sums = [], [], np.zeros(2)    # exact (B_simple, B_noise); (tr Σ, |G|²)
    for _ in range(replicas):
        est, err, run_steps = GNSEstimator(beta=beta), rng.standard_normal(dim), 0
        while 0.5 * (err**2 @ h) > target and run_steps < 100 * max(steps[-1], 1.0):
            x = rng.standard_normal((b, dim)) * np.sqrt(h)
            r = x @ err - noise * rng.standard_normal(b)
            g = x * r[:, None]                                  # per-example gradients (b, dim)
            gbar = g.mean(0)
            est.update((g**2).sum(1), float(gbar @ gbar))
            exact_simple.append(lsq_noise_scales(h, err, noise))
            exact_sums += (err**2 @ h**2 + h.sum() * (err**2 @ h + noise**2), err**2 @ h**2)
            err = err - lr * gbar
            run_steps += 1
        measured.append(est.b_simple)
    b_simple = float(np.mean(measured))
    return {
        "batches": np.asarray(batches), "steps": steps, "examples": np.asarray(batches) * steps,
        "best_lr": np.array(best), "target_loss": target, **fit,
        "b_simple": b_simple, "b_simple_replicas": np.array(measured),
        "b_simple_exact": float(exact_sums[0] / exact_sums[1]),
        "b_simple_exact_step_mean": float(np.mean([v[0] for v in exact_simple])),
        "b_noise_exact_step_mean": float(np.mean([v[1] for v in exact_simple])),
        "crit_over_simple": fit["b_crit"] / b_simple,
        "problem": {"dim": dim, "kappa": kappa, "noise": noise, "target_frac": target_frac,
                    "n_lrs": n_lrs, "replicas": replicas},
    }


# ------------------------------------------------------------------------------------------------ P5-T5
def char_corpus(modules=("argparse", "inspect")) -> str:
    """Plain text that ships with Python: the source of a few standard-library modules."""
    import importlib
    import inspect

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)


def tiny_char_transformer(vocab: int, context: int = 64, d: int = 64, layers: int = 2, heads: int = 4):
    """A pre-LN GPT (token + position embeddings, ``layers`` blocks, final LayerNorm, linear head) built
    from nn.Linear, nn.LayerNorm and nn.Embedding only, so :class:`~elasticlab.gns.PerSampleGradNorms`
    covers every parameter (attention's q, k, v come from one Linear, not nn.MultiheadAttention)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class CharGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, idx):
            B, T = idx.shape
            pos = torch.arange(T, device=idx.device).expand(B, T)   # batched, so its norms are per example
            return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))

    return CharGPT()


def layernorm_gns_proxy(steps: int = 300, batch: int = 32, context: int = 64, d: int = 64, layers: int = 2,
                        lr: float = 3e-3, beta: float = 0.95, seed: int = 0) -> dict:
    """P5-T5 (Gray et al. 2024): a char-level transformer (:func:`tiny_char_transformer`) trained with AdamW
    on standard-library source text. Each step, the per-example squared norms of
    :class:`~elasticlab.gns.PerSampleGradNorms` (``layer_sq_norms()``, per module) are summed over the
    LayerNorm modules, over the Linear ones and over the Embeddings, and fed with the matching ‖ḡ‖² to one
    :class:`~elasticlab.gns.GNSEstimator` as per-layer groups beside the total (per-example form,
    McCandlish App. A.1). Returns the EMA B_simple of the total and of each group at every step and the
    Pearson correlation of each group's with the total's after one EMA time constant 1/(1 − beta)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from elasticlab.gns import GNSEstimator, PerSampleGradNorms

    text = char_corpus()
    chars = sorted(set(text))
    data = torch.from_numpy(np.searchsorted(np.array(chars), np.array(list(text))))
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = tiny_char_transformer(len(chars), context, d, layers)
    kinds = {name: t for name, m in model.named_modules()
             for t, cls in (("layernorm", nn.LayerNorm), ("linear", nn.Linear), ("embedding", nn.Embedding))
             if isinstance(m, cls)}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    est = GNSEstimator(beta=beta)
    groups = ("layernorm", "linear", "embedding")
    total, loss_curve = np.empty(steps), np.empty(steps)
    per_group = {g: np.empty(steps) for g in groups}
    offsets = torch.arange(context + 1)
    with PerSampleGradNorms(model) as psn:
        for t in range(steps):
            start = torch.randint(0, len(data) - context - 1, (batch, 1), generator=gen)
            chunk = data[start + offsets]
            opt.zero_grad(set_to_none=True)
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
            loss.backward()
            ls, lg = psn.layer_sq_norms(), psn.layer_grad_sq_norms(batch)
            layers_in = {g: (sum(ls[k] for k in ls if kinds[k] == g), sum(lg[k] for k in ls if kinds[k] == g))
                         for g in groups}
            est.update(psn.sq_norms(), psn.grad_sq_norm(batch), layers=layers_in)
            opt.step()
            total[t], loss_curve[t] = est.b_simple, loss.item()
            lb = est.layer_b_simple()
            for g in groups:
                per_group[g][t] = lb[g]
    skip = min(int(round(1.0 / (1.0 - beta))), steps // 2)
    corr = {g: float(np.corrcoef(per_group[g][skip:], total[skip:])[0, 1]) for g in groups}
    return {
        "steps": steps, "skip": skip, "vocab": len(chars), "corpus_chars": len(text),
        "params": sum(p.numel() for p in model.parameters()),
        "layernorm_params": sum(p.numel() for n, m in model.named_modules() if kinds.get(n) == "layernorm"
                                for p in m.parameters()),
        "not_covered": list(psn.skipped), "correlation": corr,
        "b_simple_total": total, "b_simple_groups": per_group, "loss": loss_curve,
    }
