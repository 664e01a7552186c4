"""The allocator's hull-bound path on non-concave tables (issue 19): exact against the plain DP."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticlab.alloc import allocation_value, dp_allocate, is_concave_row


def node_boundary_table(rng, J, K, max_per_job, gpn=4):
    """Speedups concave within a node count, dropping at node boundaries (what placement produces), with
    a random cap and random infeasible counts in some rows."""
    g = np.arange(K + 1)
    c = rng.uniform(0.01, 0.4, (J, 1))
    w = rng.uniform(0.2, 3.0, (J, 1))
    drop = rng.uniform(0.0, 0.5, (J, 1))
    nodes = np.ceil(g / gpn)
    u = w * g / (1 + c * np.maximum(g - 1, 0)) / (1 + drop * np.maximum(nodes - 1, 0))
    u = u - rng.uniform(0, 0.3, (J, 1)) * (g > 0)  # a start-up cost: some rows not concave at 0 -> 1
    cap = rng.integers(1, max_per_job + 1, J)
    u = np.where(g[None, :] <= cap[:, None], u, -np.inf)
    holes = (rng.random((J, K + 1)) < 0.05) & (g > 1)
    return np.where(holes, -np.inf, u)


@pytest.mark.parametrize("seed", range(12))
def test_nonconcave_bound_path_equals_plain_dp(seed):
    """Issue 19: the hull-bound path (non-concave rows) is exact: the same objective as the plain DP on
    random node-boundary tables, with and without per-job minima, at loose and tight capacities."""
    rng = np.random.default_rng(seed)
    J = int(rng.integers(2, 60))
    K = int(rng.integers(4, 200))
    u = node_boundary_table(rng, J, K, max_per_job=int(rng.integers(2, 33)), gpn=int(rng.choice([2, 4, 8])))
    assert not all(is_concave_row(r) for r in u)
    lo = (rng.random(J) < 0.3).astype(int) if seed % 2 else None
    for cap in (K, max(K // 4, 1)):
        try:
            b = dp_allocate(u, cap, lo, method="dp")
        except ValueError:
            with pytest.raises(ValueError, match="infeasible"):
                dp_allocate(u, cap, lo)
            continue
        a = dp_allocate(u, cap, lo)
        assert a.sum() <= cap and np.all(np.isfinite(u[np.arange(J), a]))
        assert allocation_value(u, a) == pytest.approx(allocation_value(u, b), rel=1e-12, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(0, 40))
def test_nonconcave_random_rows_equal_plain_dp(seed, J, K):
    """Arbitrary (not even piecewise concave) rows with -inf holes: the bound path equals the plain DP."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0, 1, (J, K + 1)) + rng.uniform(0, 3) * np.sqrt(np.arange(K + 1))
    u = np.where(rng.random((J, K + 1)) < 0.2, -np.inf, u)
    try:
        b = dp_allocate(u, K, method="dp")
    except ValueError:
        with pytest.raises(ValueError):
            dp_allocate(u, K)
        return
    a = dp_allocate(u, K)
    assert a.sum() <= K
    assert allocation_value(u, a) == pytest.approx(allocation_value(u, b), rel=1e-12, abs=1e-12)


def test_bound_path_prunes_node_boundary_tables():
    """The pruned DP itself (not the fallback to the plain DP) solves the bench's node-boundary table and
    returns the plain DP's optimum."""
    from elasticlab.alloc.dp import _solve_bound, _validate

    rng = np.random.default_rng(3)
    u = node_boundary_table(rng, 300, 512, max_per_job=64)
    uu, cap, lo, hi, scale = _validate(u, 512, None, None)
    status, alloc = _solve_bound(uu, lo, hi, min(cap, int(hi.sum())), 1e-12 * scale, 10**6)
    assert status == 0
    b = dp_allocate(u, 512, method="dp")
    assert allocation_value(u, alloc) == pytest.approx(allocation_value(u, b), rel=1e-12)


def test_bound_path_keeps_the_optimum_when_the_bounds_meet_at_zero():
    """UB = LB = 0 (every job best left at 0 GPUs; more GPUs only cost, non-concavely): the reduced cost of
    each job's optimal count is exactly the gap, so the gap's tolerance must widen it. The pruned DP fixes
    every job at 0 and solves the table itself (status 0), with no fallback to the plain DP."""
    from elasticlab.alloc.dp import _solve_bound, _validate

    u = np.tile([0.0, -1.0, -1.0, -0.5], (6, 1))
    assert not is_concave_row(u[0])
    uu, cap, lo, hi, scale = _validate(u, 8, None, None)
    status, alloc = _solve_bound(uu, lo, hi, min(cap, int(hi.sum())), 1e-12 * scale, 10**6)
    assert status == 0 and list(alloc) == [0] * 6
    assert list(dp_allocate(u, 8)) == [0] * 6
