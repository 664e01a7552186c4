"""GNSEstimator: unbiasedness on synthetic linear regression (P5-T1), variance ordering (P5-T2), EMAs, NaN."""
import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from elasticlab.gns import GNSEstimator, PerSampleGradNorms, per_example_estimates, two_batch_estimates
from elasticlab.gns.experiments import linear_regression_population, unbiasedness, variance_ordering


def test_p5_t1_estimators_unbiased():
    res = unbiasedness(draws=3000)
    truth = res["truth"]
    assert truth["b_simple"] == pytest.approx(23.2, rel=0.02)      # the calibrated population of P5-T1
    for (bs, bb), est in res["settings"].items():
        assert est["grad_sq"] == pytest.approx(truth["grad_sq"], rel=0.02), (bs, bb)
        assert est["trace_cov"] == pytest.approx(truth["trace_cov"], rel=0.02), (bs, bb)
        assert est["b_simple"] == pytest.approx(truth["b_simple"], rel=0.03), (bs, bb)


def test_p5_t2_variance_ordering():
    res = variance_ordering(draws=3000)
    s = [res["std_trace_cov"][b] for b in (32, 16, 8, 4, 2, 1)]
    assert all(later <= earlier * 1.001 for earlier, later in zip(s, s[1:])), s
    assert s[0] > 1.5 * s[-1]
    g2 = list(res["std_grad_sq"].values())
    assert max(g2) <= 1.1 * min(g2), g2


def test_per_example_form_is_bessel_variance():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((10, 4)) + 1.0
    mean = g.mean(0)
    g2, s = per_example_estimates((g ** 2).sum(1).mean(), 10, mean @ mean)
    assert s == pytest.approx(((g - mean) ** 2).sum() / 9)
    assert g2 == pytest.approx((10 * mean @ mean - (g ** 2).sum(1).mean()) / 9)
    # the same numbers through the two-batch form with b_small = 1
    assert two_batch_estimates((g ** 2).sum(1).mean(), mean @ mean, 1, 10) == pytest.approx((g2, s))


def test_psgn_to_estimator_matches_explicit_per_example_gradients():
    torch.manual_seed(0)
    model = nn.Linear(5, 1, bias=False).double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    with PerSampleGradNorms(model) as n:
        (0.5 * (model(x) - y).pow(2)).mean().backward()
    g = (model(x) - y).detach() * x                       # explicit per-example gradients (16, 5)
    est = GNSEstimator(beta=0.0)
    assert est.update_from(n)
    mean = g.mean(0)
    assert est.trace_cov == pytest.approx(float(((g - mean) ** 2).sum() / 15))
    assert est.grad_sq == pytest.approx(float((16 * mean @ mean - g.pow(2).sum(1).mean()) / 15))
    assert est.layer_b_simple()[""] == pytest.approx(est.b_simple)


def test_bias_corrected_ema_and_ratio_of_means():
    est = GNSEstimator(beta=0.9)
    est.update_two_batch(3.0, 2.0, 1, 2)                    # g2 = 1, S = 2
    assert (est.grad_sq, est.trace_cov, est.b_simple) == pytest.approx((1.0, 2.0, 2.0))
    est.update_two_batch(5.0, 1.0, 1, 2)                    # g2 = -3, S = 8
    w = np.array([0.9, 1.0]) / 1.9                          # bias-corrected weights of the two updates
    assert est.grad_sq == pytest.approx(w @ [1, -3])
    assert est.trace_cov == pytest.approx(w @ [2, 8])
    assert est.b_simple == math.inf                         # |G|² estimate ≤ 0
    assert est.num_updates == 2


def test_b_simple_is_trace_over_grad_sq_away_from_one():
    """B_simple = tr Σ/‖G‖² with ‖G‖² ≠ 1 (at ‖G‖² = 1 a product would pass for the ratio: a mutant did)."""
    est = GNSEstimator(beta=0.5)
    est.update_two_batch(6.0, 5.0, 1, 2)                    # g2 = 4, S = 2
    assert (est.grad_sq, est.trace_cov) == pytest.approx((4.0, 2.0))
    assert est.b_simple == pytest.approx(0.5)
    est.update_two_batch(6.0, 5.0, 1, 2, layer="l")
    assert est.layer_b_simple()["l"] == pytest.approx(0.5)


