"""Unit tests of the cluster layer without worker processes: specs, bad input, views, policies, the panel."""
from __future__ import annotations

import math

import numpy as np
import pytest

from elasticlab.alloc.policies.base import Cluster
from elasticlab.cluster import JobSpec, LiveJob, LocalCluster, RestartCost, make_policy, policy_names
from elasticlab.cluster.experiments import examples_path, three_jobs
from elasticlab.elastic.policies import BatchConfig
from elasticlab.goodput import ThroughputModel, restart_penalty

EX = examples_path()


class FakeHandle:
    """An ElasticJob stand-in: a job measured on a known throughput model with a given GNS."""

    def __init__(self, model: ThroughputModel, gns, world_size=1, batch=32, accum=0, samples=0):
        self.model, self._gns = model, gns
        self.ws, self.batch, self.accum = world_size, batch, accum
        self.samples = samples

    def status(self):
        b = BatchConfig(self.batch, self.accum)
        return {"state": "running", "world_size": self.ws, "gns": self._gns, "global_batch": self.batch,
                "accum_steps": self.accum, "per_worker_batch": b.per_worker_batch(self.ws),
                "samples_per_s": 100.0, "step": 10}

    def step_times(self, skip_first=1, aggregate=False):
        rows = []
        for k in (1, 2):
            for b in (16, 32, 64):
                rows.append((1, k, b, 0, float(self.model.iter_time(1, k, b, 0))))
        return rows

    def metrics(self, since=0):
        return [{"samples": self.samples}] if since == 0 else []

    def events(self, since=0):
        return []


def live(name, model, gns, **spec):
    s = JobSpec(f"{EX}:compute_bound", name=name, max_batch=spec.pop("max_batch", 256),
                per_slot_batch=(4, 128), **spec).validate(4)
    j = LiveJob(s, 0.0, "goodput")
    j.handle = FakeHandle(model, gns)
    j.state = "running"
    j.refit(min_rows=1, every=1)
    return j


COMPUTE = ThroughputModel(alpha_grad=0.004, beta_grad=0.0025, alpha_local=0.004, beta_local=0.001)
COMM = ThroughputModel(alpha_grad=0.012, beta_grad=0.0002, alpha_local=0.045, beta_local=0.015)


def test_spec_defaults_and_bad_values():
    s = JobSpec("examples/cluster_jobs.py:comm_bound", name="a").validate(4)
    assert (s.max_batch, s.max_slots, s.warm) == (32, 4, 4)
    with pytest.raises(ValueError, match="min_slots=5"):
        JobSpec(f"{EX}:comm_bound", name="big", min_slots=5).validate(4)
    with pytest.raises(ValueError, match="max_batch=16"):
        JobSpec(f"{EX}:comm_bound", name="b", max_batch=16).validate(4)
    with pytest.raises(ValueError, match="per_slot_batch"):
        JobSpec(f"{EX}:comm_bound", name="c", per_slot_batch=(8, 4)).validate(4)
    with pytest.raises(ValueError, match="lr_rule"):
        JobSpec(f"{EX}:comm_bound", name="d", lr_rule="cosine").validate(4)
    with pytest.raises(ValueError, match="epochs"):
        JobSpec(f"{EX}:comm_bound", name="e", epochs=0).validate(4)


