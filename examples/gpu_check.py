"""Check the elastic runtime on a CUDA machine (NCCL, one GPU per rank): a job starts, a resize beyond the
GPU count is refused, pause/resume keeps the loss on a fixed batch, the record is exactly-once.
Run from the repository root: python examples/gpu_check.py (last line GPU_OK or GPU_FAIL)."""
import json
import time

import torch

from elasticlab.elastic import ElasticJob, check_exactly_once

if __name__ == "__main__":
    print("cuda", torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__)
    job = ElasticJob("examples/digits.py:make_task", workers=1, global_batch=64, epochs=2,
                     checkpoint_every=10,
                     record_samples=True)
    print("slots", job.slots)
    try:
        job.resize(2)
    except ValueError as e:
        print("refused as expected:", e)
    t0 = time.time()
    job.start()
    while job.status()["step"] < 5 and job.state != "failed":
        time.sleep(0.05)
    print("first steps after", round(time.time() - t0, 2), "s", job.state, job.status()["error"])
    paused = job.pause().result(60)
    r = job.resume().result(60)
    print("pause at", paused, "resume", r)
    job.wait(120)
    ev = job.events()
    leaves = {e["path"]: e["probe_loss"] for e in ev if e["kind"] == "checkpoint" and e["reason"] == "leave"}
    res = [e for e in ev if e["kind"] == "resume" and e["checkpoint"] in leaves]
    same = all(e["probe_loss"] == leaves[e["checkpoint"]] for e in res)
    rows = [json.loads(x) for x in open(job.record_path)]
    rep = check_exactly_once(rows, 1797)
    m = job.metrics()
    print("state", job.state, "steps", m[-1]["step"], "loss", m[-1]["loss"], "probe equal", same, len(res),
          "exactly once", rep["ok"], [v["complete"] for v in rep["epochs"].values()])
    print("median samples/s", sorted(x["samples_per_s"] for x in m)[len(m) // 2])
    job.stop()
    print("GPU_OK" if job.state in ("finished", "stopped") and same and rep["ok"] and res else "GPU_FAIL")
