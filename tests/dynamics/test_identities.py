"""Unit tests of elasticlab.dynamics: gradients, exact identities, closed forms, linearisation, bad input."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import elasticlab.dynamics as D


def _torch_grad(net, X, Y):
    ws = [torch.tensor(w, requires_grad=True) for w in net.weights]
    bs = [torch.tensor(b, requires_grad=True) for b in net.biases] if net.has_bias else None
    h = torch.tensor(X)
    for j, w in enumerate(ws):
        h = h @ w.T + (bs[j] if bs else 0.0)
        if j < len(ws) - 1:
            h = torch.where(h > 0, h, net.slope * h)
    loss = 0.5 * ((h - torch.tensor(Y)) ** 2).sum() / X.shape[0]
    loss.backward()
    g = [w.grad.numpy().ravel() for w in ws] + ([b.grad.numpy().ravel() for b in bs] if bs else [])
    return np.concatenate(g), float(loss.detach())


@pytest.mark.parametrize("slope,bias", [(0.0, False), (0.0, True), (0.2, True), (1.0, False)])
def test_gradient_matches_autograd(slope, bias):
    """The numba backprop equals torch autograd for ReLU, leaky and linear nets, with and without biases."""
    rng = np.random.default_rng(1)
    net = D.random_init((5, 7, 6, 3), 0.7, slope=slope, biases=bias, seed=2, bias_scale=0.3)
    X, Y = rng.standard_normal((11, 5)), rng.standard_normal((11, 3))
    g, val = D.gradient(net, X, Y)
    tg, tval = _torch_grad(net, X, Y)
    assert np.allclose(g, tg, rtol=1e-12, atol=1e-14)
    assert val == pytest.approx(tval, rel=1e-13) == pytest.approx(D.loss(net, X, Y), rel=1e-13)


def test_linear_gradient_closed_form():
    """theory/01 Eq. (1.2): ∇_{W_j}L = (W_L···W_{j+1})ᵀ (W_e − Σ31)(W_{j−1}···W_1)ᵀ with whitened inputs."""
    task = D.saxe_task([3.0, 1.0, 0.5], d_in=4, d_out=3, seed=3)
    net = D.random_init((4, 5, 6, 3), 0.5, slope=1.0, seed=3)
    g, _ = D.gradient(net, task.X, task.Y)
    G = D.MLP(net.widths, 1.0, False, g).weights
    W = net.weights
    E = net.end_to_end() - task.target
    I = np.eye
    for j in range(3):
        left = I(3) if j == 2 else np.linalg.multi_dot([*W[j + 1:][::-1], I(W[j].shape[0])])
        right = I(4) if j == 0 else np.linalg.multi_dot([I(W[j].shape[1]), *W[:j][::-1]])
        assert np.allclose(G[j], left.T @ E @ right.T, atol=1e-13)


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=3, max_size=5), slope=st.sampled_from([0.0, 0.3, 1.0]),
       bias=st.booleans(), seed=st.integers(0, 10_000))
def test_neuron_identity_first_order(widths, slope, bias, seed):
    """theory/02 Eq. (2.3): ⟨W_j[i,:], G_j[i,:]⟩ + b_j[i]·g_j[i] = ⟨W_{j+1}[:,i], G_{j+1}[:,i]⟩ at any point,
    so every per-neuron invariant has zero time derivative under gradient flow."""
    rng = np.random.default_rng(seed)
    net = D.random_init(widths, 1.0, slope=slope, biases=bias, seed=seed, bias_scale=0.5)
    X, Y = rng.standard_normal((7, widths[0])), rng.standard_normal((7, widths[-1]))
    g, _ = D.gradient(net, X, Y)
    G = D.MLP(net.widths, slope, bias, g)
    for j in range(net.depth - 1):
        lhs = np.sum(net.weights[j] * G.weights[j], axis=1)
        if bias:
            lhs = lhs + net.biases[j] * G.biases[j]
        rhs = np.sum(net.weights[j + 1] * G.weights[j + 1], axis=0)
        assert np.allclose(lhs, rhs, atol=1e-12 * (1 + np.abs(lhs).max()))


@pytest.mark.parametrize("slope,bias", [(0.0, True), (1.0, False)])
def test_finite_step_change_is_exact(slope, bias):
    """theory/02 Eq. (2.6) and theory/01 Eq. (1.6): one GD step changes the invariants by exactly η² times
    the invariants of the gradient (so gradient descent breaks the symmetry only at O(η²) per step)."""
    rng = np.random.default_rng(4)
    net = D.random_init((4, 6, 5, 2), 0.8, slope=slope, biases=bias, seed=4, bias_scale=0.5 if bias else 0.0)
    if bias:                      # nonzero biases, so the b² term of (2.6) and b·g of (2.3) are exercised
        assert min(np.abs(b).min() for b in net.biases) > 0
    X, Y = rng.standard_normal((9, 4)), rng.standard_normal((9, 2))
    lr = 0.05
    tr = D.train(net, X, Y, lr, 1, record_every=1)
    g, _ = D.gradient(net, X, Y)
    before, after = D.layer_invariants(net), D.layer_invariants(tr.net)
    assert np.allclose(after - before, D.step_change(net, g, lr), rtol=1e-9, atol=1e-15)
    nb, na = D.neuron_invariants(net), D.neuron_invariants(tr.net)
    for b, a, c in zip(nb, na, D.step_change(net, g, lr, per_neuron=True)):
        assert np.allclose(a - b, c, rtol=1e-8, atol=1e-15)
    if slope == 1.0:
        Gn = D.MLP(net.widths, 1.0, False, g)
        for cb, ca, cg in zip(D.balancedness(net), D.balancedness(tr.net), D.balancedness(Gn)):
            assert np.allclose(ca - cb, lr**2 * cg, atol=1e-14)


def test_aligned_init_balanced_and_decoupled():
    """Saxe's special start: balanced (C_j = 0) and W_e = U·diag(u0)·Vᵀ for any depth and width ≥ modes."""
    task = D.saxe_task([2.0, 1.0, 0.5], d_in=4, d_out=3, seed=5)
    u0 = np.array([1e-2, 2e-2, 3e-2])
    for depth, width in ((1, None), (2, None), (3, 7), (4, 3)):
        net = D.aligned_init(task.U, task.V, u0, depth, width, seed=5)
        assert np.allclose(net.end_to_end(), (task.U * u0) @ task.V.T, atol=1e-15)
        for c in D.balancedness(net):
            assert np.abs(c).max() < 1e-14


