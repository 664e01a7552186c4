"""Core computations of the P2-T3 (Dynamic SGD on digits) and P6-T4 (AdaScale's convergence bound)
experiments in :mod:`elasticlab.lr.experiments`."""
import math

import numpy as np
import pytest
import torch

from elasticlab.lr.experiments import (
    accumulate_worker_grads,
    batched_mlp,
    batched_mlp_forward,
    digits_elastic_run,
    digits_splits,
    linear_scaling_floor,
    pl_quadratic_run,
    sgd_pl_bound,
)


def test_accumulation_equals_one_big_batch_per_seed():
    xtr, ytr, _, _ = digits_splits(seeds=3)
    params = batched_mlp(3, hidden=16, seed=1)
    x, y = xtr[:, :64], ytr[:, :64]
    accumulate_worker_grads(params, x, y, workers=8)  # 8 micro-batches of 8
    acc = [p.grad.clone() for p in params]
    accumulate_worker_grads(params, x, y, workers=1)  # one batch of 64
    for a, p in zip(acc, params):
        assert torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7)
    # and per seed it is the plain mean-loss gradient of that seed's own batch only
    w = [p[1].detach().clone().requires_grad_() for p in params]
    logits = batched_mlp_forward([v[None] for v in w], x[1:2])
    torch.nn.functional.cross_entropy(logits[0], y[1]).backward()
    for a, v in zip(acc, w):
        assert torch.allclose(a[1], v.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="micro-batches"):
        accumulate_worker_grads(params, x[:, :60], y[:, :60], workers=8)


def test_digits_arms_see_the_same_examples_and_the_schedule():
    data = digits_splits(seeds=2)
    n = data[1].shape[1]
    runs = {v: digits_elastic_run(v, epochs=2, seeds=2, data=data, evals=40)
            for v in ("fixed", "dynamic_sgd", "immediate")}
    steps = (2 * n) // (32 * 19)  # per phase of 1 + 8 + 2 + 8 workers
    assert {r["examples"] for r in runs.values()} == {steps * 32 * 19}
    assert runs["fixed"]["steps"] == 19 * steps and runs["dynamic_sgd"]["steps"] == 4 * steps
    assert runs["dynamic_sgd"]["phase_starts"] == [steps * 32, steps * 32 * 9, steps * 32 * 11]
    for r in runs.values():
        assert r["accuracy"].shape == (2,) and np.all((r["accuracy"] >= 0) & (r["accuracy"] <= 1))
    assert list(runs["immediate"]["switch_drops"]) == ["1->8", "8->2", "2->8"]
    # same examples, same init: the first phase (one worker, LR unchanged) is identical in every arm
    first = [r["curve_examples"][1] for r in runs.values()]
    assert first[0] < steps * 32 and len(set(first)) == 1
    acc1 = [r["curve_accuracy"][1] for r in runs.values()]
    assert acc1[0] == acc1[1] == acc1[2] and acc1[0] != runs["fixed"]["curve_accuracy"][0]
    with pytest.raises(ValueError, match="variant"):
        digits_elastic_run("bogus", data=data)


def test_bound_formulas_by_hand():
    f0, lr, alpha, beta, v, t = 7.0, 0.1, 0.5, 2.0, 3.0, 10.0
    gamma = 0.1 * 0.5 * (2 - 0.2)  # 0.09
    delta = 0.1**2 * 2.0 * 3.0 / (2 * gamma)  # 1/3
    bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, t)
    assert floor == pytest.approx(1 / 3) and bound == pytest.approx(7.0 * math.exp(-0.9) + 1 / 3)
    c = (2 - 0.2) / (2 - 4 * 0.2)  # 1.5
    bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, t, scale=4, rule="linear")
    assert floor == pytest.approx(c * delta) == pytest.approx(0.5)
    assert bound == pytest.approx(7.0 * math.exp(-gamma / c * 4 * 10) + 0.5)
    # S = 1 linear scaling is the single-batch bound
    assert sgd_pl_bound(f0, lr, alpha, beta, v, t, 1, "linear")[0] == pytest.approx(
        sgd_pl_bound(f0, lr, alpha, beta, v, t)[0])
    with pytest.raises(ValueError, match="S \\* lr \\* beta"):
        sgd_pl_bound(f0, lr, alpha, beta, v, t, scale=10, rule="linear")
    with pytest.raises(ValueError, match="lr \\* beta"):
        sgd_pl_bound(f0, 1.5, alpha, beta, v, t)


def test_floor_bound_is_tight_on_an_isotropic_quadratic():
    # h = beta everywhere: the exact stationary loss equals c(S) * Delta; with a spread of curvatures
    # it is strictly below (the bound uses beta for smoothness and alpha for PL)
    for s in (1, 4, 16):
        iso = linear_scaling_floor(s, dim=10, replicas=2, lr=0.05, alpha=1.0, beta=1.0, relaxations=0.1)
        assert iso["exact"] == pytest.approx(iso["bound_floor"], rel=1e-12)
        spread = linear_scaling_floor(s, dim=10, replicas=2, lr=0.05, alpha=0.1, beta=1.0, relaxations=0.1)
        assert spread["exact"] < spread["bound_floor"]


def test_linear_scaling_floor_simulation_matches_the_exact_value():
    out = linear_scaling_floor(8, dim=20, replicas=400, lr=0.05, alpha=0.2, beta=1.0, seed=3)
    assert out["empirical"] == pytest.approx(out["exact"], rel=0.03)
    assert out["factor"] == pytest.approx((2 - 0.05) / (2 - 0.4))


def test_pl_quadratic_run_stopping_and_bound():
    ada1 = pl_quadratic_run(1, "adascale", t_si=200, dim=10, replicas=50, checkpoints=4)
    assert ada1["iterations"] == 200  # r = 1 at S = 1
    lin = pl_quadratic_run(4, "linear", t_si=200, dim=10, replicas=50, checkpoints=4)
    assert lin["iterations"] == 50  # T_SI / S
    ada = pl_quadratic_run(16, "adascale", t_si=200, dim=10, replicas=50, checkpoints=4)
    assert 200 / 16 <= ada["iterations"] < 200  # r in [1, S]
    assert np.all(ada["empirical"] < ada["bound"]) and ada["f0"] == 5.0
    assert ada["V"] == pytest.approx(float(np.logspace(-1, 0, 10).sum()))
