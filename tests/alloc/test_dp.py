"""dp_allocate equals brute force (Saxena et al. DP, P1-T1), with bounds and -inf, and rejects bad input."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticlab.alloc import allocation_value, dp_allocate, dp_allocate_reference, is_concave_row


def brute_force(u, capacity, lo, hi):
    J = u.shape[0]
    best, arg = -np.inf, None
    ranges = [range(lo[j], min(hi[j], u.shape[1] - 1, capacity) + 1) for j in range(J)]
    for combo in itertools.product(*ranges):
        if sum(combo) > capacity:
            continue
        v = sum(u[j, g] for j, g in enumerate(combo))
        if v > best:
            best, arg = v, combo
    return best, arg


@st.composite
def instances(draw):
    J = draw(st.integers(1, 4))
    K = draw(st.integers(0, 8))
    W = draw(st.integers(1, K + 1))
    concave = draw(st.booleans())
    vals = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
    u = np.array(draw(st.lists(st.lists(vals, min_size=W, max_size=W), min_size=J, max_size=J)))
    if concave:  # cumulative sums of decreasing gains: concave rows (greedy path)
        u = np.cumsum(-np.sort(-u, axis=1), axis=1)
    mask = np.array(draw(st.lists(st.lists(st.booleans(), min_size=W, max_size=W), min_size=J, max_size=J)))
    if draw(st.booleans()):
        u = np.where(mask & (np.arange(W) > 0) if concave else mask, -np.inf, u)
    lo = np.array(draw(st.lists(st.integers(0, 3), min_size=J, max_size=J)))
    hi = lo + np.array(draw(st.lists(st.integers(0, K + 1), min_size=J, max_size=J)))
    use_bounds = draw(st.booleans())
    return u, K, (lo if use_bounds else None), (hi if use_bounds else None)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_dp_equals_brute_force(inst):
    u, K, lo, hi = inst
    J = u.shape[0]
    lo_ = np.zeros(J, int) if lo is None else lo
    hi_ = np.full(J, K) if hi is None else hi
    best, _ = brute_force(u, K, lo_, np.minimum(hi_, K))
    for solver in (dp_allocate, lambda *a: dp_allocate(*a, method="dp"), dp_allocate_reference):
        if best == -np.inf:
            with pytest.raises(ValueError):
                solver(u, K, lo, hi)
            continue
        alloc = solver(u, K, lo, hi)
        assert alloc.dtype == np.int64 and alloc.shape == (J,)
        assert alloc.sum() <= K
        assert np.all(alloc >= lo_) and np.all(alloc <= hi_)
        assert np.all(np.isfinite(u[np.arange(J), alloc]))
        assert allocation_value(u, alloc) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_concave_greedy_matches_dp_on_large_instance():
    rng = np.random.default_rng(1)
    J, K = 200, 256
    g = np.arange(K + 1)
    c = rng.uniform(0.01, 0.3, (J, 1))
    u = rng.uniform(0.5, 2, (J, 1)) * g / (1 + c * np.maximum(g - 1, 0))
    u = np.where(g <= 32, u, -np.inf)
    assert all(is_concave_row(r) for r in u)
    # references sharing no code with the compiled DP: for concave rows, the greedy by marginal gains written
    # here; for any rows, dp_allocate_reference (pure Python)
    gains = np.diff(np.where(np.isfinite(u), u, -1e300), axis=1)
    best = np.sort(gains[gains > 0])[::-1][:K].sum() + u[:, 0].sum()
    for method in ("auto", "dp"):
        a = dp_allocate(u, K, method=method)
        assert a.sum() <= K and allocation_value(u, a) == pytest.approx(best, rel=1e-12), method
    # mixed: half of the rows made non-concave (a node-boundary penalty)
    u2 = u.copy()
    u2[::2] = u2[::2] / (1 + 0.4 * (g > 4))
    assert not is_concave_row(u2[0])
    ref = allocation_value(u2, dp_allocate_reference(u2, K))
    for method in ("auto", "dp"):
        a = dp_allocate(u2, K, method=method)
        assert a.sum() <= K and allocation_value(u2, a) == pytest.approx(ref, rel=1e-12), method


def test_min_gpus_forces_allocation_and_infeasible_is_error():
    u = np.array([[0.0, 1.0, 1.5], [0.0, 5.0, 6.0]])
    assert list(dp_allocate(u, 2)) == [0, 2] or allocation_value(u, dp_allocate(u, 2)) == 6.0
    assert list(dp_allocate(u, 2, min_gpus=[1, 1])) == [1, 1]
    with pytest.raises(ValueError, match="infeasible"):
        dp_allocate(u, 1, min_gpus=[1, 1])
    with pytest.raises(ValueError, match="infeasible"):
        dp_allocate(np.full((2, 3), -np.inf), 2)


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.array([[0.0, np.nan]]), 1), "NaN"),
        ((np.array([[0.0, np.inf]]), 1), r"\+inf"),
        ((np.zeros(3), 2), "shape"),
        ((np.zeros((2, 3)), -1), "capacity"),
        ((np.zeros((2, 3)), 1.5), "capacity"),
        ((np.zeros((2, 3)), 2, [1, 2, 3]), "min_gpus"),
        ((np.zeros((2, 3)), 2, [-1, 0]), "min_gpus"),
        ((np.zeros((2, 3)), 2, None, [0.5, 1]), "max_gpus"),
    ],
)
def test_bad_input_is_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        dp_allocate(*args)


def test_empty_and_narrow_tables():
    assert dp_allocate(np.zeros((0, 5)), 4).shape == (0,)
    # a table narrower than capacity+1: counts beyond its width are infeasible
    u = np.array([[0.0, 1.0], [0.0, 1.0]])
    assert list(dp_allocate(u, 10)) == [1, 1]


def test_is_concave_row_reads_the_first_count():
    """A row is judged from count 0: a start-up dip at 0 -> 1 or a hole after count 0 makes it not concave."""
    assert is_concave_row([0.0, 1.0, 1.5, 1.75])
    assert not is_concave_row([0.0, 0.0, 5.0, 6.0])          # gains 0, 5, 1: increasing at the start
    assert not is_concave_row([0.0, -np.inf, 1.0, 1.5])      # feasible counts not contiguous
    assert is_concave_row([-np.inf, 0.0, 1.0, 1.5])          # infeasible at 0, concave after


@pytest.mark.parametrize("seed", range(20))
def test_greedy_plus_dp_combine_is_exact_on_mixed_tables(seed):
    """The plain path with the greedy on (what method="auto" runs when the hull-bound path finds that pruning
    does not pay): concave rows merged greedily, the others by DP, the two joined in one max-plus step. Called
    directly, on tables mixing both kinds of row at a capacity that makes them compete, it equals the
    pure-Python DP."""
    from elasticlab.alloc.dp import _solve, _validate

    rng = np.random.default_rng(seed)
    J, K = int(rng.integers(2, 7)), int(rng.integers(3, 13))
    u = rng.normal(0, 1, (J, K + 1)) + rng.uniform(0, 2) * np.arange(K + 1)   # arbitrary rows
    conc = rng.random(J) < 0.5
    conc[0], conc[-1] = True, False                                             # at least one of each
    gains = -np.sort(-rng.uniform(-0.5, 2.0, (J, K)), axis=1)
    u[conc] = np.concatenate([rng.uniform(0, 1, (J, 1)), gains], axis=1).cumsum(axis=1)[conc]
    uu, cap, lo, hi, scale = _validate(u, K, None, None)
    status, alloc = _solve(uu, lo, hi, cap, True, 1e-12 * scale)
    assert status == 0 and alloc.sum() <= K
    ref = allocation_value(u, dp_allocate_reference(u, K))
    assert allocation_value(u, alloc) == pytest.approx(ref, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_method_dp_is_the_plain_recurrence_tie_for_tie(seed):
    """method="dp" runs the plain DP for every row, the recurrence of dp_allocate_reference with the same
    tie-break (smallest count, then smallest total): on integer tables full of ties (concave rows of equal
    gains included) it returns the reference's very allocation, not just one of equal value."""
    rng = np.random.default_rng(seed)
    J, K = int(rng.integers(2, 5)), int(rng.integers(2, 9))
    gains = -np.sort(-rng.integers(0, 3, (J, K)), axis=1)                   # concave, ties everywhere
    u = np.concatenate([np.zeros((J, 1)), gains], axis=1).cumsum(axis=1).astype(float)
    assert all(is_concave_row(r) for r in u)
    assert np.array_equal(dp_allocate(u, K, method="dp"), dp_allocate_reference(u, K))
    u2 = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])                       # (2, 0), (1, 1), (0, 2) tie
    assert list(dp_allocate(u2, 2, method="dp")) == list(dp_allocate_reference(u2, 2)) == [2, 0]