def test_saxe_closed_forms_solve_their_ode():
    """theory/01 Eq. (1.9)-(1.11): the closed forms for N = 1, 2 agree with integrating
    τu' = N u^{2−2/N}(s−u), time_to inverts mode_strength, and s = 0 modes decay as u0/(1 + 2u0 t)."""
    from scipy.integrate import solve_ivp

    t = np.linspace(0, 8, 50)
    for n in (1, 2):
        sol = solve_ivp(lambda _t, u, n=n: n * u ** (2 - 2 / n) * (2.0 - u), (0, 8), [1e-3], t_eval=t,
                        rtol=1e-11, atol=1e-14)
        assert np.allclose(D.mode_strength(t, 2.0, 1e-3, depth=n), sol.y[0], rtol=1e-7, atol=1e-10)
    for n in (2, 3, 5):
        tf = D.time_to(1.5, 2.0, 1e-3, depth=n)
        assert D.mode_strength([tf], 2.0, 1e-3, depth=n)[0] == pytest.approx(1.5, rel=1e-6)
    # (1.11), s = 0: against the integrated ODE τu' = −2u², not against its own formula
    sol = solve_ivp(lambda _t, u: -2.0 * u**2, (0, 8), [0.5], t_eval=t, rtol=1e-11, atol=1e-14)
    assert np.allclose(D.mode_strength(t, 0.0, 0.5), sol.y[0], rtol=1e-8)
    # (1.12) and the N-layer half-times: the time the integrated ODE needs to reach s/2
    for s, u0, n in ((4.0, 1e-4, 2), (1.0, 1e-3, 2), (2.0, 1e-2, 3), (0.5, 1e-2, 4)):
        hit = lambda _t, u, s=s: u[0] - s / 2                         # noqa: E731
        hit.terminal = True
        sol = solve_ivp(lambda _t, u, s=s, n=n: n * u ** (2 - 2 / n) * (s - u), (0, 1e4), [u0], events=hit,
                        rtol=1e-11, atol=1e-14)
        assert D.half_time(s, u0, depth=n) == pytest.approx(sol.t_events[0][0], rel=1e-6)


