"""A Ray job on the ``GPU`` resource: actors hold ``num_gpus=1`` each from their allocation's bundles.

On this CPU machine the node declares *logical* GPUs (Ray hands out ids through ``CUDA_VISIBLE_DEVICES``,
torch sees no device, the group is gloo): that runs everything of the GPU path except NCCL and the CUDA
tensors. The gpu-marked test runs it on a real GPU (one, so one rank: NCCL refuses two ranks on one device),
with a pause and a resume so that the checkpoint written from CUDA tensors is loaded by a new actor.
Skipped when Ray is not installed (the ``ray`` extra).
"""
from __future__ import annotations

import json
import time

import pytest

ray = pytest.importorskip("ray")

from polling import until  # noqa: E402

from elasticlab.cluster.experiments import examples_path  # noqa: E402
from elasticlab.cluster.ray import RayJob  # noqa: E402
from elasticlab.cluster.ray.local import local_cluster, session_dir, session_processes, shutdown  # noqa: E402
from elasticlab.elastic import check_exactly_once  # noqa: E402
from elasticlab.elastic.task import build  # noqa: E402

EX = examples_path()


def _where(job) -> list[dict]:
    """What each live actor of ``job`` reports about itself (node, pid, device, GPUs Ray gave it)."""
    return ray.get([w["actor"].where.remote() for w in job._workers.values()], timeout=30)


def _exactly_once(job, entry: str) -> dict:
    with open(job.record_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return check_exactly_once(rows, len(build(f"{EX}:{entry}", {})))


def _run(tmp_path, *, gpus: int, workers: int, device: str | None, change, max_steps: int = 30):
    """Start a 1-node cluster of ``gpus`` GPUs, run the comm_bound digits job on ``workers`` of them, call
    ``change(job)`` at step 6 (a resize or a pause/resume), let it finish; returns (job, the actors'
    ``where`` before the change, after it). Steps take at least 20 ms: ``max_steps`` leaves the change
    time to arrive before the job ends."""
    cluster = local_cluster(1, gpus, resource="GPU")
    session = session_dir(cluster)
    job = None
    try:
        assert ray.cluster_resources().get("GPU") == gpus
        job = RayJob(f"{EX}:comm_bound", workers=workers, checkpoint_dir=str(tmp_path / "ck"),
                     global_batch=32, resource="GPU", name="gpu", epochs=1, max_steps=max_steps,
                     checkpoint_every=5,
                     device=device, record_samples=str(tmp_path / "gpu.jsonl"),
                     entry_kwargs={"step_s": 0.02}).start()
        assert job._gang.coupled, "the GPU resource couples each actor to its bundle's GPU"
        end = time.monotonic() + 150
        while job.status()["step"] < 6:
            assert time.monotonic() < end and job.state not in ("failed", "stopped"), job.status()
            time.sleep(0.2)
        assert until(lambda: ray.available_resources().get("GPU", 0) == gpus - workers, 60.0)
        before = _where(job)
        change(job)
        after = _where(job)
        assert job.wait(timeout=150) and job.state == "finished", job.status()
        job.stop()
        assert until(lambda: not session_processes(session, name="RayWorker"), 60.0)
        assert until(lambda: ray.available_resources().get("GPU", 0) == gpus, 60.0)  # every GPU given back
        return job, before, after
    finally:
        if job is not None:
            job.stop()
        shutdown(cluster)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_resource_path_on_logical_gpus(tmp_path):
    """Two logical GPUs, two actors, each given its own GPU id; a shrink to one starts a new actor in the
    new bundle; the samples are exactly once; every GPU is free afterwards."""
    def shrink(job):
        assert job.resize(1).result(timeout=150)["world_size"] == 1

    job, before, after = _run(tmp_path, gpus=2, workers=2, device="cpu", change=shrink)
    assert sorted(w["visible_gpus"] for w in before) == ["0", "1"], before
    assert len(after) == 1 and after[0]["visible_gpus"] in ("0", "1")
    assert not {w["pid"] for w in before} & {w["pid"] for w in after}, "a coupled resize starts new actors"
    assert {e.get("backend") for e in job.events() if e["kind"] == "resume"} == {"gloo"}  # no CUDA here
    rep = _exactly_once(job, "comm_bound")
    assert rep["ok"] and rep["world_sizes"] == [2, 1], rep


def _pause_resume(job):
    """Pause, check that the job stays paused with its GPU free, resume."""
    step = job.pause().result(timeout=120)
    assert until(lambda: ray.available_resources().get("GPU", 0) == 1, 60.0), "a paused job holds no GPU"
    time.sleep(1.0)                                    # a paused job stays paused (no generation re-forms)
    st = job.status()
    assert job.state == "paused" and st.world_size == 0 and st.step == step, st
    assert ray.available_resources().get("GPU", 0) == 1
    job.resume().result(timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pause_and_resume_on_a_logical_gpu(tmp_path):
    """The pause/resume path of the gpu-marked test below, on a logical GPU (gloo): the paused job gives its
    GPU back and stays paused until resumed on a new actor; every sample exactly once."""
    job, before, after = _run(tmp_path, gpus=1, workers=1, device="cpu", change=_pause_resume, max_steps=40)
    assert before[0]["pid"] != after[0]["pid"]
    kinds = [e["kind"] for e in job.events()]
    assert "pause" in kinds and "resumed" in kinds, kinds
    rep = _exactly_once(job, "comm_bound")
    assert rep["ok"], rep


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_job_on_ray_trains_on_cuda_with_nccl_and_resumes_on_a_new_actor(tmp_path):
    """One real GPU: the actor trains on cuda:0 (so its group is NCCL), pauses (checkpoint from CUDA
    tensors, the GPU given back), resumes on a new actor that loads it, and finishes with every sample
    exactly once."""
    job, before, after = _run(tmp_path, gpus=1, workers=1, device="cuda", change=_pause_resume, max_steps=80)
    assert [w["device"] for w in before] == ["cuda:0"] and [w["device"] for w in after] == ["cuda:0"]
    assert before[0]["visible_gpus"] is not None and before[0]["pid"] != after[0]["pid"]
    kinds = [e["kind"] for e in job.events()]
    assert "resumed" in kinds, kinds
    assert {e.get("backend") for e in job.events() if e["kind"] == "resume"} == {"nccl"}
    rep = _exactly_once(job, "comm_bound")
    assert rep["ok"], rep
