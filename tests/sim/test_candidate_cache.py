"""GoodputFunction.optimize caches its candidate grid (it does not depend on theta_sys or phi; issue 19: the
simulator asks for the same allocations again and again): a cached grid gives what a fresh one gives."""
import numpy as np
import pytest

from elasticlab.goodput import GoodputFunction, ThroughputModel
from elasticlab.goodput import function as fn

MODEL = ThroughputModel(0.05, 0.002, 0.01, 0.001, 0.05, 0.005, 1.5)
KW = dict(max_batch=2048, min_per_gpu_batch=16, max_per_gpu_batch=256)


def fresh(f, nodes, gpus, **kw):
    saved = dict(fn._CANDIDATE_CACHE)
    fn._CANDIDATE_CACHE.clear()
    try:
        return f.optimize(nodes, gpus, **kw)
    finally:
        fn._CANDIDATE_CACHE.clear()
        fn._CANDIDATE_CACHE.update(saved)


def test_cached_grid_serves_other_statistics_exactly():
    fn._CANDIDATE_CACHE.clear()
    nodes, gpus = np.array([1.0, 1.0, 2.0, 3.0]), np.array([1.0, 4.0, 8.0, 12.0])
    a = GoodputFunction(MODEL, (1.0, 0.5), 64)
    b = GoodputFunction(MODEL, (1.0, 50.0), 64)
    a.optimize(nodes, gpus, **KW)
    size = len(fn._CANDIDATE_CACHE)
    got = b.optimize(nodes, gpus, **KW)  # served from the grid a built
    assert len(fn._CANDIDATE_CACHE) == size
    want = fresh(b, nodes, gpus, **KW)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(got[1], a.optimize(nodes, gpus, **KW)[1])  # phi matters: a real test


def test_caller_mutating_its_array_does_not_corrupt_the_cache():
    fn._CANDIDATE_CACHE.clear()
    f = GoodputFunction(MODEL, (1.0, 5.0), 64)
    nodes, gpus = np.array([1.0, 2.0]), np.array([4.0, 8.0])
    first = f.optimize(nodes, gpus, **KW)
    nodes[1] = 1.0  # the caller reuses its array: another allocation, another grid
    got = f.optimize(nodes, gpus, **KW)
    want = fresh(f, np.array([1.0, 1.0]), gpus, **KW)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    again = f.optimize(np.array([1.0, 2.0]), gpus, **KW)
    for x, y in zip(again, first):
        np.testing.assert_array_equal(x, y)


def test_other_keywords_are_other_grids_and_bad_input_still_raises():
    fn._CANDIDATE_CACHE.clear()
    f = GoodputFunction(MODEL, (1.0, 5.0), 64)
    g1 = f.optimize(1, 4, **KW)
    g2 = f.optimize(1, 4, **{**KW, "max_per_gpu_batch": 32})
    assert g1 != g2 and g2 == fresh(f, 1, 4, **{**KW, "max_per_gpu_batch": 32})
    assert isinstance(g1[0], float) and isinstance(g1[1], int)  # scalars in, scalars out from the cache too
    for _ in range(2):  # the second call is not served a cached grid either
        with pytest.raises(ValueError, match="nodes and gpus must be >= 0"):
            f.optimize(-1, 4, **KW)
        with pytest.raises(ValueError, match="batch_range must be a pair"):
            f.optimize(1, 4, batch_range=[[64, 128]])


def test_throughput_memo_per_model_serves_other_models_and_phis_exactly():
    """A cached grid also keeps THROUGHPUT and M per throughput model (phi does not enter them): other
    models and other statistics on that grid give what a fresh grid gives, bit for bit, and the kept
    arrays cannot be written through."""
    fn._CANDIDATE_CACHE.clear()
    nodes, gpus = np.array([1.0, 2.0, 2.0]), np.array([2.0, 4.0, 8.0])
    other = ThroughputModel(0.02, 0.004, 0.03, 0.002, 0.08, 0.01, 2.0)
    calls = [(m, s) for m in (MODEL, other, MODEL) for s in ((1.0, 0.5), (1.0, 80.0))]
    for m, stats in calls:
        f = GoodputFunction(m, stats, 64)
        got, want = f.optimize(nodes, gpus, **KW), fresh(f, nodes, gpus, **KW)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    (cands,) = [c for c in fn._CANDIDATE_CACHE.values() if c.shape == (3,)]
    assert set(cands.by_model) == {MODEL, other}
    thr, batch = cands.by_model[MODEL]
    with pytest.raises(ValueError):
        thr[0, 0] = 0.0
    np.testing.assert_array_equal(thr, MODEL.throughput(cands.nodes, cands.gpus, cands.per_gpu, cands.steps))
