"""P6-T4: AdaScale's Thm. 2 convergence bounds on a PL quadratic (Johnson et al. 2020)."""
from __future__ import annotations

import math

import numpy as np

from ..nqm import NoisyQuadratic


def sgd_pl_bound(f0_gap, lr, alpha, beta, v, steps, scale=1, rule="adascale"):
    """AdaScale's convergence bounds for SGD with constant lr on an alpha-PL, beta-smooth F whose
    base-batch gradient variance is <= V (Johnson et al. 2020, Thm. 2; papers.md P6): with
    gamma = lr * alpha * (2 - lr * beta) and Delta = lr^2 beta V / (2 gamma),

    - ``rule="adascale"``: ``(F0 - F*) exp(-gamma T_SI) + Delta`` (``steps`` = T_SI, any S);
    - ``rule="linear"`` (lr * S at batch S * b, needs S lr beta < 2): ``(F0 - F*) exp(-gamma c^-1 S T)
      + c Delta`` with ``c = (2 - lr beta) / (2 - S lr beta)`` (``steps`` = T iterations).

    Returns ``(bound, floor)``; vectorised over ``steps``."""
    if not 0 < lr * beta < 2:
        raise ValueError(f"need 0 < lr * beta < 2, got lr={lr}, beta={beta}")
    if not (0 < alpha <= beta and v >= 0):
        raise ValueError(f"need 0 < alpha <= beta and V >= 0, got alpha={alpha}, beta={beta}, V={v}")
    gamma = lr * alpha * (2.0 - lr * beta)
    delta = lr * lr * beta * v / (2.0 * gamma)
    steps = np.asarray(steps, dtype=float)
    if rule == "adascale":
        return f0_gap * np.exp(-gamma * steps) + delta, delta
    if rule != "linear":
        raise ValueError(f"rule must be 'adascale' or 'linear', got {rule!r}")
    if not scale * lr * beta < 2:
        raise ValueError(f"linear scaling needs S * lr * beta < 2, got {scale * lr * beta}")
    c = (2.0 - lr * beta) / (2.0 - scale * lr * beta)
    return f0_gap * np.exp(-gamma / c * scale * steps) + c * delta, c * delta


def pl_quadratic_run(scale, rule="adascale", t_si=1000, dim=100, replicas=1000, lr=0.025, alpha=0.1,
                     beta=1.0, base_batch=1, checkpoints=20, seed=0):
    """Plain SGD (no momentum, constant lr: Thm. 2's setting) on the PL quadratic
    ``F = 1/2 sum_i h_i w_i^2``, h log-spaced in [alpha, beta] (so F is alpha-PL and beta-smooth, F* = 0)
    with base-batch gradient noise of trace V = sum(h) / b (the NQM). ``replicas`` independent runs at once
    from w0 = 1/sqrt(h). ``rule="adascale"``: every replica takes lr * r_t with its own exact gain
    ``r_t = gain_ratio(V, |grad F(w_t)|^2, S)`` and stops once tau = sum r_t >= T_SI; ``"linear"``: lr * S
    for ceil(T_SI / S) iterations. Returns, at tau = T_SI * j / checkpoints, the mean (and standard error)
    of F - F* over replicas (each taken at its first iteration with tau >= that value) and the bound of
    :func:`sgd_pl_bound` there, plus alpha, beta, V and the mean iterations."""
    from ..adascale import gain_ratio
    from ..base import get_rule

    scale = int(scale)
    if scale < 1:
        raise ValueError(f"scale must be an integer >= 1, got {scale}")
    if rule not in ("adascale", "linear"):
        raise ValueError(f"rule must be 'adascale' or 'linear', got {rule!r}")
    rng = np.random.default_rng(seed)
    h = NoisyQuadratic(dim, h_min=alpha, h_max=beta).h.numpy()
    v = float(h.sum()) / base_batch  # sigma^2 of one base-batch gradient: the same everywhere, so V
    noise = np.sqrt(h / (scale * base_batch))  # the mean of S worker gradients of batch b each
    w = np.ones((replicas, dim)) / np.sqrt(h)
    f0 = 0.5 * float(dim)
    grid = t_si * np.arange(1, checkpoints + 1) / checkpoints
    rec = np.full((replicas, checkpoints), np.nan)
    tau, iters = np.zeros(replicas), np.zeros(replicas)
    linear = get_rule("linear").multiplier(scale)
    active = np.ones(replicas, dtype=bool)
    while active.any():
        hw = h * w
        if rule == "adascale":
            r = np.asarray(gain_ratio(v, np.einsum("ij,ij->i", hw, hw), scale), dtype=float)
        else:
            r = np.full(replicas, linear)
        r = np.where(active, r, 0.0)
        w -= (lr * r)[:, None] * (hw + noise * rng.standard_normal(w.shape))
        tau += r
        iters += active
        f = 0.5 * np.einsum("ij,j,ij->i", w, h, w)
        hit = (tau[:, None] >= grid[None, :] - 1e-9) & np.isnan(rec)
        rec[hit] = np.broadcast_to(f[:, None], rec.shape)[hit]
        active = tau < t_si - 1e-9
    emp = rec.mean(0)
    se = rec.std(0, ddof=1) / math.sqrt(replicas) if replicas > 1 else np.full(checkpoints, np.nan)
    if rule == "adascale":
        bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, grid)
    else:
        bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, np.ceil(grid / scale - 1e-9), scale, "linear")
    return {"scale": scale, "rule": rule, "taus": grid, "empirical": emp, "stderr": se, "bound": bound,
            "floor": floor, "final": float(emp[-1]), "final_stderr": float(se[-1]),
            "final_bound": float(bound[-1]), "iterations": float(iters.mean()), "f0": f0, "alpha": alpha,
            "beta": beta, "V": v, "lr": lr}