def test_cluster_refuses_a_job_larger_than_the_pool_and_bad_arguments(tmp_path):
    cl = LocalCluster(slots=4, workdir=str(tmp_path))
    with pytest.raises(ValueError, match="needs min_slots=6 but the pool has only 4"):
        cl.submit(f"{EX}:compute_bound", name="huge", min_slots=6)
    assert [e["kind"] for e in cl.events()] == ["refused"]
    assert cl.submit(f"{EX}:compute_bound", name="ok") == "ok"
    with pytest.raises(ValueError, match="already submitted"):
        cl.submit(f"{EX}:compute_bound", name="ok")
    with pytest.raises(ValueError, match="does not exist"):
        cl.submit("no/such/file.py:f")
    for bad in ({"slots": 0}, {"slots": 2.5}, {"interval": 0}, {"admission": "maybe"}, {"policy": "best"}):
        with pytest.raises(ValueError):
            LocalCluster(**{"slots": 2, **bad})
    for bad, msg in (({"interval": float("inf")}, "interval must be a finite number of seconds > 0, got inf"),
                     ({"tick_s": -1}, "tick_s must be a finite number of seconds > 0, got -1"),  # accepted
                     ({"hysteresis": "1.1"}, "hysteresis must be a finite factor >= 1, got '1.1'"),  # TypeErr
                     ({"crash_grace_s": float("nan")}, "crash_grace_s must be a finite number of seconds")):
        with pytest.raises(ValueError, match=msg):
            LocalCluster(**{"slots": 2, **bad})
    with pytest.raises(ValueError, match="no job named"):
        cl.job("nobody")
    cl.stop()
    assert cl.summary()["states"] == {"ok": "stopped"}


def test_drop_admission_drops_what_cannot_get_its_minimum(tmp_path):
    cl = LocalCluster(slots=4, admission="drop", workdir=str(tmp_path))
    cl.submit(f"{EX}:compute_bound", name="a", min_slots=3)
    cl.submit(f"{EX}:compute_bound", name="b", min_slots=2)  # 3 + 2 > 4: dropped (Saxena)
    cl.submit(f"{EX}:compute_bound", name="c", min_slots=1)
    st = {r["name"]: r["state"] for r in cl.jobs()}
    assert st == {"a": "queued", "b": "dropped", "c": "queued"}
    assert cl.metrics()["dropped"] == 1
    cl.stop()


def test_speedups_tell_compute_from_communication_bound():
    a, b = live("a", COMPUTE, 50.0), live("b", COMM, 50.0)
    sa, sb = a.speedup_curve(4), b.speedup_curve(4)
    assert sa[0] == sb[0] == 0 and sa[1] == pytest.approx(1) and sb[1] == pytest.approx(1)
    assert sa[4] > 2.0  # compute-bound: scales
    assert sb[2] < 1.0  # the slow interconnect makes 2 slots slower than 1
    # goodput rate and the remaining-work weight the alloc goodput policy reads
    g = a.goodput_curve(4)
    assert g[0] == 0 and np.all(np.diff(g[1:]) > 0)
    assert a.remaining_progress() > 0  # before the samples are counted: a nominal prior
    import time

    end = time.monotonic() + 120
    while a.dataset_size() is None and time.monotonic() < end:
        time.sleep(0.05)
    assert a.remaining_progress() == pytest.approx(1797 / 32)
    assert a.max_replicas() == 4  # profiled at 2 slots: Pollux explores up to twice that


def test_best_batch_grows_with_the_noise_scale_and_respects_limits():
    small, big = live("s", COMPUTE, 5.0), live("g", COMPUTE, 5000.0)
    bs, bb = small.best_batch(2), big.best_batch(2)
    assert bb.global_batch > bs.global_batch
    assert bb.global_batch <= 256 and bb.per_worker_batch(2) <= 128
    assert bb.global_batch % (2 * (bb.accum_steps + 1)) == 0  # even split: the GNS keeps being measured
    # fixed mode and no GNS: M0 split over the slots
    assert big.best_batch(3, "fixed") == BatchConfig(32, 0)
    nognss = live("n", COMPUTE, None)
    assert nognss.best_batch(2).global_batch == 32
    # hysteresis keeps a configuration that is nearly as good
    assert big.best_batch(2, current=bb, hysteresis=1.05) == bb
    with pytest.raises(ValueError, match="g >= 1"):
        big.best_batch(0)


