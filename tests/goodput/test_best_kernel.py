"""The compiled best-candidate kernel (goodput/_best.py, issue 19) gives bit for bit what its numpy reference
(function._best_numpy: efficiency, product, mask, np.argmax, clamp) gives, and the agent keeps its
GoodputFunction only while its inputs are the same."""
import math

import numpy as np
import pytest

from elasticlab.goodput import GoodputFunction, ThroughputModel
from elasticlab.goodput import function as fn
from elasticlab.goodput._best import best_candidate, best_candidates
from elasticlab.goodput.agent import BatchLimits, GoodputAgent

MODEL = ThroughputModel(0.05, 0.002, 0.01, 0.001, 0.05, 0.005, 1.5)


def both(thr, batch, per_gpu, steps, ok, phi, m0):
    got = best_candidates(thr, batch, per_gpu, steps, ok, phi, m0)
    want = fn._best_numpy(thr.copy(), batch, per_gpu, steps, ok, phi, m0)
    for i in range(len(thr)):  # the one-row kernel: the same numbers as plain scalars
        row = (a[i:i + 1] for a in (thr, batch, per_gpu, steps, ok))
        g, b, s = best_candidate(*row, phi, m0)
        assert type(g) is float and type(b) is type(s) is int
        assert np.float64(g).view(np.int64) == want[0][i:i + 1].view(np.int64)[0]
        assert (b, s) == (want[1][i], want[2][i])
    return got, want


def assert_same_bits(got, want):
    g, b, s = got
    wg, wb, ws = want
    assert g.dtype == wg.dtype == np.float64 and b.dtype == wb.dtype == s.dtype == ws.dtype == np.int64
    np.testing.assert_array_equal(g.view(np.int64), wg.view(np.int64))  # every bit, signed zeros too
    np.testing.assert_array_equal(b, wb)
    np.testing.assert_array_equal(s, ws)


@pytest.mark.parametrize("phi", [0.0, 0.37, 64.0, 5e3, 1e300, math.inf])
def test_kernel_equals_numpy_on_random_grids(phi):
    rng = np.random.default_rng(7)
    for _ in range(20):
        rows, cols = rng.integers(1, 9), rng.integers(1, 120)
        thr = rng.uniform(0, 1e4, (rows, cols))
        batch = rng.uniform(32, 1e5, (rows, cols))
        per_gpu = np.ceil(rng.uniform(1, 512, (rows, cols)))
        steps = rng.integers(0, 8, (rows, cols)).astype(float)
        ok = rng.random((rows, cols)) < 0.7
        ok[0] = False  # a row with no feasible candidate: (0, 0, 0)
        assert_same_bits(*both(thr, batch, per_gpu, steps, ok, phi, 32.0))


def test_kernel_ties_nan_and_inf_follow_argmax():
    thr = np.array([[1.0, 3.0, 3.0, 2.0],  # a tie: the first maximum
                    [1.0, np.nan, 5.0, np.nan],  # a NaN wins (np.argmax), is not finite: (0, 0, 0)
                    [np.nan, 1.0, 2.0, 3.0],
                    [np.inf, 1.0, 2.0, 3.0],  # an infinite best is not feasible either
                    [1.0, 2.0, 3.0, 4.0]])
    batch = np.full(thr.shape, 64.0)
    per_gpu = np.tile([8.0, 16.0, 32.0, 64.0], (5, 1))
    steps = np.tile([0.0, 1.0, 2.0, 3.0], (5, 1))
    ok = np.ones(thr.shape, dtype=bool)
    ok[4, 3] = False  # masked: the best feasible is the third
    got, want = both(thr, batch, per_gpu, steps, ok, 100.0, 32.0)
    assert_same_bits(got, want)
    assert got[1].tolist() == [16, 0, 0, 0, 32] and got[2].tolist() == [1, 0, 0, 0, 2]
    # M = 0 with phi = 0 (0 / 0): nan, as IEEE arithmetic gives, no exception
    zero = np.zeros((1, 2))
    assert_same_bits(*both(np.ones((1, 2)), zero, np.ones((1, 2)), zero, np.ones((1, 2), bool), 0.0, 0.0))


def test_optimize_is_the_numpy_reference_on_its_cached_grid():
    f = GoodputFunction(MODEL, (1.0, 5.0), 64)
    kw = dict(max_batch=4096, min_per_gpu_batch=8, max_per_gpu_batch=256)
    nodes = np.array([1.0, 1.0, 2.0, 2.0, 3.0, 0.0])
    gpus = np.array([1.0, 4.0, 5.0, 8.0, 12.0, 0.0])
    got = f.optimize(nodes, gpus, **kw)
    c = fn._CANDIDATE_CACHE[fn._optimize_key(64.0, nodes, gpus, {**dict(
        max_batch=None, batch_range=None, max_per_gpu_batch=None, min_per_gpu_batch=1, max_accum=None,
        accumulation=True, num_candidates=50, force_accum_single_gpu=True, max_batch_size=None,
        atomic_bsz_range=None), **kw})]
    thr, m = fn._throughput_parts(MODEL, c.nodes, c.gpus, c.per_gpu, c.steps)
    assert_same_bits(got, fn._best_numpy(thr, m, c.per_gpu, c.steps, c.ok, f.phi, 64.0))
    assert got[1][-1] == 0 and got[1][0] > 0  # zero GPUs: no choice; the rest: a real one
    one = f.optimize(2, 8, **kw)
    assert type(one[0]) is float and type(one[1]) is int and type(one[2]) is int
    assert one == (float(got[0][3]), int(got[1][3]), int(got[2][3]))


class Estimator:
    """A GNS estimator whose statistics change in place."""

    def __init__(self, phi):
        self.b_simple = phi


def test_agent_keeps_its_function_only_for_the_same_inputs():
    a = GoodputAgent(BatchLimits(32, 1024, (4, 64)), MODEL, (1.0, 0.5))
    f = a.function()
    assert a.function() is f and a.function("goodput").phi == pytest.approx(16.0)
    a.grad_stats = (1.0, 5.0)
    assert a.function() is not f and a.function().phi == pytest.approx(160.0)
    assert a.function("throughput").phi == math.inf and a.function().phi == pytest.approx(160.0)
    a.model = ThroughputModel(0.05, 0.002)
    assert a.function().model is a.model
    est = Estimator(10.0)
    a.grad_stats = est
    assert a.function().phi == 10.0
    est.b_simple = 20.0  # an object may change in place: never served a kept function
    assert a.function().phi == 20.0
    a.grad_stats = (1.0, float("nan"))
    for _ in range(2):
        with pytest.raises(ValueError, match="NaN"):
            a.function()
