"""ElasticJob end to end: live resizes 1->3->2->4->1 inside one epoch, exactly-once from the sample record,
loss continuity across a resume, corrupt-checkpoint fallback, SIGKILL recovery, bad requests, cleanup.

One job (4 warm worker processes) serves the tests of this module in order: starting processes costs
seconds each on a small machine.
"""
import json
import os
import signal
import time

import pytest

from elasticlab.elastic import ElasticJob, check_exactly_once

DIGITS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py") + ":make_task"
N_DIGITS = 1797
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]


def wait_until(pred, timeout=90.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    d = tmp_path_factory.mktemp("job")
    job = ElasticJob(DIGITS, workers=1, warm=4, slots=4, global_batch=4, epochs=3, checkpoint_every=10,
                     checkpoint_dir=str(d), record_samples=True, step_delay_s=0.02, timeout_s=20)
    job.start()
    ctx = {"job": job, "handlers": handlers, "pids": set()}
    try:
        yield ctx
    finally:
        job.stop()
        for pid in ctx["pids"] | {w["pid"] for w in job.status()["workers"].values()}:
            if alive(pid):  # never leave a process behind, whatever failed
                os.kill(pid, signal.SIGKILL)


def _remember(ctx):
    ctx["pids"] |= {w["pid"] for w in ctx["job"].status()["workers"].values()}


def test_resize_schedule_inside_one_epoch(run):
    job = run["job"]
    wait_until(lambda: job.status()["step"] >= 3 or job.state == "failed", 180, "the first steps")
    assert job.state == "running", job.events()
    _remember(run)
    results = [job.resize(n).result(timeout=90) for n in (3, 2, 4, 1)]
    assert [r["world_size"] for r in results] == [3, 2, 4, 1]
    assert all(r["latency_s"] > 0 for r in results)
    resizes = [e for e in job.events() if e["kind"] == "resize"]
    assert [(e["from_size"], e["to_size"]) for e in resizes] == [(1, 3), (3, 2), (2, 4), (4, 1)]
    m = job.metrics()
    assert {r["world_size"] for r in m} == {1, 2, 3, 4}
    assert all(r["global_batch"] == 4 for r in m)             # fixed global batch, re-split
    assert {r["per_worker_batch"] for r in m if r["world_size"] == 3} == {2}  # ceil(4/3)
    last = results[-1]["step"]
    assert all(r["epoch"] == 0 for r in m if r["step"] <= last), "the schedule left epoch 0"


def test_loss_on_fixed_batch_equal_across_resume(run):
    ev = run["job"].events()
    leaves = {e["path"]: e["probe_loss"] for e in ev if e["kind"] == "checkpoint" and e["reason"] == "leave"}
    resumes = [e for e in ev if e["kind"] == "resume" and e["checkpoint"] in leaves]
    assert len(resumes) >= 4
    for e in resumes:
        assert e["probe_loss"] == leaves[e["checkpoint"]], e     # bitwise: the same weights came back


def test_bad_requests_clear_errors_job_unharmed(run):
    job = run["job"]
    step = job.status()["step"]
    for bad, match in ((0, "0"), (5, "5 exceeds the machine's 4"), (-2, "-2"), (1.5, "1.5"), ("2", "'2'"),
                       (True, "True")):
        with pytest.raises(ValueError, match=match):
            job.resize(bad)
    with pytest.raises(ValueError, match="global_batch.*0"):
        job.set_batch(0)
    with pytest.raises(ValueError, match="accum_steps.*-1"):
        job.resize(2, accum_steps=-1)
    assert job.state == "running"
    wait_until(lambda: job.status()["step"] >= step + 3, 60, "steps after the bad requests")


def test_set_batch_at_step_boundary(run):
    job = run["job"]
    r = job.set_batch(8).result(timeout=60)
    assert r["global_batch"] == 8
    assert job.metrics()[-1]["global_batch"] == 8
    job.set_batch(4).result(timeout=60)


def test_corrupt_checkpoint_falls_back_to_previous(run):
    job = run["job"]
    paused_at = job.pause().result(timeout=60)
    assert job.state == "paused"
    ckdir = job.checkpoint_dir
    assert ckdir.steps()[-1] == paused_at
    newest = ckdir.path(paused_at)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])   # truncated on disk
    previous = ckdir.steps()[-2]
    n_ev = len(job.events())
    resumed = job.resume(2).result(timeout=90)
    ev = job.events(n_ev)
    # a resume from pause is its own event kind, no resize from 0 workers (issue 15)
    assert not [e for e in ev if e["kind"] == "resize"], ev
    (done,) = [e for e in ev if e["kind"] == "resumed"]
    assert done["world_size"] == 2 and done["step"] == resumed["step"] > previous
    assert done["latency_s"] == resumed["latency_s"] > 0
    corrupt = [e for e in ev if e["kind"] == "checkpoint_corrupt"]
    assert corrupt and corrupt[0]["path"] == str(newest) and "checksum" in corrupt[0]["reason"]
    gen = next(e for e in ev if e["kind"] == "generation")
    assert gen["checkpoint"] == str(ckdir.path(previous)) and gen["world_size"] == 2
    assert next(e for e in ev if e["kind"] == "resume")["step"] == previous < paused_at


