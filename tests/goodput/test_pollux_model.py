"""Pollux goodput model: P4-T1 .. P4-T4 of shared/reference/papers.md, plus input checking."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.optimize import check_grad

from elasticlab import goodput as gp
from elasticlab.goodput import (
    GoodputFunction,
    GradParams,
    ThroughputModel,
    efficiency,
    fit_throughput_model,
    fitness,
    noise_scale,
    restart_penalty,
)
from elasticlab.lr import gain_ratio

TRUE = ThroughputModel(alpha_grad=0.05, beta_grad=2e-3, alpha_local=0.02, beta_local=1e-3,
                       alpha_node=0.1, beta_node=5e-3, gamma=2.0)

# ------------------------------------------------------------------------------------ P4-T1


@settings(max_examples=200, deadline=None)
@given(phi=st.floats(0, 1e6), m0=st.floats(1, 1e4), scale=st.floats(1, 1e3))
def test_efficiency_identities(phi, m0, scale):
    m = m0 * scale
    assert efficiency(phi, m0, m0) == pytest.approx(1.0)
    e = efficiency(phi, m0, m)
    assert 0 < e <= 1 + 1e-12
    # E(M) = r(M/M0) / (M/M0) with AdaScale's gain, sigma^2/mu^2 = phi/M0 (take mu^2 = 1)
    assert e == pytest.approx(gain_ratio(phi / m0, 1.0, scale) / scale, rel=1e-9)
    # AdaScale's gain by hand, r = (sigma^2 + mu^2) / (sigma^2/S + mu^2) with sigma^2/mu^2 = phi/M0, and its
    # bounds 1 <= r <= S (Johnson et al. 2020, Sec. 3)
    r = (phi / m0 + 1.0) / (phi / m0 / scale + 1.0)
    assert gp.gain(phi, m0, m) == pytest.approx(r, rel=1e-9)
    assert 1 - 1e-12 <= gp.gain(phi, m0, m) <= scale * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(phi=st.floats(0, 1e5), m0=st.floats(1, 1e3))
def test_efficiency_is_one_half_at_phi_plus_two_m0(phi, m0):
    assert efficiency(phi, m0, phi + 2 * m0) == pytest.approx(0.5, rel=1e-9)


def test_efficiency_decreasing_and_limits():
    m = np.geomspace(128, 1e5, 200)
    e = efficiency(300.0, 128, m)
    assert np.all(np.diff(e) < 0)
    assert efficiency(1e12, 128, 1e5) == pytest.approx(1.0, abs=1e-6)
    assert efficiency(math.inf, 128, 1e5) == 1.0
    assert efficiency(0.0, 128, 1024) == pytest.approx(128 / 1024)
    # vectorised in phi too
    assert efficiency(np.array([0.0, 1e9]), 10, 20).shape == (2,)


# ------------------------------------------------------------------------------------ P4-T2


def _grid(rng, noise=0.05):
    """The reference grid: K in {1, 2, 4, 8, 16} on 1/2/4 nodes, m in 16..256, s in {0, 1}."""
    rows = []
    for nodes, gpus in [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)]:
        for b in [16, 32, 64, 128, 256]:
            for s in (0, 1):
                t = float(TRUE.iter_time(nodes, gpus, b, s)) * math.exp(noise * rng.standard_normal())
                rows.append((nodes, gpus, b, s, t))
    return rows


def test_fit_predicts_held_out_configurations_within_10_percent():
    rng = np.random.default_rng(1)
    rows = _grid(rng)
    held = [r for r in rows if r[2] == 64 or (r[0], r[1]) == (2, 8)]
    train = [r for r in rows if r not in held]
    model = fit_throughput_model(train)
    obs = np.array(held, dtype=float)
    pred = model.iter_time(obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3])
    truth = TRUE.iter_time(obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3])
    assert np.mean(np.abs(pred / truth - 1)) < 0.10
    assert np.mean(np.abs(pred / obs[:, 4] - 1)) < 0.10
    assert 1.0 <= model.gamma <= 10.0


def test_fit_with_sync_times_recovers_sync_model():
    rows = []
    for nodes, gpus in [(1, 1), (1, 2), (1, 4), (2, 4), (4, 8), (4, 16)]:
        for b in [16, 64, 256]:
            t = float(TRUE.iter_time(nodes, gpus, b, 0))
            sync = float(TRUE.sync_time(nodes, gpus))
            # the artifact's convention: the compute part is what is left once the sync is taken off
            rows.append((nodes, gpus, b, 0, t, sync if gpus > 1 else 0.0))
    model = fit_throughput_model(rows)
    np.testing.assert_allclose(model.sync_time([2, 4], [8, 16]), TRUE.sync_time([2, 4], [8, 16]), rtol=0.1)


def test_fit_gradient_is_exact():
    obs = gp._as_observations(_grid(np.random.default_rng(0)))
    n, k, b, s, t, sync = obs.T
    mask = np.array([True] * 6 + [False])
    args = (mask, n, k, b, s, t, np.ones_like(t), np.zeros(len(t), bool), sync, np.zeros(len(t), bool))
    x = np.array([math.log(0.04), math.log(1e-3), math.log(0.03), math.log(2e-3), math.log(0.2),
                  math.log(1e-3), 2.5])
    err = check_grad(lambda x: gp._objective(x, *args)[0], lambda x: gp._objective(x, *args)[1], x)
    assert err < 1e-5


def test_gamma_limits():
    no_overlap = ThroughputModel(0.1, 0.0, 0.05, 0.0, 0.0, 0.0, gamma=1.0)
    assert no_overlap.iter_time(1, 2, 1) == pytest.approx(0.15)
    full = ThroughputModel(0.1, 0.0, 0.05, 0.0, 0.0, 0.0, gamma=10.0)
    assert full.iter_time(1, 2, 1) == pytest.approx(0.1, rel=1e-3)  # -> max(T_grad, T_sync)
    # accumulation steps are pure compute
    assert full.iter_time(1, 2, 1, 3) == pytest.approx(0.3 + full.iter_time(1, 2, 1))
    # one GPU never syncs, one node uses the local pair, several nodes the node pair
    assert TRUE.sync_time([1, 1, 2], [1, 4, 4]).tolist() == pytest.approx([0.0, 0.022, 0.11])


def test_prior_pins_what_single_gpu_data_cannot_identify():
    rows = [(1, 1, b, 0, float(TRUE.iter_time(1, 1, b))) for b in (16, 32, 64, 128)]
    model = fit_throughput_model(rows)
    assert model.alpha_grad == pytest.approx(0.05, rel=0.05)
    assert model.beta_grad == pytest.approx(2e-3, rel=0.05)
    # optimistic: sync assumed free until seen, inter-node >= 1.1 x intra-node
    assert model.alpha_local < 1e-6 and model.beta_local < 1e-6
    assert model.alpha_node >= 1.1 * model.alpha_local and model.beta_node >= 1.1 * model.beta_local
    # one batch size seen: alpha_grad pinned to half the compute time
    one = fit_throughput_model([(1, 1, 32, 0, 0.2), (1, 1, 32, 1, 0.4)])
    assert one.alpha_grad == pytest.approx(0.1)
    assert one.iter_time(1, 1, 32) == pytest.approx(0.2, rel=0.02)


def test_fit_accepts_dataframe_and_array():
    import pandas as pd

    rows = _grid(np.random.default_rng(2), noise=0.0)
    df = pd.DataFrame(rows, columns=list(gp.OBSERVATION_COLUMNS[:5]))
    a = fit_throughput_model(df)
    b = fit_throughput_model(np.array(rows))
    assert a == b


# ------------------------------------------------------------------------------------ P4-T3


def _best_batch(phi, gpus, nodes=1, **kw):
    fn = GoodputFunction(TRUE, phi, 128)
    g, b, s = fn.optimize(nodes, gpus, max_batch=8192, max_per_gpu_batch=256, **kw)
    return gpus * b * (s + 1)


def test_chosen_batch_grows_with_phi_and_gpus():
    phis = [1.0, 30.0, 100.0, 300.0, 1e3, 3e3, 1e4, 1e5]
    gpus = [1, 2, 4, 8, 16, 32]
    table = np.array([[_best_batch(phi, k, nodes=1 if k <= 4 else k // 4) for k in gpus] for phi in phis])
    assert np.all(np.diff(table, axis=0) >= 0), table  # non-decreasing in phi
    assert np.all(np.diff(table, axis=1) >= 0), table  # non-decreasing in K
    assert table[-1, -1] > 4 * table[0, -1]


def test_no_noise_single_gpu_keeps_initial_batch():
    assert _best_batch(1e-9, 1) == 128
    fn = GoodputFunction(TRUE, 0.0, 128)
    assert fn.optimize(1, 1, max_batch=4096) == pytest.approx((float(fn.evaluate(1, 1, 128, 0)), 128, 0))


def test_optimize_respects_limits_and_matches_evaluate():
    fn = GoodputFunction(TRUE, 2000.0, 128)
    nodes = np.array([1, 1, 1, 2, 4, 4])
    gpus = np.array([1, 2, 4, 8, 8, 16])
    g, b, s = fn.optimize(nodes, gpus, max_batch=4096, min_per_gpu_batch=8, max_per_gpu_batch=64, max_accum=3)
    assert g.shape == b.shape == s.shape == (6,)
    assert np.all((b >= 8) & (b <= 64)) and np.all(s <= 3)
    np.testing.assert_allclose(g, fn.evaluate(nodes, gpus, b, s))
    assert np.all(gpus * b * (s + 1) >= 128)
    # one GPU above M0 takes >= 1 accumulation step (Pollux: the GNS needs two micro-batches)
    assert s[0] >= 1
    # the vectorised call equals scalar calls
    for i in range(6):
        gi, bi, si = fn.optimize(int(nodes[i]), int(gpus[i]), max_batch=4096, min_per_gpu_batch=8,
                                 max_per_gpu_batch=64, max_accum=3)
        assert (gi, bi, si) == (pytest.approx(g[i]), b[i], s[i])
    # it beats every configuration on the candidate grid it searched, and a brute-force search nearby
    for m in np.geomspace(128, 4096, 20):
        for acc in range(4):
            bb = math.ceil(m / 8 / (acc + 1))
            if 8 <= bb <= 64:
                assert fn.evaluate(2, 8, bb, acc) <= g[3] * 1.02


def test_candidate_grid_ends():
    """The grid runs from the smallest feasible batch, max(M0, min_per_gpu_batch * K), to max_batch, never
    beyond (mutation run: ``min_b * K`` -> ``min_b / K`` survived)."""
    no_noise = GoodputFunction(TRUE, 0.0, 128)  # the smallest batch is best
    assert no_noise.optimize(1, 8, max_batch=4096, min_per_gpu_batch=64, num_candidates=2)[1:] == (64, 0)
    pure_noise = GoodputFunction(TRUE, 1e12, 128)  # the largest batch is best
    _, b, s = pure_noise.optimize(1, 8, max_batch=4096)
    assert 8 * b * (s + 1) == 4096
    # max_accum=0 is a valid limit (no accumulation), not an error
    _, b, s = pure_noise.optimize(1, 8, max_batch=4096, max_per_gpu_batch=256, max_accum=0)
    assert s == 0 and 200 < b <= 256  # the largest grid point that fits the cap without accumulation
    # the base allocation's nodes and GPUs are both read: base (1, 2) is not (2, 2)
    assert pure_noise.speedup(1, 2, base=(1, 2), max_batch=4096) == pytest.approx(1.0)
    assert pure_noise.speedup_table(1, 4, base=(1, 2), max_batch=4096)[1, 2] == pytest.approx(1.0)
    # without accumulation one GPU keeps M0 (Pollux's GNS needs two micro-batches); more GPUs grow freely
    assert pure_noise.optimize(1, 1, max_batch=4096, accumulation=False)[1:] == (128, 0)
    assert pure_noise.optimize(1, 4, max_batch=4096, accumulation=False)[1:] == (1024, 0)
    # max_batch = M0 is allowed (no batch-size adaptation), not "below the initial batch"
    assert pure_noise.optimize(1, 1, max_batch=128)[1:] == (128, 0)


def test_infeasible_allocations_get_zero():
    fn = GoodputFunction(TRUE, 100.0, 128)
    g, b, s = fn.optimize([0, 2, 1, 16], [0, 1, 4, 64], max_batch=512, min_per_gpu_batch=32)
    assert g[0] == 0 and g[1] == 0  # no GPUs; more nodes than GPUs
    assert g[2] > 0
    assert g[3] == 0 and b[3] == 0  # 64 GPUs x 32 > max batch 512


def test_artifact_keyword_aliases():
    fn = GoodputFunction(TRUE, GradParams.from_gns(500.0, 128), 128)
    assert fn.phi == pytest.approx(500.0)
    assert GoodputFunction(TRUE, grad_sqr=2.0, grad_var=0.5, init_batch=128).phi == pytest.approx(32.0)
    with pytest.raises(ValueError, match="grad_sqr"):
        GoodputFunction(TRUE, grad_sqr=2.0, init_batch=128)
    assert fn.optimize(1, 4, max_batch_size=2048, atomic_bsz_range=(16, 128)) == fn.optimize(
        1, 4, max_batch=2048, min_per_gpu_batch=16, max_per_gpu_batch=128)


def test_speedup_table_matches_speedup():
    fn = GoodputFunction(TRUE, 1000.0, 128)
    kw = dict(max_batch=8192, max_per_gpu_batch=256)
    table = fn.speedup_table(16, 4, **kw)
    assert table.shape == (17, 65)
    assert table[1, 1] == pytest.approx(1.0) and table[0, 0] == 0
    assert table[2, 1] == 0 and table[1, 5] == 0  # K < N, K > 4N
    nodes, gpus = np.nonzero(table)
    np.testing.assert_allclose(table[nodes, gpus], fn.speedup(nodes, gpus, **kw))
    assert table[16, 64] > table[1, 4] > 1
    # the cached candidate grid is shared across jobs with the same limits; phi and theta are not
    other = GoodputFunction(ThroughputModel(0.02, 1e-3, 0.05, 2e-3, 0.2, 1e-2, 1.5), 50.0, 128)
    table2 = other.speedup_table(16, 4, **kw)
    np.testing.assert_allclose(table2[nodes, gpus], other.speedup(nodes, gpus, **kw))
    assert not np.allclose(table, table2)
    # a small M0 on many GPUs: the per-GPU minimum (default 1) sets the smallest candidate, and the table
    # must use the same default as optimize (mutation run: the grid's own default drifted to 2)
    small = GoodputFunction(TRUE, 0.0, 16)  # no noise: the smallest batch is best
    table3 = small.speedup_table(4, 8, max_batch=1024)
    nodes, gpus = np.nonzero(table3)
    np.testing.assert_allclose(table3[nodes, gpus], small.speedup(nodes, gpus, max_batch=1024))
    assert small.optimize(4, 32, max_batch=1024)[1:] == (1, 0)


# ------------------------------------------------------------------------------------ P4-T4


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_power_mean_fairness_knob(seed):
    x = np.random.default_rng(seed).uniform(0.05, 10.0, size=(5, 7))
    assert np.allclose(fitness(x, 1), x.mean(-1))
    assert np.allclose(fitness(x, -np.inf), x.min(-1))
    assert np.allclose(fitness(x, -200), x.min(-1), rtol=0.02)
    for p in (-3.0, -1.0, 0.5, 2.0):  # the numpy power mean agrees with scipy's
        assert np.allclose(fitness(x, p), stats.pmean(x, p, axis=-1))
    assert np.allclose(fitness(x, 0), stats.gmean(x, axis=-1))
    ps = [-np.inf, -10, -1, -0.5, 0, 0.5, 1, 2, np.inf]
    vals = np.array([fitness(x, p) for p in ps])
    assert np.all(np.diff(vals, axis=0) >= -1e-9)  # power-mean inequality


def test_fitness_with_starved_job_and_restart_penalty():
    assert fitness([2.0, 0.0, 3.0], -1) == 0.0
    assert fitness([2.0, 0.0, 3.0], 1) == pytest.approx(5 / 3)
    assert restart_penalty(0.0, 0) == 0.0
    assert restart_penalty(3000.0, 2) == pytest.approx(2940 / 3030)


# ------------------------------------------------------------------------------------ inputs


class _GNS:
    b_simple = None
    grad_sq = 4.0
    trace_cov = 200.0


def test_noise_scale_duck_typing():
    assert noise_scale(37.0) == 37.0
    assert noise_scale((2.0, 0.5), 100) == pytest.approx(25.0)
    assert noise_scale(_GNS()) == pytest.approx(50.0)
    g = _GNS()
    g.b_simple = -3.0  # a noisy estimate is clipped, not an error
    assert noise_scale(g) == 0.0
    assert noise_scale((0.0, 1.0), 8) == math.inf
    with pytest.raises(ValueError, match="-1"):
        noise_scale(-1.0)
    with pytest.raises(TypeError):
        noise_scale(object())


class _Stats:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_noise_scale_half_pairs_and_nan():
    """A pair of statistics is read only when both halves are there (mutation run: ``and`` -> ``or``), and
    NaN in either half of ``(sqr, var)`` is an error, not a NaN phi (``or`` -> ``and``)."""
    # grad_sq without trace_cov falls through to sqr/var: phi = M0 * var / sqr = 8 * 0.5 / 2
    assert noise_scale(_Stats(grad_sq=4.0, sqr=2.0, var=0.5), 8) == pytest.approx(2.0)
    assert noise_scale(_Stats(trace_cov=4.0, sqr=2.0, var=0.5), 8) == pytest.approx(2.0)
    for half in (_Stats(grad_sq=4.0), _Stats(sqr=2.0), _Stats(var=0.5)):
        with pytest.raises(TypeError, match="cannot read a gradient noise scale"):
            noise_scale(half, 8)
    # a 0-d array is a number (``ndim == 0`` -> ``!= 0`` sent it to the attribute readers)
    assert noise_scale(np.array(37.0)) == 37.0
    with pytest.raises(ValueError, match="-1"):
        noise_scale(np.array(-1.0))
    # no signal and no noise (or noise clipped to 0): phi = 0, not inf or 1 (``num > 0`` -> ``>=``)
    assert noise_scale((0.0, 0.0), 8) == 0.0
    assert noise_scale((-1.0, -0.5), 8) == 0.0
    assert noise_scale(_Stats(grad_sq=0.0, trace_cov=0.0)) == 0.0
    for pair in ((math.nan, 1.0), (1.0, math.nan)):
        with pytest.raises(ValueError, match="NaN"):
            noise_scale(pair, 8)
        with pytest.raises(ValueError, match="NaN"):
            noise_scale(_Stats(sqr=pair[0], var=pair[1]), 8)


def test_bad_inputs_raise_clear_errors():
    fn = GoodputFunction(TRUE, 10.0, 128)
    with pytest.raises(ValueError, match="greater than its maximum"):
        fn.optimize(1, 1, batch_range=(1024, 256))
    with pytest.raises(ValueError, match="below the initial batch"):
        fn.optimize(1, 1, max_batch=64)
    # max_batch and batch_range together: agreeing maxima are one request, disagreeing ones a clear error
    both = fn.optimize([1, 2], [2, 8], max_batch=1024, batch_range=(256, 1024))
    alone = fn.optimize([1, 2], [2, 8], batch_range=(256, 1024))
    for a, b in zip(both, alone):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"pair .* got \(1024,\)"):
        fn.optimize(1, 2, batch_range=(1024,))
    with pytest.raises(ValueError, match="max_batch=2048 disagrees"):
        fn.optimize(1, 2, max_batch=2048, batch_range=(256, 1024))
    with pytest.raises(ValueError, match="phi"):
        efficiency(-1.0, 128, 256)
    with pytest.raises(ValueError, match="phi"):
        GoodputFunction(TRUE, -5.0, 128)
    with pytest.raises(ValueError, match="empty"):
        fit_throughput_model([])
    with pytest.raises(ValueError, match="iter_time = -0.5"):
        fit_throughput_model([(1, 1, 32, 0, 0.1), (1, 2, 32, 0, -0.5)])
    with pytest.raises(ValueError, match="gpus"):
        fit_throughput_model([(2, 1, 32, 0, 0.1)])
    with pytest.raises(ValueError, match="sync_time"):
        fit_throughput_model([(1, 2, 32, 0, 0.1, 0.3)])
    with pytest.raises(ValueError, match="alpha_grad"):
        ThroughputModel(alpha_grad=-0.1, beta_grad=0.0)
    with pytest.raises(ValueError, match="gamma"):
        ThroughputModel(0.1, 0.0, gamma=0.5)
    with pytest.raises(ValueError, match="init_batch"):
        GoodputFunction(TRUE, 1.0, 0)
    with pytest.raises(ValueError, match="min_per_gpu_batch"):
        fn.optimize(1, 2, max_batch=512, min_per_gpu_batch=64, max_per_gpu_batch=32)
    # an infeasible base allocation (2 nodes, 1 GPU) is an error, not a division by zero
    with pytest.raises(ValueError, match=r"no feasible configuration on the base allocation \(2, 1\)"):
        fn.speedup(2, 8, base=(2, 1), max_batch=512)
    with pytest.raises(ValueError, match=r"no feasible configuration on the base allocation \(2, 1\)"):
        fn.speedup_table(2, 4, base=(2, 1), max_batch=512)
    for nodes, gpus in ((-1, 2), (1, -2), ([1, -1], [2, 2])):
        with pytest.raises(ValueError, match="nodes and gpus must be >= 0"):
            fn.optimize(nodes, gpus, max_batch=512)


def test_fit_on_the_artifact_traces():
    """theta_sys fitted to a measured trace (Pollux artifact, cifar10 on T4 GPUs) predicts its step times;
    the paper reports <= 10% average error over its testbed allocations."""
    import pandas as pd

    traces = pytest.importorskip("elasticlab.sim.traces")
    data_dir = traces.data_dir
    path = data_dir() / "traces" / "cifar10" / "placements.csv"
    if not path.exists():
        pytest.skip(f"artifact data not found at {path}")
    df = pd.read_csv(path, dtype={"placement": str})
    nodes = df.placement.str.len().to_numpy()
    gpus = df.placement.map(lambda p: sum(int(c) for c in p)).to_numpy()
    obs = np.column_stack([nodes, gpus, df.local_bsz, np.zeros(len(df)), df.step_time, df.sync_time])
    model = fit_throughput_model(obs)
    pred = model.iter_time(nodes, gpus, df.local_bsz.to_numpy())
    assert np.mean(np.abs(pred / df.step_time.to_numpy() - 1)) < 0.15
    scal = pd.read_csv(path.with_name("scalability.csv"))  # 6-16 nodes, never seen by the fit
    pred = model.iter_time(scal.num_nodes, scal.num_replicas, scal.local_bsz)
    assert np.mean(np.abs(pred / scal.step_time - 1)) < 0.2


@pytest.mark.filterwarnings("error")
def test_goodput_outside_its_domain_does_not_warn():
    """Issue 16 item 6: zero GPUs or a zero batch (cluster runs evaluate such rows, then mask them) used to
    print numpy divide-by-zero RuntimeWarnings; the values are unchanged (IEEE arithmetic: nan here)."""
    model = ThroughputModel(0.0, 0.1)
    fn = GoodputFunction(model, 0.0, 4)
    gpus, b = np.array([0.0, 1.0, 2.0, 1.0]), np.array([8.0, 8.0, 8.0, 0.0])
    got = fn.evaluate(1, gpus, b)
    m, t_iter = gpus * b, 0.1 * b
    with np.errstate(divide="ignore", invalid="ignore"):
        want = (m / t_iter) * (1.0 - (m - 4.0) / (0.0 + m))
    np.testing.assert_array_equal(got, want)
    assert math.isnan(got[0]) and math.isnan(got[3])          # 0 samples/s × E(0) = 0·inf; 0/0 samples/s
    assert got[2] == pytest.approx(16 / 0.8 * (1 - 12 / 16))
    assert math.isnan(float(fn.evaluate(1, 0, 8))) and math.isnan(float(gp.goodput(model, 0.0, 4, 1, 1, 0)))


def test_goodput_default_is_no_accumulation_and_speedup_table_checks_both_sizes():
    """goodput() without accum_steps is one micro-batch per step (s = 0, M = K b): the same value as s = 0
    given, not that of s = 1 (M = 2 K b). speedup_table refuses max_nodes < 1 and gpus_per_node < 1 each
    on its own, naming both values."""
    default = float(gp.goodput(TRUE, 10.0, 128, 1, 2, 64))
    assert default == float(gp.goodput(TRUE, 10.0, 128, 1, 2, 64, 0))
    assert default != pytest.approx(float(gp.goodput(TRUE, 10.0, 128, 1, 2, 64, 1)), rel=1e-3)
    fn = GoodputFunction(TRUE, 10.0, 128)
    for args in ((0, 4), (1, 0), (0, 0)):
        with pytest.raises(ValueError, match=rf"need max_nodes >= 1 and gpus_per_node >= 1, got {args[0]}, "
                                             rf"{args[1]}"):
            fn.speedup_table(*args, max_batch=512)


@pytest.mark.parametrize("observations, message", [
    ([], "empty set of observations"),
    ("abc", "observations must be rows .* got str 'abc'"),
    (7, "observations must be rows .* got int 7"),
    ([(1, 1, 32, 0, 0.1), (1, 1, 32, 0)],
     r"observation 1 must be a row of 5 or 6 numbers .* got \(1, 1, 32, 0\)"),
    ([(1, 1, 32, 0, 0.1), 0.2], "observation 1 must be a row of 5 or 6 numbers .* got 0.2"),
    ([(1, 1, 32, 0, -0.1)], r"observation 0 has a bad iter_time = -0.1"),
    ([(2, 1, 32, 0, 0.1)], "observation 0 has a bad gpus = 1.0"),
    ([(1, 1, 32, 0, 0.1, 0.2)], "observation 0 has a bad sync_time = 0.2"),
])
def test_fit_names_the_bad_observation(observations, message):
    with pytest.raises(ValueError, match=message):
        fit_throughput_model(observations)


def test_fit_names_the_missing_dataframe_columns():
    import pandas as pd
    df = pd.DataFrame({"nodes": [1], "gpus": [1], "per_gpu_batch": [32], "iter_time": [0.1]})
    with pytest.raises(ValueError, match=r"lack columns \['accum_steps'\]"):
        fit_throughput_model(df)