def test_zero_mode_decay_matches_gd():
    """theory/01 Eq. (1.11): gradient descent (η = 1e-3) on a balanced aligned 2-layer net decays a mode the
    teacher lacks (s = 0) as u0/(1 + 2u0 t/τ), while the s = 1 mode follows (1.10)."""
    task = D.saxe_task([1.0, 0.0], seed=11)
    u0 = np.array([1e-2, 0.5])
    net = D.aligned_init(task.U, task.V, u0, depth=2, seed=11)
    tr = D.train(net, task.X, task.Y, 1e-3, 8000, record_every=20)
    u = D.mode_strengths(tr, task.U, task.V)
    assert u[-1, 1] < 0.15                                            # decayed from 0.5 to 0.5/(1 + 8)
    assert np.allclose(u[:, 1], D.mode_strength(tr.time, 0.0, 0.5), rtol=2e-3)
    assert np.allclose(u[:, 0], D.mode_strength(tr.time, 1.0, 1e-2), atol=2e-3)


def test_plateau_time_is_half_saxe_learning_time():
    """theory/01 §1.4: the plateau ends at the first burst's midpoint (1/2s)·ln(s/u0) ≈ t½ (1.12), half of
    Saxe's ε → s − ε time (1/s)·ln(s/ε)."""
    s, u0 = 4.0, 1e-6
    assert D.plateau_time(s, u0) == pytest.approx(np.log(s / u0) / (2 * s), rel=1e-12)
    assert D.plateau_time(s, u0) == pytest.approx(D.half_time(s, u0), rel=1e-6)
    assert D.plateau_time(s, u0) == pytest.approx(D.time_to(s - u0, s, u0) / 2, rel=1e-6)


def test_deep_saxe_matches_gd():
    """theory/01 §1.3: a depth-3 balanced aligned net follows τu' = 3u^{4/3}(s − u) mode by mode (to 1%)."""
    task = D.saxe_task([3.0, 1.0], d_in=3, seed=6)
    net = D.aligned_init(task.U, task.V, 1e-2, depth=3, width=5, seed=6)
    tr = D.train(net, task.X, task.Y, 1e-3, 15000, record_every=25)
    u = D.mode_strengths(tr, task.U, task.V)
    th = D.mode_curves(tr.time, task.s, 1e-2, depth=3)
    assert np.all(np.abs(u - th)[:, :2].max(axis=0) / task.s[:2] < 0.01)
    assert np.allclose(D.singular_values(tr)[-1, :2], [3.0, 1.0], rtol=1e-3)
    # theory/01 Eq. (1.13): every layer carries u_α^{1/N}, so ‖W_j‖²_F = Σ_α u_α^{2/N}
    assert np.allclose(tr.weight_norms, (u ** (2 / 3)).sum(axis=1)[:, None], rtol=1e-9)


def test_shallow_net_learns_every_mode_on_one_timescale():
    """theory/01 §1.3 contrast: a single-layer net approaches each mode as s + (u0 − s)e^{−t/τ}, so every mode
    reaches s/2 at t ≈ τ·ln 2 whatever its strength (deep nets: ∝ 1/s)."""
    task = D.saxe_task([4.0, 1.0, 0.25], seed=10)
    net = D.aligned_init(task.U, task.V, 1e-6, depth=1)
    tr = D.train(net, task.X, task.Y, 1e-3, 3000, record_every=1)
    u = D.mode_strengths(tr, task.U, task.V)
    assert np.allclose(D.crossing_times(tr.steps, u, task.s / 2), 1000 * np.log(2), rtol=1e-3)
    assert np.allclose(u, D.mode_curves(tr.time, task.s, 1e-6, depth=1), atol=1e-3 * task.s.max())


