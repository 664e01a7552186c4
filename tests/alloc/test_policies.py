"""Placement and scheduling policies on small hand-made job sets."""
import numpy as np
import pytest

from elasticlab.alloc.placement import node_count, place
from elasticlab.alloc.policies import Cluster, get_policy
from elasticlab.alloc.policies.pollux import power_utility
from elasticlab.sim import SimJob, load_application


def test_place_respects_capacity_and_keeps_unchanged():
    counts = {"a": 6, "b": 3, "c": 2, "d": 4}
    out = place(counts, {}, 4, 4)
    assert {k: sum(v) for k, v in out.items()} == counts
    used = np.sum([v for v in out.values()], axis=0)
    assert np.all(used <= 4)
    assert node_count(out["b"]) == 1 and node_count(out["c"]) == 1  # small jobs on one node
    again = place({"a": 6, "b": 3, "c": 1}, out, 4, 4)
    assert again["a"] == out["a"] and again["b"] == out["b"]


def _shared_by_multi_node_jobs(out):
    """Nodes that host more than one job spread over several nodes."""
    multi = [np.asarray(p) > 0 for p in out.values() if node_count(p) > 1]
    return np.flatnonzero(np.sum(multi, axis=0) > 1) if multi else np.array([], int)


def test_place_one_distributed_per_node():
    # no node hosts two multi-node jobs: d gets the 2 free GPUs off a's nodes (elastic), where without the
    # rule it takes 3 and shares a's second node
    counts = {"a": 6, "b": 3, "c": 3, "d": 3}
    out = place(counts, {}, 4, 4, one_distributed_per_node=True)
    assert {k: sum(v) for k, v in out.items()} == {**counts, "d": 2}
    assert _shared_by_multi_node_jobs(out).size == 0, out
    free = place(counts, {}, 4, 4)
    assert {k: sum(v) for k, v in free.items()} == counts and _shared_by_multi_node_jobs(free).size > 0
    # a kept placement that would share a node with another multi-node job is moved, never dropped
    prev = {"a": (4, 2, 0, 0), "b": (0, 2, 2, 0)}
    out = place({"a": 6, "b": 4}, prev, 4, 4, one_distributed_per_node=True)
    assert out["a"] == prev["a"] and sum(out["b"]) == 4 and _shared_by_multi_node_jobs(out).size == 0
    with pytest.raises(ValueError, match="cluster has"):
        place({"a": 20}, {}, 4, 4)
    with pytest.raises(ValueError, match="negative"):
        place({"a": -1}, {}, 4, 4)


def test_power_utility_is_monotone_in_power_mean():
    rng = np.random.default_rng(0)
    from scipy import stats

    for p in (-1.0, 0.0, 0.5, 1.0):
        a, b = rng.uniform(0.1, 3, 5), rng.uniform(0.1, 3, 5)
        def pm(x, p=p):
            return stats.gmean(x) if p == 0 else stats.pmean(x, p)

        assert (pm(a) > pm(b)) == (power_utility(a, p).sum() > power_utility(b, p).sum())


def _jobs(n, mode="fixed"):
    app = load_application("cifar10")
    return [SimJob(f"j{i}", app, float(i), num_replicas=4 + 4 * (i % 2), batch_size=1024, batch_mode=mode)
            for i in range(n)]


def test_fifo_head_of_line_and_tiresias_skips():
    jobs = _jobs(3)
    jobs[0].target_replicas = 8
    jobs[1].target_replicas = 12
    jobs[2].target_replicas = 4
    c = Cluster(4, 4)
    assert get_policy("fifo").allocate(jobs, 60, c) == {"j0": 8}
    assert get_policy("tiresias").allocate(jobs, 60, c) == {"j0": 8, "j2": 4}


def test_tiresias_demotes_after_threshold():
    jobs = _jobs(2)
    c = Cluster(1, 8)
    pol = get_policy("tiresias", threshold=3600)
    for j in jobs:
        j.target_replicas = 8
    assert set(pol.allocate(jobs, 0, c)) == {"j0"}
    assert set(pol.allocate(jobs, 3600, c)) == {"j1"}  # j0 demoted after 8 GPUs x 450 s


def test_optimus_gives_everyone_one_gpu_first():
    jobs = _jobs(5)
    for j in jobs:
        j.reallocate((1,))
        j.step(120)
    out = get_policy("optimus").allocate(jobs, 120, Cluster(2, 4))
    assert set(out) == {j.name for j in jobs} and sum(out.values()) == 8


@pytest.mark.parametrize("name", ["pollux", "goodput", "gpu-elastic", "saxena"])
def test_dp_policies_within_caps(name):
    pol = get_policy(name)
    jobs = _jobs(6, mode=pol.batch_mode)
    for j in jobs[:3]:
        j.reallocate((2,))
        j.step(300)
    out = pol.allocate(jobs, 400, Cluster(4, 4))
    assert sum(out.values()) <= 16
    for j in jobs:
        assert out.get(j.name, 0) <= j.max_replicas(cap=16)
    assert all(out.get(j.name, 0) <= 1 for j in jobs[3:])  # never profiled: exploration cap 1


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("slurm")


def test_goodput_policy_prefers_short_jobs_and_validates():
    with pytest.raises(ValueError, match="weight"):
        get_policy("goodput", weight="magic")
    with pytest.raises(ValueError, match="a must be"):
        get_policy("goodput", a=0)
    jobs = _jobs(2, mode="goodput")
    for j in jobs:
        j.reallocate((4,))
        j.step(600)
    jobs[0].progress = jobs[0].app.max_progress * 0.95
    out = get_policy("goodput").allocate(jobs, 700, Cluster(3, 4))
    assert out["j0"] == 4  # nearly done: a 30 s restart is not worth it, it keeps its GPUs
    for j in jobs:  # both paused: the shorter remaining job gets at least as many GPUs
        j.reallocate(())
    jobs[0].progress = jobs[0].app.max_progress * 0.5
    out = get_policy("goodput").allocate(jobs, 700, Cluster(3, 4))
    assert out["j0"] >= out["j1"] >= 1
    jobs[0].reallocate((4,))  # no work left (about to finish): it keeps its GPUs, no "+inf utility" error
    jobs[0].progress = jobs[0].app.max_progress
    out = get_policy("goodput").allocate(jobs, 700, Cluster(3, 4))
    assert out["j0"] == 4 and out["j1"] >= 1