def test_sigkill_resumes_from_last_checkpoint(run):
    job = run["job"]
    wait_until(lambda: job.world_size == 2 and len(job.worker_pids()) == 2, 30, "two workers")
    _remember(run)
    step0 = job.status()["step"]
    wait_until(lambda: job.status()["step"] >= step0 + 3, 60, "steps before the kill")
    n_ev = len(job.events())
    victim = job.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: any(e["kind"] == "restart" for e in job.events(n_ev)), 90, "the restart")
    ev = job.events(n_ev)
    fault = next(e for e in ev if e["kind"] == "fault")
    assert fault["pid"] == victim and fault["exitcode"] == -signal.SIGKILL
    restart = next(e for e in ev if e["kind"] == "restart")
    assert 0 <= restart["lost_steps"] <= 10                 # at most the steps since the last checkpoint
    assert restart["from_step"] % 10 == 0 or restart["from_step"] in job.checkpoint_dir.steps()
    assert restart["world_size"] == 2
    assert job.status()["lost_steps"] >= restart["lost_steps"]
    wait_until(lambda: job.status()["step"] > restart["last_step"] + 2, 90, "steps after the restart")
    assert not alive(victim)


def test_exactly_once_from_sample_record_and_cleanup(run):
    job = run["job"]
    wait_until(lambda: job.status()["epoch"] >= 1, 180, "the end of epoch 0")
    _remember(run)
    job.stop()
    assert job.state == "stopped"
    with open(job.record_path) as f:
        rows = [json.loads(line) for line in f]
    assert {"epoch", "step", "rank", "world_size", "indices"} <= set(rows[0])
    rep = check_exactly_once(rows, N_DIGITS)
    assert rep["ok"], {e: (len(v["missing"]), len(v["duplicates"])) for e, v in rep["epochs"].items()}
    assert rep["epochs"][0]["complete"] and not rep["epochs"][0]["missing"]
    assert rep["world_sizes"][:5] == [1, 3, 2, 4, 1]
    # no process left behind, the caller's signal handlers untouched, requests on a stopped job refused
    wait_until(lambda: not any(alive(p) for p in run["pids"]), 10, "the workers to exit")
    assert {s: signal.getsignal(s) for s in SIGNALS} == run["handlers"]
    with pytest.raises(RuntimeError, match="stopped"):
        job.resize(2)
    with pytest.raises(RuntimeError, match="stopped"):
        job.pause()


def test_goodput_adaptive_policy_grows_the_batch(tmp_path):
    """Pollux's agent in a live job: the throughput model is fitted from measured step times, the GNS comes
    from the replicas' gradient norms, and the batch moves to the goodput-optimal one (digits' GNS of ~50
    with per-step overheads that dominate make bigger batches pay)."""
    from elasticlab.elastic import GoodputAdaptive

    pol = GoodputAdaptive(base_batch=32, max_batch=512, per_worker_range=(8, 256))
    job = ElasticJob(DIGITS, workers=2, slots=2, policy=pol, epochs=1000, checkpoint_every=0,
                     checkpoint_dir=str(tmp_path), goodput_refit_s=0.5, step_delay_s=0.005)
    job.start()
    try:
        wait_until(lambda: any(e["kind"] == "adapt" for e in job.events())
                   or job.state in ("failed", "finished"), 240, "a goodput adaptation")
        adapt = next(e for e in job.events() if e["kind"] == "adapt")
        assert adapt["global_batch"] > 32 and adapt["goodput"] > 0
        wait_until(lambda: job.status()["global_batch"] == adapt["global_batch"], 60, "the new batch")
        m = job.metrics()
        assert any(r["predicted_goodput"] for r in m) and any(r["gns"] for r in m)
        assert m[-1]["lr"] > m[0]["lr"]                        # AdaScale raises the LR with the batch
        assert job.fits_throughput and job.throughput_model() is not None  # published for the cluster
    finally:
        job.stop()
