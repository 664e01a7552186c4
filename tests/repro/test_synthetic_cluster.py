"""P4-T5's synthetic setting: jobs whose step times are exactly their theta_sys, phi growing tenfold,
tuned fixed configurations, and the scheduling loop."""
import numpy as np
import pytest

from elasticlab.goodput import ThroughputModel
from elasticlab.repro.synthetic_cluster import SyntheticApplication, run_policy, synthetic_jobs
from elasticlab.sim import SimJob


def test_application_is_its_theta_and_phi():
    m = ThroughputModel(alpha_grad=0.05, beta_grad=1e-3, alpha_local=0.01, beta_local=2e-3, alpha_node=0.05,
                        beta_node=1e-2, gamma=1.7)
    app = SyntheticApplication("s", m, init_batch=128, phi0=256.0, work=1e6, epochs=10)
    # phi = M0 var / sqr grows 10x from the first epoch to the last, and does not depend on the batch
    phis = [128 * app.grad_stats(b, e)[1] / app.grad_stats(b, e)[0] for e in (0, 9) for b in (128, 4096)]
    assert phis == pytest.approx([256.0, 256.0, 2560.0, 2560.0])
    # a whole iteration on 2 nodes x 4 GPUs with 3 accumulation steps costs theta_sys's T_iter
    assert app.iteration_time((4, 4), 64, 3) == pytest.approx(float(m.iter_time(2, 8, 64, 3)), rel=1e-12)
    assert app.max_progress == pytest.approx(1e6 / 128)
    assert app.progress_at(5) == pytest.approx(app.max_progress / 2)
    # a job alone on one GPU at M0 (efficiency 1) finishes at its 30 s start-up + W / throughput(1 GPU, M0)
    job = SimJob("j", app, 0.0, 1, 128, "fixed", restart_delay=30.0)
    job.reallocate((1,))
    expect = 1e6 / (128 / float(m.iter_time(1, 1, 128))) + 30.0
    while not job.done:
        job.step(60.0)
    assert job.completion_time == pytest.approx(expect, abs=1.0)


def test_synthetic_jobs_and_tuned_configs():
    jobs = synthetic_jobs(12, seed=3)
    assert len(jobs) == 12 and jobs[0]["time"] == 0 and np.all(np.diff([j["time"] for j in jobs]) >= 0)
    for j in jobs:
        app, k, b = j["app"], j["num_replicas"], j["batch_size"]
        assert k in (1, 2, 4, 8, 16) and b // app.init_batch_size in (1, 2, 4)
        assert app.phi[-1] == pytest.approx(10 * app.phi[0])


def test_run_policy_orders_the_policies_and_finishes_every_job():
    jobs = synthetic_jobs(10, seed=1)
    res = {p: run_policy(jobs, p) for p in ("pollux", "tiresias")}
    for r in res.values():
        assert len(r["jct"]) == 10 and min(r["jct"]) > 30 and r["avg_jct"] == pytest.approx(np.mean(r["jct"]))
    assert res["pollux"]["avg_jct"] < res["tiresias"]["avg_jct"]
