"""The cluster driving real elastic jobs (worker processes): the policy comparison and a crashing job.

Every test stops its cluster in a ``finally``/fixture, which ends all worker processes even on failure.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from elasticlab.cluster import LocalCluster
from elasticlab.cluster.experiments import compare_policies, examples_path, warm_up

EX = examples_path()


def _no_workers_left():
    return [p for p in mp.active_children() if p.name.startswith("elasticlab-worker")]


def test_goodput_beats_equal_shares_on_three_real_jobs():
    """Three real jobs (communication-bound, compute-bound, fast-growing GNS) on 4 slots: the goodput
    policy's average JCT is lower than fixed equal shares, measured in this run; every job finishes and
    every sample record is exactly-once."""
    out = compare_policies(("equal_share", "goodput"), quick=True, slots=4, interval=1.0, timeout=400)
    for pol in ("equal_share", "goodput"):
        run = out["runs"][pol]
        assert not run["timed_out"], (pol, run["states"])
        assert run["states"] == {"comm": "finished", "compute": "finished", "gns": "finished"}, run["errors"]
        assert run["samples_ok"] == {"comm": True, "compute": True, "gns": True}
    g, e = out["goodput_avg_jct"], out["equal_share_avg_jct"]
    print(f"average JCT: goodput {g:.1f}s, equal shares {e:.1f}s; "
          f"per job {out['runs']['goodput']['jct']} vs {out['runs']['equal_share']['jct']}")
    assert g < e
    # the goodput run moved slots and batches while the jobs trained, with a measured restart cost
    gr = out["runs"]["goodput"]
    kinds = {ev["kind"] for ev in gr["events"]}
    assert "resize" in kinds or "set_batch" in kinds
    assert gr["restart_cost"]["measured"] >= 1 or "set_batch" in kinds
    assert not _no_workers_left()


def test_a_crashing_job_returns_its_slots_and_the_others_keep_running(tmp_path):
    warm_up()
    cl = LocalCluster(slots=3, policy="fifo", interval=0.5, crash_grace_s=2.0, workdir=str(tmp_path))
    try:
        cl.submit(f"{EX}:crashing", name="bad", slots=2, warm=2, entry_kwargs={"crash_after": 4},
                  lr_rule="constant")
        cl.submit(f"{EX}:comm_bound", name="small", slots=1, warm=1, epochs=1, record_samples=True,
                  lr_rule="constant")
        cl.submit(f"{EX}:comm_bound", name="waiting", slots=2, warm=2, epochs=1, record_samples=True,
                  lr_rule="constant")  # FIFO: waits for the crashed job's two slots
        cl.start()
        assert cl.wait(timeout=300), cl.jobs()
        states = cl.summary()["states"]
        assert states == {"bad": "failed", "small": "finished", "waiting": "finished"}, cl.summary()
        assert "emulated crash" in (cl.summary()["errors"]["bad"] or "")
        ev = cl.events()
        t_fail = next(e["t"] for e in ev if e["kind"] == "failed" and e["job"] == "bad")
        t_start = next(e["t"] for e in ev if e["kind"] == "start" and e["job"] == "waiting")
        assert t_start >= t_fail  # it got the slots the crashed job gave back
        for name in ("small", "waiting"):
            assert cl.sample_check(name)["ok"]
    finally:
        cl.stop()
    assert not _no_workers_left()


def test_switching_policy_live_resizes_a_running_job(tmp_path):
    """equal_share then FIFO: switching the policy re-plans the running job (a resize at a step boundary)."""
    warm_up()
    cl = LocalCluster(slots=2, policy="equal_share", interval=0.3, workdir=str(tmp_path))
    try:
        cl.submit(f"{EX}:compute_bound", name="a", epochs=2, warm=2, record_samples=True, lr_rule="constant")
        cl.start()
        end = time.monotonic() + 240
        while not any(r["world_size"] == 2 for r in cl.jobs()) and time.monotonic() < end:
            time.sleep(0.1)
        cl.set_policy("fifo")  # FIFO gives the job what it asked for: 1 slot
        while not any(e["kind"] == "resize_done" for e in cl.events()) and time.monotonic() < end:
            time.sleep(0.1)
        assert cl.wait(timeout=240)
        assert cl.summary()["states"] == {"a": "finished"}
        assert cl.sample_check("a")["ok"]
        ws = [h["slots"].get("a") for h in cl.history()]
        assert 2 in ws and 1 in ws[ws.index(2):]
    finally:
        cl.stop()


@pytest.mark.slow
def test_cluster_drives_torchrun_agents_through_a_shrink_and_a_grow(tmp_path):
    """A torchrun job (c10d rendezvous, one agent per slot on localhost) under equal shares: it starts
    alone on 2 slots, shrinks to 1 when a second job arrives and grows back when that one finishes;
    its sample record stays exactly-once across the membership changes."""
    warm_up()
    cl = LocalCluster(slots=2, policy="equal_share", interval=0.5, workdir=str(tmp_path))
    try:
        cl.submit(f"{EX}:compute_bound", name="tr", backend="torchrun", max_slots=2, epochs=12,
                  checkpoint_every=5, record_samples=True, lr_rule="constant")
        cl.start()
        end = time.monotonic() + 300
        while not any(r["name"] == "tr" and r["world_size"] == 2 for r in cl.jobs()):
            assert time.monotonic() < end, (cl.jobs(), cl.job("tr") and cl.job("tr").events())
            time.sleep(0.2)
        cl.submit(f"{EX}:comm_bound", name="other", epochs=1, warm=1, lr_rule="constant")
        assert cl.wait(timeout=400), cl.jobs()
        s = cl.summary()
        assert s["states"] == {"tr": "finished", "other": "finished"}, (s, cl.job("tr").events())
        sizes = [h["slots"].get("tr") for h in cl.history() if h["slots"].get("tr")]
        assert 2 in sizes and 1 in sizes[sizes.index(2):], sizes  # shrank after running on 2
        rep = cl.sample_check("tr")
        assert rep["ok"], {e: (len(v["missing"]), len(v["duplicates"])) for e, v in rep["epochs"].items()}
        assert sorted(rep["epochs"]) == list(range(12)) and all(v["complete"] for v in rep["epochs"].values())
        assert 1 in rep["world_sizes"] and 2 in rep["world_sizes"]
    finally:
        cl.stop()
