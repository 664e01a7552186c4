"""Core computations of the P5-T3 (steps/examples trade-off) and P5-T5 (LayerNorm-GNS proxy) experiments."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elasticlab.gns import GNSEstimator, PerSampleGradNorms
from elasticlab.gns.experiments import (
    fit_steps_examples,
    layernorm_gns_proxy,
    lsq_curvatures,
    lsq_noise_scales,
    lsq_steps_to_target,
    tiny_char_transformer,
)
from elasticlab.gns.reference import func_param_sq_norms


def test_lsq_noise_scales_match_the_estimator_on_sampled_gradients():
    h, noise = lsq_curvatures(8, 10.0), 0.3
    rng = np.random.default_rng(0)
    err = rng.standard_normal(8)
    b_simple, b_noise = lsq_noise_scales(h, err, noise)
    # per-example gradients g_i = x_i (x_iᵀe − noise·ε_i) of a large batch, through GNSEstimator
    est = GNSEstimator(beta=0.9)
    for _ in range(20):
        x = rng.standard_normal((20_000, 8)) * np.sqrt(h)
        g = x * (x @ err - noise * rng.standard_normal(20_000))[:, None]
        gbar = g.mean(0)
        est.update((g**2).sum(1), float(gbar @ gbar))
    assert est.b_simple == pytest.approx(b_simple, rel=0.05)
    assert b_noise != pytest.approx(b_simple, rel=0.05)          # H not ∝ I: they differ
    # H ∝ I: B_noise = B_simple (McCandlish, after Eq. 2.9)
    flat = np.full(8, 0.5)
    assert np.allclose(*lsq_noise_scales(flat, err, noise))


def test_fit_steps_examples_recovers_the_hyperbola():
    b = 2.0 ** np.arange(11)
    exact = 7.0 * (1 + 40.0 / b)
    fit = fit_steps_examples(b, exact)
    assert fit["s_min"] == pytest.approx(7.0, rel=1e-3) and fit["b_crit"] == pytest.approx(40.0, rel=1e-3)
    assert fit["e_min"] == pytest.approx(280.0, rel=1e-3) and fit["r2_log"] == pytest.approx(1.0, abs=1e-9)
    assert np.allclose(fit["ratio_to_fit"], 1.0, atol=1e-3) and np.allclose(fit["product"], 1.0, atol=1e-2)
    # a curve of another shape (S ∝ B^-1/2) is not a hyperbola: points sit far off the fit
    bad = fit_steps_examples(b, 100.0 / np.sqrt(b))
    assert np.max(np.abs(bad["ratio_to_fit"] - 1)) > 0.15


def test_lsq_sgd_trades_steps_for_examples():
    h = lsq_curvatures(16, 10.0)
    target = 0.01 * 0.5 * h.sum()
    lrs = np.logspace(-3, 0, 16) * 2.0 / h.max()
    s1, lr1 = lsq_steps_to_target(h, 0.1, 1, lrs, target, replicas=8, seed=1)
    s64, lr64 = lsq_steps_to_target(h, 0.1, 64, lrs, target, replicas=8, seed=2)
    assert math.isfinite(s1) and math.isfinite(s64)
    assert s1 > 4 * s64 and s1 < 64 * s64       # fewer steps, more examples at the larger batch
    assert lr1 < lr64                           # the tuned LR grows with the batch
    # a target below the noise floor of the only LR offered is never reached
    s, lr = lsq_steps_to_target(h, 1.0, 1, [1.0], 1e-6, replicas=2, max_steps=200)
    assert s == math.inf and math.isnan(lr)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")   # vmap over SDPA
def test_tiny_transformer_is_fully_covered_and_its_norms_are_exact():
    torch.manual_seed(0)
    vocab, T = 11, 8
    model = tiny_char_transformer(vocab, context=T, d=16, layers=2, heads=2)
    x = torch.randint(0, vocab, (4, T + 1))
    with PerSampleGradNorms(model) as psn:          # strict: every parameter has a rule
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
        got = psn.param_sq_norms()
    assert psn.skipped == []

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    ref = func_param_sq_norms(model, loss_fn, x[:, :-1], x[:, 1:])
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-7, msg=k)


def test_layernorm_gns_proxy_runs_and_tracks_the_total():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: more threads only add synchronisation on a shared machine
    try:
        r = layernorm_gns_proxy(steps=40, batch=8, context=16, d=32, beta=0.9)
    finally:
        torch.set_num_threads(threads)
    assert r["not_covered"] == [] and r["skip"] == 10
    assert set(r["correlation"]) == {"layernorm", "linear", "embedding"}
    total, ln = r["b_simple_total"], r["b_simple_groups"]["layernorm"]
    assert np.isfinite(total).all() and np.isfinite(ln).all()
    assert len(total) == len(ln) == 40
    # the reported r is Pearson's over the series after the EMA's first time constant, computed here by hand
    k = r["skip"]
    for group, series in r["b_simple_groups"].items():
        a, b = np.asarray(series[k:], float), np.asarray(total[k:], float)
        want = ((a - a.mean()) * (b - b.mean())).sum() / np.sqrt(((a - a.mean()) ** 2).sum()
                                                                  * ((b - b.mean()) ** 2).sum())
        assert r["correlation"][group] == pytest.approx(want, abs=1e-9), group
    assert 0 < r["layernorm_params"] < r["params"]
    assert r["loss"][-5:].mean() < r["loss"][:5].mean()