def test_nan_and_inf_updates_are_skipped_and_counted():
    est = GNSEstimator()
    assert est.update(torch.tensor([1.0, 2.0, 3.0]), 1.0)
    before = est.state_dict()
    assert not est.update(torch.tensor([1.0, float("nan"), 3.0]), 1.0)
    assert not est.update_two_batch(float("inf"), 1.0, 1, 4)
    assert not est.update(torch.tensor([1.0, 2.0]), float("nan"),
                          layers={"a": (torch.tensor([1.0, 2.0]), 1.0)})
    assert est.skipped == 3
    after = est.state_dict()
    assert after["total"] == before["total"]
    assert math.isfinite(est.b_simple)


def test_pollux_pair_and_layers():
    est = GNSEstimator(beta=0.5, init_batch_size=8)
    est.update(torch.tensor([4.0, 6.0]), 1.0, layers={"ln": (torch.tensor([1.0, 3.0]), 0.5)})
    g2, s = per_example_estimates(5.0, 2, 1.0)
    assert est.pollux_params() == pytest.approx((max(g2, 0.0), max(s / 8, 1e-6)))
    assert est.layer_stats()["ln"] == pytest.approx(per_example_estimates(2.0, 2, 0.5))
    # the default M0 is 1: var is tr(Sigma) itself (mutation run: a default of 2 halved it)
    plain = GNSEstimator(beta=0.5)
    plain.update(torch.tensor([4.0, 6.0]), 1.0)
    assert plain.init_batch_size == 1 and plain.var == pytest.approx(max(s, 1e-6))


def test_state_dict_roundtrip_with_weights_only():
    est = GNSEstimator(beta=0.95, init_batch_size=4)
    for i in range(5):
        est.update(torch.tensor([1.0 + i, 2.0, 3.5]), 0.5, layers={"l": (torch.tensor([1.0, 2.0, 3.0]), 0.2)})
    est.update(torch.tensor([float("nan"), 1.0]), 0.1)
    buf = io.BytesIO()
    torch.save(est.state_dict(), buf)
    buf.seek(0)
    other = GNSEstimator()
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert (other.b_simple, other.grad_sq, other.trace_cov, other.skipped, other.var) == \
        (est.b_simple, est.grad_sq, est.trace_cov, est.skipped, est.var)
    assert other.layer_b_simple() == est.layer_b_simple()


def test_bad_input_errors_name_the_value():
    with pytest.raises(ValueError, match="1.5"):
        GNSEstimator(beta=1.5)
    est = GNSEstimator()
    with pytest.raises(ValueError, match="n=1"):
        est.update(torch.tensor([1.0]), 1.0)
    with pytest.raises(ValueError, match="b_small=8, b_big=8"):
        est.update_two_batch(1.0, 1.0, 8, 8)
    with pytest.raises(ValueError, match="missing"):
        est.load_state_dict({"beta": 0.9})
    for bad in (torch.tensor([1.0, 2.0]), torch.ones(3)):  # a vector where a scalar norm belongs
        with pytest.raises(ValueError, match=r"scalar squared norm, got a tensor of shape \(\d,\)"):
            est.update(torch.tensor([4.0, 6.0]), bad)
    assert math.isnan(GNSEstimator().b_simple)


def test_population_truth_is_exact():
    g, truth = linear_regression_population(size=1000, seed=3)
    cov = np.cov(g.T, bias=True)
    assert truth["trace_cov"] == pytest.approx(np.trace(cov))