def test_detect_phases_on_sum_of_sigmoids():
    t = np.linspace(0, 30, 3001)
    y = sum(D.mode_strength(t, s, 1e-5) for s in (4.0, 1.0, 0.3))
    ph = D.detect_phases(t, y)
    assert ph.n_bursts == 3
    expected = [D.half_time(s, 1e-5) for s in (4.0, 1.0, 0.3)]
    assert np.allclose([b.t_peak for b in ph.bursts], expected, rtol=0.1)
    assert ph.plateau_end < ph.bursts[0].t_start + 1 and ph.saturation_start > ph.bursts[-1].t_peak


def test_effective_map_is_jacobian():
    """theory/02 §2.1: W_eff(x) is the Jacobian ∂f/∂x of the ReLU net (piecewise linear), for every x."""
    net = D.random_init((4, 8, 8, 2), 1.0, slope=0.0, biases=True, seed=7, bias_scale=0.5)
    X = np.random.default_rng(7).standard_normal((6, 4))
    weff, beff = D.effective_maps(net, X)
    ws = [torch.tensor(w) for w in net.weights]
    bs = [torch.tensor(b) for b in net.biases]

    def f(x):
        h = x
        for j in range(3):
            h = ws[j] @ h + bs[j]
            if j < 2:
                h = torch.relu(h)
        return h

    for n in range(6):
        jac = torch.autograd.functional.jacobian(f, torch.tensor(X[n])).numpy()
        assert np.allclose(weff[n], jac, atol=1e-13)
    assert np.allclose(D.linearised_forward(net, X), net.forward(X), atol=1e-13)
    masks = D.activation_masks(net, X)
    assert [m.shape for m in masks] == [(6, 8), (6, 8)] and set(np.unique(masks[0])) <= {0.0, 1.0}


def test_bias_free_relu_is_homogeneous():
    """Without biases b_eff = 0 and f(x) = W_eff(x)·x; f(cx) = c·f(x) for c > 0."""
    net = D.random_init((3, 5, 2), 1.0, slope=0.0, seed=8)
    X = np.random.default_rng(8).standard_normal((4, 3))
    weff, beff = D.effective_maps(net, X)
    assert np.all(beff == 0)
    assert np.allclose(net.forward(2.5 * X), 2.5 * net.forward(X))


def test_trajectory_records_and_divergence():
    task = D.saxe_task([1.0, 0.5], seed=9)
    net = D.random_init((2, 2, 2), 0.1, slope=1.0, seed=9)
    tr = D.train(net, task.X, task.Y, 0.01, 105, record_every=10)
    assert list(tr.steps) == [*range(0, 101, 10), 105]
    assert tr.params.shape == (len(tr.steps), net.params.size) and not tr.diverged
    assert np.array_equal(tr.params[0], net.params) and np.array_equal(tr.params[-1], tr.net.params)
    assert list(D.record_steps(1000, points=4, log=True)) == [0, 9, 99, 1000]
    bad = D.train(net, task.X, 1e3 * task.Y, 10.0, 500, record_every=1)
    assert bad.diverged and len(bad.steps) < 501