def test_throughput_mode_ignores_efficiency():
    j = live("t", COMPUTE, 1.0)
    assert j.best_batch(2, "throughput").global_batch >= j.best_batch(2, "goodput").global_batch


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_allocates_live_jobs_within_the_pool(name):
    jobs = [live("compute", COMPUTE, 50.0), live("comm", COMM, 50.0), live("gns", COMPUTE, 2000.0)]
    for i, j in enumerate(jobs):
        j.submission_time = float(i)
        j.batch_mode = "goodput" if name in ("goodput", "pollux") else "fixed"
    pol = make_policy(name)
    alloc = pol.allocate(jobs, 30.0, Cluster(1, 4))
    assert sum(alloc.values()) <= 4 and all(v >= 0 for v in alloc.values())
    if name in ("goodput", "pollux", "saxena"):
        assert alloc.get("comm", 0) <= 1  # nobody gives the communication-bound job a second slot
    if name == "equal_share":
        assert alloc == {"compute": 2, "comm": 1, "gns": 1}


def test_restart_cost_is_measured_and_feeds_pollux_penalty():
    rc = RestartCost(prior_s=3.0)
    assert rc.estimate == 3.0
    for x in (0.4, 0.6, 9.0):
        rc.observe(x)
    assert rc.estimate == pytest.approx(0.6)
    assert float(rc.penalty(10.0, 1)) == pytest.approx(float(restart_penalty(10.0, 1, 0.6)))
    with pytest.raises(ValueError):
        RestartCost(prior_s=-1)


def test_three_jobs_specs():
    specs = three_jobs(quick=True)
    assert [s.name for s in specs] == ["comm", "compute", "gns"]
    for s in specs:
        s.validate(4)
        assert s.record_samples and s.max_batch >= s.initial_batch


def test_example_tasks_emulate_their_device():
    import time

    import torch

    from elasticlab.elastic.task import build

    task = build(f"{EX}:comm_bound", {"sync_s": 0.05})
    loss = task.loss_fn
    assert loss.device_time(32, 1, True) == pytest.approx(0.012 + 0.0002 * 32)  # no sync on one slot
    assert loss.device_time(32, 3, True) == pytest.approx(0.012 + 0.0002 * 32 + 0.05 + 0.015)
    assert loss.device_time(32, 3, False) == pytest.approx(0.012 + 0.0002 * 32)  # accumulation micro-step
    t0 = time.perf_counter()
    value = loss(task.model, task.batch(np.arange(8)))
    assert time.perf_counter() - t0 >= 0.012 and torch.isfinite(value)
    with pytest.raises(ValueError, match="sample_s"):
        build(f"{EX}:comm_bound", {"sample_s": -1.0})
    crash = build(f"{EX}:crashing", {"crash_after": 1})
    crash.loss_fn(crash.model, crash.batch(np.arange(4)))
    with pytest.raises(RuntimeError, match="emulated crash"):
        crash.loss_fn(crash.model, crash.batch(np.arange(4)))


def test_cluster_panel_headless(tmp_path):
    from elasticlab.widgets import ClusterPanel

    cl = LocalCluster(slots=4, policy="goodput", workdir=str(tmp_path))
    panel = ClusterPanel(cl, autostart_poll=False)
    assert "slots used" in panel.metrics_label.value
    panel.kind.value = "comm_bound"
    panel.name.value = "first"
    assert panel.submit() == "first"
    assert "first" in panel.table.value
    panel.slot_range.value = (1, 4)
    panel.name.value = "first"
    assert panel.submit() is None and "already submitted" in panel.message.value
    panel.kind.value = "custom"
    panel.entrypoint.value = ""
    assert panel.submit() is None and "entrypoint" in panel.message.value
    panel.policy.value = "pollux"
    assert cl.policy_name == "pollux"
    cl._history.append({"t": 1.0, "slots": {"first": 2}, "batch": {"first": 64}})
    panel.refresh()
    times, names, z = panel.slots_matrix()
    assert names == ["first"] and z == [[2]]
    assert list(panel.figure.data[0].z[0])[:1] == [2]
    assert "submit" in panel.log.value
    panel.close()
    cl.stop()
    assert math.isfinite(cl.now())
