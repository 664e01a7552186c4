"""Scale-out: the same training script under torchrun, two elastic agents on localhost as two nodes.

Agent A starts alone (``--nnodes=1:2``) and trains; agent B joins; torchrun stops A's worker (SIGTERM, which
the worker turns into a checkpoint at the next step boundary) and restarts the workers at world size 2,
which resume from the newest valid checkpoint. The sample record proves that epoch 0 was
consumed exactly once across the membership change (steps replayed after the restart replace the lost
ones).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from elasticlab.elastic import check_exactly_once

DIGITS = os.path.join(os.path.dirname(__file__), "..", "examples", "digits.py")


def _rows(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a worker killed mid-line by the restart
                pass
    return out


def _agent(port, ckdir, record, log):
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=elasticlab-test",
           "--rdzv_conf", "last_call_timeout=1", "--max-restarts=3", "--monitor-interval=0.2",
           DIGITS, "--checkpoint-dir", str(ckdir), "--epochs", "1", "--global-batch", "8",
           "--checkpoint-every", "5", "--record-samples", str(record), "--step-delay", "0.05"]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                            start_new_session=True)


@pytest.mark.slow
def test_torchrun_two_agents_scale_out(tmp_path):
    port = get_free_port()
    record, ckdir = tmp_path / "samples.jsonl", tmp_path / "ckpt"
    agents = []
    try:
        agents.append(_agent(port, ckdir, record, tmp_path / "a.log"))
        end = time.monotonic() + 240
        while len({r["step"] for r in _rows(record)}) < 8:
            assert agents[0].poll() is None, (tmp_path / "a.log").read_text()[-3000:]
            assert time.monotonic() < end, "agent A never trained"
            time.sleep(0.2)
        agents.append(_agent(port, ckdir, record, tmp_path / "b.log"))
        for i, a in enumerate(agents):
            rc = a.wait(timeout=max(1.0, end - time.monotonic()))
            assert rc == 0, (tmp_path / f"{'ab'[i]}.log").read_text()[-3000:]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    rows = _rows(record)
    rep = check_exactly_once(rows, 1797)
    assert rep["ok"] and rep["epochs"][0]["complete"], {e: (len(v["missing"]), len(v["duplicates"]))
                                                       for e, v in rep["epochs"].items()}
    assert rep["world_sizes"][:2] == [1, 2], rep["world_sizes"]     # scaled out from one node to two
    assert {r["rank"] for r in rows if r["world_size"] == 2} == {0, 1}
    assert sum(1 for p in ckdir.iterdir() if p.name.startswith("ckpt-")) >= 1
    # the planned restart lost no step: torchrun's SIGTERM was relayed to a common step boundary
    lines = (tmp_path / "a.log").read_text().splitlines() + (tmp_path / "b.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith('{"event"')]
    leave = next(e for e in events if e["event"] == "leave")
    resume2 = next(e for e in events if e["event"] == "resume" and e["world_size"] == 2)
    assert resume2["step"] == leave["step"] > 0