@pytest.mark.parametrize("call,match", [
    (lambda: D.MLP((3,)), "widths"),
    (lambda: D.MLP((3, 0, 2)), "width"),
    (lambda: D.MLP((3, 2), slope=2.0), "slope"),
    (lambda: D.MLP((3, 2), params=np.zeros(5)), "params"),
    (lambda: D.random_init((3, 2), -1.0), "init scale"),
    (lambda: D.saxe_task([1.0, -2.0]), "singular values"),
    (lambda: D.saxe_task([1.0, 2.0, 3.0], d_in=2), "do not fit"),
    (lambda: D.mode_strength([1.0], 1.0, 0.0), "u0"),
    (lambda: D.mode_strength([1.0], 1.0, 0.1, depth=0), "depth"),
    (lambda: D.time_to(2.0, 1.0, 0.1), "not reachable"),
    (lambda: D.time_to(0.1, 1.0, 0.5), r"u_f=0\.1 .*u0=0\.5.*s=1\.0"),
    (lambda: D.time_to(0.1, 1.0, 0.5, depth=3), r"u_f=0\.1 .*u0=0\.5"),
    (lambda: D.time_to(4.0, 1.0, 3.0), r"u_f=4\.0 .*u0=3\.0"),
    (lambda: D.time_to(0.6, 0.0, 0.5), r"u_f=0\.6 .*u0=0\.5.*s=0\.0"),
    (lambda: D.time_to(-0.1, 0.0, 0.5), "not reachable"),
    (lambda: D.plateau_time(1.0, 2.0), r"s=1\.0, u0=2\.0"),
    (lambda: D.train(D.MLP((2, 2)), np.zeros((3, 2)), np.zeros((3, 2)), -0.1, 10), "lr"),
    (lambda: D.train(D.MLP((2, 2)), np.zeros((3, 4)), np.zeros((3, 2)), 0.1, 10), "inputs"),
    (lambda: D.train(D.MLP((2, 2)), np.zeros((3, 2)), np.zeros((4, 2)), 0.1, 10), "targets"),
    (lambda: D.detect_phases(np.arange(5.0), np.zeros(5)), "does not grow"),
    (lambda: D.aligned_init(np.eye(3), np.eye(3), 1e-3, depth=2, width=2), "width"),
    (lambda: D.MLP((2, 2), slope=0.0).end_to_end(), "linear"),
])
def test_bad_input_names_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_theory_names_existing_tests():
    """Every `tests/<folder>/test_*.py::name` cited in theory/ exists (claims stay tied to their tests)."""
    import ast
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    cited = set()
    for md in (root / "theory").glob("*.md"):
        cited |= set(re.findall(r"tests/(\w+/test_\w*\.py)::(\w+)", md.read_text()))
    assert len(cited) >= 10
    for fname, name in cited:
        tree = ast.parse((root / "tests" / fname).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"theory/ cites missing test {fname}::{name}"


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=2, max_size=5), slope=st.sampled_from([0.0, 0.1, 1.0]),
       bias=st.booleans(), seed=st.integers(0, 10_000))
def test_linearisation_exact_any_net(widths, slope, bias, seed):
    """theory/02 Eq. (2.1)-(2.2) for random ReLU, leaky and linear nets of any depth, biases or not."""
    net = D.random_init(widths, 1.0, slope=slope, biases=bias, seed=seed, bias_scale=0.5)
    X = np.random.default_rng(seed).standard_normal((5, widths[0]))
    assert D.exactness_error(net, X) < 1e-12
    if slope == 1.0 and not bias:
        weff, _ = D.effective_maps(net, X)
        assert np.allclose(weff, net.end_to_end(), atol=1e-12)


def test_deeper_is_longer_only_up_to_a_peak():
    """theory/01 §1.5: under the exact N-layer law the half-time grows with depth only up to
    N* = Λ + √(Λ² − 4Λ), Λ = ln(s/u0), and falls after it."""
    for u0 in (1e-3, 1e-4):
        lam = np.log(1.0 / u0)
        n_star = lam + np.sqrt(lam * lam - 4 * lam)
        depths = list(range(3, 41))
        ts = np.array([D.half_time(1.0, u0, depth=n) for n in depths])
        k = int(np.argmax(ts))
        assert abs(depths[k] - n_star) <= 1.0, (u0, depths[k], n_star)
        assert (np.diff(ts[:k + 1]) > 0).all() and (np.diff(ts[k:]) < 0).all()


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=3, max_size=5), slope=st.sampled_from([0.0, 0.1, 1.0]),
       seed=st.integers(0, 10_000))
def test_common_growth_rate_any_net(widths, slope, seed):
    """theory/03 Eq. (3.1): for bias-free linear, ReLU and leaky nets, every layer's flow rate
    −2⟨W_j, ∇_{W_j}L⟩ equals r = (2/n)Σ⟨y − f, f⟩ at any point. With biases it does not (checked too)."""
    from elasticlab.dynamics import general as G

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((7, widths[0]))
    Y = rng.standard_normal((7, widths[-1]))
    net = D.random_init(widths, 1.0, slope=slope, seed=seed)
    rates = G.flow_rates(net, X, Y)
    r = G.common_rate(net, X, Y)
    assert np.allclose(rates, r, rtol=1e-9, atol=1e-12 * (1 + abs(r)))
    bnet = D.random_init(widths, 1.0, slope=slope, biases=True, seed=seed, bias_scale=1.0)
    rb = G.flow_rates(bnet, X, Y)
    assert np.ptp(rb) > 1e-9 or np.all(np.abs(rb) < 1e-9)


