"""ElasticJob on a GPU: the worker trains on CUDA, so its process group is NCCL (gpu-marked; one GPU here,
so one rank: NCCL refuses two ranks on one device). On the CPU the same job forms a gloo group, and its
resume event says so."""
import json
import os

import pytest
import torch

from elasticlab.elastic import ElasticJob, check_exactly_once
from elasticlab.elastic.checkpoint import load as load_checkpoint

DIGITS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py") + ":make_task"
N_DIGITS = 1797


def _run(tmp_path, device):
    """30 steps at batch 32, paused at the first step boundary and resumed (the checkpoint read back by the
    same worker): returns the job's events and sample rows, and the newest checkpoint's state. The pause is
    requested as the job starts: a pause requested once some step was seen could arrive after the last of
    30 quick steps (it did, once, in CI: "the job is finished")."""
    job = ElasticJob(DIGITS, workers=1, slots=1, warm=1, global_batch=32, epochs=1, max_steps=30,
                     checkpoint_every=5, checkpoint_dir=str(tmp_path / "ck"), record_samples=True,
                     device=device, timeout_s=60)
    try:
        job.start()
        paused_at = job.pause().result(timeout=120)
        assert job.status()["state"] == "paused" and paused_at < 30, (paused_at, job.status())
        job.resume().result(timeout=120)
        assert job.wait(timeout=180) and job.status()["state"] == "finished", job.status()
        events = job.events()
        path = job.record_path
    finally:
        job.stop()
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    newest, _ = job.checkpoint_dir.latest()
    return events, rows, load_checkpoint(newest)


def _check(events, rows, backend):
    """Both generations (the first, the one after the resume) formed on ``backend``; no sample twice."""
    resumes = [e for e in events if e["kind"] == "resume"]
    assert len(resumes) >= 2 and {e["backend"] for e in resumes} == {backend}, resumes
    rep = check_exactly_once(rows, N_DIGITS)
    assert rep["ok"] and not rep["epochs"][0]["duplicates"], rep
    assert sum(len(r["indices"]) for r in rows if r["epoch"] == 0) >= 30 * 32 - 32


@pytest.mark.timeout(300)
def test_cpu_job_forms_a_gloo_group_and_says_so(tmp_path):
    events, rows, state = _run(tmp_path, "cpu")
    _check(events, rows, "gloo")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_job_trains_on_cuda_with_nccl_and_resumes_from_its_checkpoint(tmp_path):
    events, rows, state = _run(tmp_path, "cuda")
    _check(events, rows, "nccl")
    tensors = [t for t in _tensors(state) if t.is_floating_point()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)  # what the GPU trained, read back


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
