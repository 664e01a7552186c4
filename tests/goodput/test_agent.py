"""The job-side model shared by the simulator, the live cluster and the elastic job (goodput/agent.py)."""
import numpy as np
import pytest

from elasticlab.goodput import GoodputFunction, ThroughputModel
from elasticlab.goodput.agent import BatchLimits, GoodputAgent

MODEL = ThroughputModel(0.01, 0.001, 0.005, 0.0005, 0.01, 0.001, 1.0)


def agent(phi=500.0, profiled=4, **kw):
    a = GoodputAgent(BatchLimits(32, 1024, (4, 64), **kw), MODEL, phi)
    a.observe(profiled)
    return a


def test_limits_reject_bad_values_and_split():
    with pytest.raises(ValueError, match="max=16"):
        BatchLimits(32, 16)
    with pytest.raises(ValueError, match=r"\(8, 4\)"):
        BatchLimits(32, 64, (8, 4))
    lim = BatchLimits(32, 1024, (4, 8))
    assert lim.split(32, 2) == (8, 1)  # 16 per GPU over a cap of 8: two micro-steps of 8
    assert lim.split(30, 4) == (8, 0)
    for batch in range(1, 200, 7):
        for g in (1, 2, 3, 5):
            b, s = lim.split(batch, g)
            assert b <= 8 and g * b * (s + 1) >= batch and (s == 0 or g * 8 * s < batch)


def test_best_batch_is_the_goodput_argmax_over_feasible_configurations():
    a = agent()
    fn = GoodputFunction(MODEL, 500.0, 32)
    for g in (1, 2, 4):
        c = a.best_batch(g, 1, "goodput")
        assert c.global_batch == g * c.per_gpu * (c.accum + 1) <= 1024 and 4 <= c.per_gpu <= 64
        grid = [(b, s) for b in range(4, 65) for s in range(0, 8) if 32 <= g * b * (s + 1) <= 1024
                and (g > 1 or g * b * (s + 1) <= 32 or s >= 1)]
        brute = max(float(fn.evaluate(1, g, b, s)) for b, s in grid)
        assert c.goodput == pytest.approx(float(fn.evaluate(1, g, c.per_gpu, c.accum)))
        assert c.goodput >= 0.97 * brute  # a 50-point geometric grid of batches, not every integer


def test_noise_scale_moves_the_batch_and_throughput_mode_ignores_it():
    big, small = agent(phi=5000.0).best_batch(4), agent(phi=1.0).best_batch(4)
    assert big.global_batch > small.global_batch
    thr = [agent(phi=p).best_batch(4, mode="throughput") for p in (1.0, 5000.0)]
    assert thr[0] == thr[1]


def test_hysteresis_keeps_current_unless_clearly_better():
    a = agent(phi=5000.0)
    best = a.best_batch(2)
    near = (best.per_gpu - 1, best.accum)  # almost as good
    kept = a.best_batch(2, current=near, hysteresis=1.05)
    assert (kept.per_gpu, kept.accum) == near
    far = (4, 0)  # M = 8 < M0 would never be chosen; it is far worse
    assert a.best_batch(2, current=far, hysteresis=1.05)[:2] == best[:2]
    assert a.best_batch(2, current=near, hysteresis=1.0)[:2] == best[:2]


def test_before_a_model_or_a_run_the_batch_is_split_and_curves_are_linear():
    a = GoodputAgent(BatchLimits(32, 1024, (4, 64)))
    assert a.best_batch(16, mode="goodput") == (4, 0, 0.0, 64)  # M0 raised to the per-GPU minimum on each
    assert a.best_batch(4, mode="fixed", fixed_batch=256)[:2] == (64, 0)
    np.testing.assert_array_equal(a.goodput_curve(6, 4, upto=3, prior_rate=0.5), [0, 0.5, 1.0, 1.5, 0, 0, 0])
    np.testing.assert_array_equal(a.speedup_curve(5, 4, upto=2), [0, 1, 2, 0, 0, 0])
    b = GoodputAgent(BatchLimits(32, 1024, (4, 64)), MODEL, 500.0)  # a model, but the job has not run
    good = b.goodput_curve(4, 4)
    assert good[1] > 0 and np.allclose(good[1:], np.arange(1, 5) * good[1])
    assert b.best_batch(2) == (16, 0, 0.0, 32)  # no exploration of batches before a run


def test_curves_match_the_goodput_function_and_fixed_splits_below_minimum_are_zero():
    a = agent()
    good = a.goodput_curve(8, 4, "goodput")
    fn = GoodputFunction(MODEL, 500.0, 32)
    for g in (1, 3, 5, 8):  # nodes = ceil(g / 4)
        _, b, s = a.optimize(np.ceil(g / 4), g)
        assert good[g] == pytest.approx(float(fn.evaluate(np.ceil(g / 4), g, b, s)) / 32)
    fixed = a.goodput_curve(16, 4, "fixed", fixed_batch=40)
    assert fixed[8] > 0 and fixed[10] > 0  # 5 and 4 per GPU: within (4, 64)
    assert fixed[14] == 0.0 and fixed[16] == 0.0  # 3 per GPU: below the per-GPU minimum
    sp = a.speedup_curve(8, 4)
    assert sp[1] == pytest.approx(1.0) and np.allclose(sp, good / good[1])
    assert a.exploration_limit(64) == 8 and a.exploration_limit(5) == 5


def test_the_three_users_share_one_choice():
    from elasticlab.elastic.policies import BatchConfig, GoodputAdaptive

    pol = GoodputAdaptive(base_batch=32, max_batch=1024, per_worker_range=(4, 64))
    got = pol.decide(4, {"throughput_model": MODEL, "gns": 500.0})
    c = agent().best_batch(4)
    assert got == BatchConfig(max(32, c.global_batch), c.accum)
    # with the current batch nearly as good, the policy keeps it (the agent's hysteresis)
    near = BatchConfig(4 * (c.per_gpu - 1) * (c.accum + 1), c.accum)
    assert pol.decide(4, {"throughput_model": MODEL, "gns": 500.0, "current": near}) == near


def test_live_job_uses_the_fit_its_job_published(monkeypatch):
    from elasticlab.cluster.spec import JobSpec
    from elasticlab.cluster.view import LiveJob

    class Handle:
        def status(self):
            return {"world_size": 2, "gns": 400.0, "state": "running"}

        def step_times(self, aggregate=False):
            return [(1, 2, 16, 0, 0.1)] * 6

        fits_throughput = True

        def throughput_model(self):
            return MODEL

    def no_refit(rows):
        raise AssertionError("the live view refitted a job that publishes its own fit")

    monkeypatch.setattr("elasticlab.goodput.agent.fit_throughput_model", no_refit)
    spec = JobSpec("a", "examples/digits.py", initial_batch=32, max_batch=512, per_slot_batch=(4, 64))
    j = LiveJob(spec, 0.0)
    j.handle, j.state = Handle(), "running"
    j.refit()
    assert j.model is MODEL and j.max_profiled_replicas == 2 and j.agent.grad_stats == 400.0
    assert j.best_batch(2).global_batch >= 32