@pytest.mark.parametrize("slope,bias", [(0.0, False), (0.2, False), (0.0, True), (1.0, False)])
def test_pairwise_balancedness_rate(slope, bias):
    """theory/03 Eq. (3.6): dC_j/dt = −(M + Mᵀ), M_ik = Σ_μ(d_k − d_i)γ_i z_k, against a finite difference
    along the flow (C_j − b_jb_jᵀ with biases); zero for a linear net; entries of units with equal activity on
    every example are conserved, and the diagonal always is."""
    from elasticlab.dynamics import pockets as P
    from elasticlab.dynamics.invariants import balancedness

    rng = np.random.default_rng(3)
    X = rng.standard_normal((9, 4))
    Y = rng.standard_normal((9, 2))
    net = D.random_init((4, 5, 6, 2), 1.0, slope=slope, biases=bias, seed=1, bias_scale=0.5)
    g, _ = D.gradient(net, X, Y)
    eps = 1e-7

    def cmat(p, j):
        c = balancedness(net.weights_at(p))[j]
        if bias:
            b = net.biases_at(p)[j]
            c = c - np.outer(b, b)
        return c

    for j in (0, 1):
        fd = (cmat(net.params - eps * g, j) - cmat(net.params + eps * g, j)) / (2 * eps)
        rate = P.pairwise_rate(net, X, Y, j)
        assert np.allclose(rate, fd, rtol=1e-5, atol=1e-7)
        assert np.allclose(np.diag(rate), 0, atol=1e-12)
        _, _, ds = P.flow_state(net, X, Y)
        same = np.all(ds[j][:, :, None] == ds[j][:, None, :], axis=0)
        assert np.allclose(rate[same], 0, atol=1e-12)
        if slope == 1.0:
            assert np.allclose(rate, 0, atol=1e-12)
        else:
            assert np.abs(rate).max() > 1e-3          # units with different patterns: not conserved


def test_detect_phases_skips_shrinking_stretches():
    """A curve that grows (one burst) and later shrinks in two steps: the local maximum of the (negative)
    rate between the two drops is no burst (detect_phases crashed on it before; ReLU+bias runs do this)."""
    t = np.geomspace(1e-2, 1e2, 800)
    lt = np.log(t)
    y = 5 / (1 + np.exp(-4 * lt)) - 0.4 / (1 + np.exp(-6 * (lt - 2))) - 0.4 / (1 + np.exp(-6 * (lt - 3.2)))
    ph = D.detect_phases(t, y)
    assert ph.n_bursts == 1
    assert abs(ph.bursts[0].t_peak - 1.0) < 0.05 and ph.bursts[0].rise > 4


def test_unbalanced_mode_converges_off_balance():
    """theory/03 §3.1, perturbation around the aligned solution: an aligned but unbalanced two-layer start
    (per mode b² − a² = c ≠ 0) converges to a² = (√(c² + 4s²) − c)/2, b² = a² + c — off the balanced √s by
    first order in c — and a² + b² − 2s = √(c² + 4s²) − 2s is second order."""
    task = D.saxe_task((3.0, 1.0), seed=4)
    a0, b0 = np.array([0.1, 0.05]), np.array([0.3, 0.2])
    W1 = (task.V * a0).T                                  # hidden basis = modes
    W2 = task.U * b0
    net = D.MLP.from_weights([W1, W2], slope=1.0)
    tr = D.train(net, task.X, task.Y, 1e-3, 40000, record_every=40000)
    w1, w2 = tr.weights[0][-1], tr.weights[1][-1]
    a2 = np.sum((w1 @ task.V) ** 2, axis=0)
    b2 = np.sum((task.U.T @ w2) ** 2, axis=1)
    c = b0 ** 2 - a0 ** 2
    s = task.s
    pred = (np.sqrt(c ** 2 + 4 * s ** 2) - c) / 2
    assert np.allclose(a2, pred, rtol=1e-3)
    assert np.allclose(b2, pred + c, rtol=1e-3)
    assert np.all(np.abs(a2 - s) > 0.3 * c)               # first order off balance: a² ≈ s − c/2
    assert np.allclose(a2 + b2 - 2 * s, np.sqrt(c ** 2 + 4 * s ** 2) - 2 * s, atol=1e-4)