def test_two_batch_form_with_unequal_replica_batches_is_unbiased():
    """Replicas with unequal batches b_r (e.g. 64 samples on 3 workers: 22, 21, 21): the mean over replicas of
    ‖ḡ_r‖² has expectation ‖G‖² + tr Σ·mean(1/b_r), so the two-batch form with B_small = harmonic mean of
    the b_r (as the elastic workers use it) is unbiased; the arithmetic mean would bias tr Σ."""
    rng = np.random.default_rng(0)
    d, sizes = 20, np.array([22, 21, 21, 3])
    G = rng.normal(size=d) * 0.3
    scale = rng.uniform(0.5, 2.0, size=d)              # tr Σ = Σ scale²
    true_g2, true_s = float(G @ G), float((scale ** 2).sum())
    n, trials = int(sizes.sum()), 8000
    x = G + rng.normal(size=(trials, n, d)) * scale     # per-example gradients
    bounds = np.cumsum(sizes)[:-1]
    reps = np.split(x, bounds, axis=1)
    small = np.mean([np.square(r.mean(1)).sum(-1) for r in reps], axis=0)
    big = np.square(x.mean(1)).sum(-1)
    harmonic = len(sizes) / np.sum(1.0 / sizes)
    g2, s = two_batch_estimates(small, big, harmonic, n)
    assert abs(s.mean() - true_s) < 0.03 * true_s and abs(g2.mean() - true_g2) < 0.1 * true_g2
    _, s_arith = two_batch_estimates(small, big, n / len(sizes), n)
    assert abs(s_arith.mean() - true_s) > 0.2 * true_s    # the naive B_small is visibly biased here


def test_negative_squared_norms_are_skipped_counted_and_warned_once():
    """Issue 16 item 6: a negative squared norm (the issue's b_simple = -2.4) is rejected like NaN: not
    folded, counted, and one RuntimeWarning for the estimator's lifetime."""
    est = GNSEstimator(beta=0.5)
    assert est.update(torch.tensor([1.0, 2.0, 3.0]), 1.0)
    before = est.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not est.update(torch.tensor([4.0, -0.5, 3.0]), 1.0)          # mean 2.17 > 0, one row < 0
        assert not est.update(torch.tensor([1.0, 2.0]), -1.0)                # ‖ḡ‖² < 0
        assert not est.update_per_example(-2.0, 4, 1.0)
        assert not est.update_two_batch(-1.0, 2.0, 1, 4)                    # S_est from a negative norm
        assert not est.update_two_batch(1.0, float("-inf"), 1, 4)
        assert not est.update(torch.tensor([1.0, float("inf")]), 1.0)
        assert est.update(torch.tensor([1.0, 2.0]), 0.5, layers={"l": (torch.tensor([-1e-9, 2.0]), 0.5)})
    ours = [w for w in caught if "GNSEstimator" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert ours[0].filename == __file__, ours[0].filename  # attributed to the caller's line, not the package
    assert "-0.5" in str(ours[0].message)
    assert est.skipped == 6 and est.layer_skipped == {"l": 1}
    assert est.num_updates == 2 and "l" not in est.layer_stats()
    est2 = GNSEstimator(beta=0.5)
    est2.load_state_dict(before)
    est2.update(torch.tensor([1.0, 2.0]), 0.5)
    assert est.state_dict()["total"] == est2.state_dict()["total"]
    assert est.b_simple > 0


def test_nan_update_warns_too_and_zero_norms_are_accepted():
    est = GNSEstimator()
    with pytest.warns(RuntimeWarning, match="nan"):
        assert not est.update(torch.tensor([float("nan"), 1.0]), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert est.update(torch.tensor([0.0, 0.0]), 0.0)                    # exactly 0 is a squared norm
        assert est.update_two_batch(0.0, 0.0, 1, 2)
    assert est.skipped == 1 and est.num_updates == 2


@pytest.mark.parametrize("b_small, b_big, named", [
    (4, 4, "b_small=4, b_big=4"),
    (0, 8, "b_small=0, b_big=8"),
    (2, float("nan"), "b_small=2, b_big=nan"),
    (np.array([1, 2, 3]), np.array([4, 2, 5]), r"b_small=2, b_big=2 \(at index \(1,\)\)"),
])
def test_two_batch_formula_names_a_degenerate_pair_of_batch_sizes(b_small, b_big, named):
    with pytest.raises(ValueError, match=named):
        two_batch_estimates(1.0, 0.5, b_small, b_big)
    with pytest.raises(ValueError, match="b_small=1, b_big=1"):
        per_example_estimates(1.0, 1, 0.5)                 # one example: no variance to estimate