def linear_scaling_floor(scale, dim=100, replicas=200, lr=0.025, alpha=0.1, beta=1.0, base_batch=1,
                         relaxations=5.0, seed=0):
    """The stationary E[F - F*] of SGD with linear scaling (lr * S, batch S * b) on the PL quadratic of
    :func:`pl_quadratic_run`: from w = w* for ``relaxations`` times the slowest mode's variance relaxation
    time (E w_i^2 contracts by (1 - S lr h_i)^2 a step), then averaged over as many more (at least 200).
    Also returns the exact stationary value ``sum_i lr h_i / (2 b (2 - S lr h_i))`` (Gaussian noise) and
    the bound's floor c * Delta."""
    scale = int(scale)
    if not scale * lr * beta < 2:
        raise ValueError(f"linear scaling needs S * lr * beta < 2, got {scale * lr * beta}")
    rng = np.random.default_rng(seed)
    h = NoisyQuadratic(dim, h_min=alpha, h_max=beta).h.numpy()
    step, noise = lr * scale, np.sqrt(h / (scale * base_batch))
    x = step * np.array([alpha, beta])
    burn = int(math.ceil(relaxations / np.min(x * (2.0 - x))))  # E w^2 contracts by (1 - x)^2 a step
    window = max(burn, 200)
    w, total = np.zeros((replicas, dim)), 0.0
    for t in range(burn + window):
        w -= step * (h * w + noise * rng.standard_normal(w.shape))
        if t >= burn:
            total += 0.5 * float(np.einsum("ij,j,ij->", w, h, w)) / replicas
    exact = float(np.sum(lr * h / (2.0 * base_batch * (2.0 - scale * lr * h))))
    _, floor = sgd_pl_bound(1.0, lr, alpha, beta, float(h.sum()) / base_batch, 0.0, scale, "linear")
    return {"scale": scale, "empirical": total / window, "exact": exact, "bound_floor": float(floor),
            "factor": (2.0 - lr * beta) / (2.0 - scale * lr * beta), "iterations": burn + window}


def adascale_bound_check(scales=(1, 4, 16, 64), replicas=1000, floor_replicas=200, **kw):
    """P6-T4: for every S, AdaScale's empirical E[F - F*] at tau = T_SI (and along the way) against its
    Thm. 2 bound, linear scaling's against its bound, and the linear-scaling floor at every S (on the
    PL quadratic and on an isotropic one, h = beta, where the floor ratio must equal
    (2 - lr beta) / (2 - S lr beta) exactly). Keyword arguments go to :func:`pl_quadratic_run`."""
    common = {k: kw[k] for k in ("dim", "lr", "alpha", "beta", "base_batch") if k in kw}
    ada = {s: pl_quadratic_run(s, "adascale", replicas=replicas, seed=s, **kw) for s in scales}
    lin = {s: pl_quadratic_run(s, "linear", replicas=replicas, seed=100 + s, **kw) for s in scales}
    floors = {s: linear_scaling_floor(s, replicas=floor_replicas, seed=200 + s, **common) for s in scales}
    iso_kw = dict(common, alpha=common.get("beta", 1.0))
    iso = {s: linear_scaling_floor(s, replicas=floor_replicas, seed=300 + s, **iso_kw) for s in scales}
    s0 = scales[0]
    return {
        "alpha": ada[s0]["alpha"], "beta": ada[s0]["beta"], "V": ada[s0]["V"], "lr": ada[s0]["lr"],
        "f0": ada[s0]["f0"], "t_si": float(ada[s0]["taus"][-1]),
        "adascale": {s: {"empirical": r["final"], "stderr": r["final_stderr"], "bound": r["final_bound"],
                         "iterations": r["iterations"],
                         "max_ratio_to_bound": float(np.max(r["empirical"] / r["bound"]))}
                     for s, r in ada.items()},
        "linear": {s: {"empirical": r["final"], "stderr": r["final_stderr"], "bound": r["final_bound"],
                       "iterations": r["iterations"],
                       "max_ratio_to_bound": float(np.max(r["empirical"] / r["bound"]))}
                   for s, r in lin.items()},
        "floor": {s: {"empirical": f["empirical"], "exact": f["exact"], "bound_floor": f["bound_floor"],
                      "factor": f["factor"], "ratio": f["empirical"] / floors[s0]["empirical"]}
                  for s, f in floors.items()},
        "isotropic_floor": {s: {"empirical": f["empirical"], "exact": f["exact"], "factor": f["factor"],
                                "ratio": f["empirical"] / iso[s0]["empirical"]} for s, f in iso.items()},
        "curves": {s: {k: r[k] for k in ("taus", "empirical", "stderr", "bound")} for s, r in ada.items()},
        "linear_curves": {s: {k: r[k] for k in ("taus", "empirical", "stderr", "bound")}
                          for s, r in lin.items()},
    }
