"""Saxena et al.'s setting (P1-T3, P1-T4) on a short horizon."""
import numpy as np
import pytest

from elasticlab.sim.experiments import saxena_null, saxena_sweep
from elasticlab.sim.synthetic import best_throughput, simulate_synthetic, synthetic_jobs


def test_best_throughput_table():
    jobs = synthetic_jobs(n_jobs=5, seed=1)
    fixed = best_throughput(jobs, 8, elastic=False)
    el = best_throughput(jobs, 8, elastic=True)
    assert fixed.shape == (5, 9) and np.all(el >= fixed)  # the user batch is among the elastic choices
    need = jobs.b_user / jobs.mem
    for j in range(5):  # the fixed batch needs ceil(b/mem) GPUs
        assert np.all(np.isinf(fixed[j, 1:int(need[j])]))
        assert np.isfinite(el[j, 1])


def test_elastic_completes_more_jobs():
    df = saxena_sweep(interarrivals=(90.0,), horizon=3 * 3600.0, capacity=16)
    assert (df.completed_ratio > 1).all()
    drop = df[df.admission == "drop"].iloc[0]
    assert drop.dropped_elastic < drop.dropped_fixed


def test_null_result_when_batch_is_fixed():
    df = saxena_null(interarrivals=(90.0,), horizon=2 * 3600.0, capacity=16)
    assert (df.completed_elastic == df.completed_fixed).all()
    assert np.allclose(df.avg_jct_elastic, df.avg_jct_fixed)


def test_bad_arguments():
    with pytest.raises(ValueError, match="admission"):
        simulate_synthetic(synthetic_jobs(n_jobs=2), 4, admission="maybe")
    with pytest.raises(ValueError, match="mean_interarrival"):
        synthetic_jobs(mean_interarrival=0)
