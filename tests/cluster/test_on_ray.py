"""The autoscaler on Ray: a 3-node ``ray.cluster_utils.Cluster`` (2 slots each, the custom resource ``slot``)
runs three small real jobs under the goodput policy; a node is removed while they train.

Skipped when Ray is not installed (the ``ray`` extra). The jobs are the digits jobs of
``examples/cluster_jobs.py`` at two epochs each, so that the module stays within a few minutes on 2 cores.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest

ray = pytest.importorskip("ray")

from elasticlab.cluster import JobSpec  # noqa: E402
from elasticlab.cluster.experiments import examples_path  # noqa: E402
from elasticlab.cluster.ray import RayCluster, RayJob  # noqa: E402
from elasticlab.cluster.ray.gang import Gang  # noqa: E402
from elasticlab.cluster.ray.local import kill_node, local_cluster, shutdown  # noqa: E402

EX = examples_path()


def _actor_processes() -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any("RayWorker" in c for c in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _live_actors() -> list:
    """Actors that Ray does not count as dead (its GCS actor table)."""
    from ray._private import state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]


def test_gang_keeps_the_workers_on_the_planned_nodes_and_starts_the_rest_there():
    g = Gang("j", "slot", f"{EX}:comm_bound", {}, {})
    g.workers.update({0: {"node": "A"}, 1: {"node": "B"}, 2: {"node": "B"}})
    assert g.choose(2, ["B", "C"]) == ([1], ["C"])
    assert g.choose(3, ["A", "B", "B"]) == ([0, 1, 2], [])
    assert g.choose(4, ["C", "C", "A", "A"]) == ([0], ["C", "C", "A"])
    # no plan for this size (or none at all): keep the first live workers, Ray places the rest
    assert g.choose(2, ["A"]) == ([0, 1], [])
    assert g.choose(5, None) == ([0, 1, 2], [None, None])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="workers must be an integer >= 1, got 0"):
        RayJob(f"{EX}:comm_bound", workers=0, checkpoint_dir="/tmp", global_batch=32)
    with pytest.raises(ValueError, match="resource must name a Ray resource"):
        RayJob(f"{EX}:comm_bound", workers=1, checkpoint_dir="/tmp", global_batch=32, resource="")
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        local_cluster(0)


def _kinds(events) -> list:
    return [(round(e["t"], 1), e["kind"], e.get("job"), e.get("step"), e.get("world_size")) for e in events]


def _replayed_steps(path: str) -> int:
    """Steps that two generations recorded (rolled back by a fault and run again)."""
    gens = defaultdict(set)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            gens[r["step"]].add(r["generation"])
    return sum(1 for g in gens.values() if len(g) > 1)


@pytest.mark.timeout(900)
def test_three_jobs_on_three_ray_nodes_finish_when_a_node_is_lost(tmp_path):
    """Three jobs under the goodput policy on 3 nodes x 2 slots; once a job trains on a worker node, that
    node is removed. Every job finishes; the cluster sees 4 slots on 2 nodes; the job on the lost node
    resumed from its checkpoint, and its sample record is exactly-once per epoch except the replayed steps,
    which are as many as it counted. Afterwards no actor is left and every slot is free."""
    cluster = local_cluster(3, 2)
    cl = None
    try:
        head = ray.get_runtime_context().get_node_id()
        cl = RayCluster("goodput", interval=1.0, workdir=str(tmp_path), job_kwargs={"fault_grace_s": 3.0})
        assert cl.shape().num_nodes == 3 and cl.slots == 6
        # a slower emulated device (a sleep per micro-batch): the jobs still train when the node goes
        common = {"record_samples": True, "checkpoint_every": 10, "lr_rule": "adascale", "epochs": 2,
                  "warm": 2, "entry_kwargs": {"step_s": 0.08}}
        cl.submit(JobSpec(f"{EX}:comm_bound", name="comm", max_batch=128, per_slot_batch=(4, 128), **common))
        cl.submit(JobSpec(f"{EX}:compute_bound", name="compute", max_batch=128, per_slot_batch=(4, 64),
                          **common))
        cl.submit(JobSpec(f"{EX}:gns_growing", name="gns", max_batch=256, per_slot_batch=(4, 128),
                          **common))
        cl.start()
        def busy(name):  # past its first checkpoint, with an epoch of work still ahead
            st = cl.job(name).status()
            return st["state"] == "running" and st["step"] > 12 and st["epoch"] == 0

        victim, end = None, time.monotonic() + 400
        while victim is None:  # a worker node where such a job trains
            assert time.monotonic() < end, cl.jobs()
            for n in cl.nodes():
                if n["node_id"] != head and n["jobs"] and all(busy(j) for j in n["jobs"]):
                    victim, on_it = n["node_id"], sorted(n["jobs"])
                    break
            time.sleep(0.2)
        t_kill = cl.now()
        kill_node(cluster, victim)
        assert cl.wait(timeout=500), cl.jobs()
        s = cl.summary()
        assert s["states"] == {"comm": "finished", "compute": "finished", "gns": "finished"}, s["errors"]
        ev = cl.events()
        assert any(e["kind"] == "node_lost" and e["node"] == victim for e in ev)
        assert cl.slots == 4 and cl.shape().num_nodes == 2
        assert any(e["kind"] in ("start", "resize") for e in ev)
        faults = 0
        for name in ("comm", "compute", "gns"):
            st = cl.job(name).status()
            rep = cl.sample_check(name)
            assert rep["ok"], (name, {e: (len(v["missing"]), len(v["duplicates"]))
                                      for e, v in rep["epochs"].items()})
            assert all(v["complete"] for v in rep["epochs"].values())
            assert _replayed_steps(st["record_samples"]) == st["lost_steps"], name
            faults += st["faults"]
            if name in on_it:
                assert st["faults"] >= 1, (name, t_kill, _kinds(cl.job(name).events()), _kinds(ev))
                kinds = [e["kind"] for e in cl.job(name).events()]
                assert "fault" in kinds and "restart" in kinds
        assert faults >= 1
        # the notebook panel reads a RayCluster as it reads a LocalCluster
        from elasticlab.widgets import ClusterPanel

        panel = ClusterPanel(cl, autostart_poll=False)
        panel.refresh()
        assert "/4 " in panel.metrics_label.value and "finished 3" in panel.metrics_label.value
        times, names, z = panel.slots_matrix()
        assert sorted(names) == ["comm", "compute", "gns"] and max(max(r) for r in z) >= 1
        assert all(n in panel.table.value for n in names) and "<b>start</b>" in panel.log.value
        panel.close()
        print(f"JCT {s['jct']}, lost node hosted {on_it}, restart cost {s['restart_cost']['samples_s']}")
    finally:
        if cl is not None:
            cl.stop()
    # every actor ended with its job: all slots free again, no actor alive in Ray's table; and after the
    # cluster shuts down, no actor process is left on the machine
    deadline = time.monotonic() + 60
    while ray.available_resources().get("slot", 0) < 4 or _live_actors():
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    try:
        assert ray.available_resources().get("slot", 0) == 4
        assert not _live_actors()
    finally:
        shutdown(cluster)
    deadline = time.monotonic() + 30
    while _actor_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _actor_processes()
