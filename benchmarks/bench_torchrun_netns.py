"""torchrun agents across hosts: each agent in a Linux network namespace of its own, joined by a bridge.

The c10d rendezvous, the workers' store and gloo cross a real network stack (veth pairs on a bridge), not
loopback. The controller (:class:`elasticlab.cluster.torchrun.TorchrunJob`, this process, root namespace)
hosts the rendezvous store on the bridge's address; agent ``i`` runs under ``ip netns exec`` and advertises
its namespace's address. A shared token (``ELASTICLAB_TORCHRUN_TOKEN``, random per run) is required since
no address is loopback.

Scenario: two agents train; a third joins (``--nnodes 1:3``); optionally the newest then leaves (SIGKILL).
Measured: membership change (``resize`` call) -> first step at the new size, per change. Checked: every
sample of the epoch seen exactly once apart from counted replays, and every listening socket of the job
bound to its own namespace's address (never 0.0.0.0, ::, or loopback).

Needs root and ``ip netns``. Last line: ``RESULT {json}``.
Usage: python benchmarks/bench_torchrun_netns.py [--leave] [--agents 3] [--step-delay 0.04] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUM_SAMPLES = 1797  # examples/digits.py


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None if they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` unavailable: {r.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Netns:
    """A bridge in the root namespace (``10.77.S.1/24``) and ``n`` namespaces on it (``10.77.S.10+i``),
    each with a veth pair; unique names, so several runs may coexist. ``close()`` removes everything
    (also after a partial setup)."""

    def __init__(self, n: int):
        self.tag = secrets.token_hex(3)
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        free = [s for s in range(1, 255) if f" 10.77.{s}." not in used]
        if not free:
            raise RuntimeError("no free 10.77.S.0/24 subnet")
        s = free[secrets.randbelow(len(free))]
        self.bridge, self.bridge_addr = f"elb{self.tag}", f"10.77.{s}.1"
        self.names = [f"eln-{self.tag}-{i}" for i in range(n)]
        self.addrs = [f"10.77.{s}.{10 + i}" for i in range(n)]
        self.made: list[tuple[str, str]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
                host, peer = f"elv{self.tag}{i}", f"elp{self.tag}{i}"
                _ip("netns", "add", ns)
                self.made.append(("netns", ns))
                _ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns)
                _ip("link", "set", host, "master", self.bridge, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", peer)
                _ip("-n", ns, "link", "set", peer, "up")
        except Exception:
            self.close()
            raise

    def nodes(self) -> list[dict]:
        """``TorchrunJob(nodes=...)``: where agent ``i`` runs and the address it advertises."""
        return [{"addr": a, "prefix": ["ip", "netns", "exec", ns]} for ns, a in zip(self.names, self.addrs)]

    def close(self) -> None:
        for kind, name in reversed(self.made):  # a namespace's end of a veth pair takes the pair with it
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name) if kind == "netns" else _ip("link", "del", name)
        self.made = []

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rows(path: str) -> list[dict]:
    out = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _wait_steps(job, n: int, size: int, deadline: float) -> None:
    while True:
        st = job.status()
        if st["world_size"] == size and st["step"] >= n:
            return
        if job.state in ("finished", "failed") or time.monotonic() > deadline:
            raise RuntimeError(f"no step {n} at world size {size}: {st}, events {job.events()[-6:]}")
        time.sleep(0.1)


def run(workdir: str, *, agents: int = 3, leave: bool = False, step_delay: float = 0.04,
        timeout_s: float = 150.0, netns: Netns | None = None, log_dir: str | None = None) -> dict:
    """The scenario of the module docstring in ``workdir``; returns the measurements and checks."""
    import psutil

    from elasticlab.cluster.torchrun import TorchrunJob, listening_sockets
    from elasticlab.elastic import check_exactly_once, effective_rows
    from elasticlab.elastic.rendezvous import listener_inodes

    before = listener_inodes([os.getpid()])  # this process's listeners from before the job: not judged

    own = netns is None
    net = netns or Netns(agents)
    record = os.path.join(workdir, "samples.jsonl")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    job = TorchrunJob("examples/digits.py:make_task", workers=agents - 1, max_workers=agents,
                      checkpoint_dir=os.path.join(workdir, "ckpt"), entry_kwargs={"base_batch": 8}, epochs=1,
                      checkpoint_every=5, record_samples=record, name="netns", host=net.bridge_addr,
                      token=secrets.token_hex(16), nodes=net.nodes(), step_delay_s=step_delay,
                      max_restarts=10, log_dir=log_dir)
    seen: dict = {}

    def scan():
        addr_of = {os.getpid(): net.bridge_addr}
        for p in list(job._agents):
            with contextlib.suppress(psutil.NoSuchProcess):
                for q in [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]:
                    addr_of[q] = job.nodes[job._node_of[p.pid]]["addr"]
        for s in listening_sockets(addr_of, exclude=before):
            seen[(s["pid"], s["port"])] = {**s, "expected": addr_of[s["pid"]]}

    changes = []

    def change(name: str, fut, n: int) -> dict:
        """The future's latency and its phases from the job's events: request -> the workers drained at
        a step boundary ('leave') -> the group formed at the new size ('resume') -> its first step."""
        res = fut.result(max(1.0, deadline - time.monotonic()))
        ev = job.events()
        t_req = next(e["t"] for e in reversed(ev) if e["kind"] in ("agent_start", "agent_stop"))
        after = [e for e in ev if e["t"] >= t_req]
        t_leave = next((e["t"] for e in after if e["kind"] == "leave"), None)
        t_res = next((e["t"] for e in after if e["kind"] == "resume" and e["world_size"] == n), None)
        t_step = next(e["t"] for e in after if e["kind"] == "resize")
        phases = {"drain_s": None if t_leave is None else t_leave - t_req,
                  "restart_s": None if t_res is None else t_res - (t_req if t_leave is None else t_leave),
                  "first_step_s": None if t_res is None else t_step - t_res}
        return {"change": name, **res, **{k: v for k, v in phases.items() if v is not None}}

    try:
        job.start()
        first = agents - 1
        _wait_steps(job, 6, first, deadline)
        t_first = time.monotonic() - t0
        scan()
        fut = job.resize(agents)                                       # a namespace joins
        while not fut.done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no step at size {agents}: {job.status()}")
            scan()
            time.sleep(0.1)
        changes.append(change(f"join {first}->{agents}", fut, agents))
        step = job.status()["step"]
        _wait_steps(job, step + 3, agents, deadline)
        scan()
        if leave:
            fut = job.resize(agents - 1)                               # the newest one leaves (SIGKILL)
            changes.append(change(f"leave {agents}->{agents - 1}", fut, agents - 1))
            scan()
        while job.state not in ("finished", "failed"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"training did not finish: {job.status()}")
            scan()
            time.sleep(0.2)
        state, status = job.state, job.status()
    finally:
        job.stop()
        if own:
            net.close()
    rows = _rows(record)
    eff = effective_rows(rows)
    rep = check_exactly_once(rows, NUM_SAMPLES)
    return {
        "agents": agents, "state": state, "error": status["error"], "steps": status["step"],
        "first_steps_s": round(t_first, 2), "total_s": round(time.monotonic() - t0, 2),
        "changes": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()} for c in changes],
        "exactly_once": bool(rep["ok"] and rep["epochs"].get(0, {}).get("complete")),
        "missing": len(rep["epochs"].get(0, {}).get("missing", [0])),
        "duplicates": len(rep["epochs"].get(0, {}).get("duplicates", [])),
        "world_sizes": rep["world_sizes"], "replayed_rows": len(rows) - len(eff),
        "ranks_at": {str(n): sorted({r["rank"] for r in eff if r["world_size"] == n})
                     for n in rep["world_sizes"]},
        "bridge_addr": net.bridge_addr, "node_addrs": net.addrs,
        "listening": sorted(seen.values(), key=lambda s: (s["expected"], s["port"])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=3, help="namespaces (agents at the end of the join)")
    ap.add_argument("--leave", action="store_true", help="then end the newest agent (a second change)")
    ap.add_argument("--step-delay", type=float, default=0.04)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--json", default=None, help="also write the result (with the socket list) to this file")
    a = ap.parse_args(argv)
    why = netns_unavailable()
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory(prefix="bench-netns-") as d:
        out = run(d, agents=a.agents, leave=a.leave, step_delay=a.step_delay, timeout_s=a.timeout)
    wide = [s for s in out["listening"] if s["addr"] != s["expected"]]
    out["all_bound_to_own_address"] = not wide
    for c in out["changes"]:
        print(f"{c['change']}: {c['latency_s']:.2f} s to the first step at the new size (step {c['step']}); "
              + ", ".join(f"{k} {c[k]:.2f}" for k in ("drain_s", "restart_s", "first_step_s") if k in c))
    out["load_avg"] = os.getloadavg()[0]
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print("RESULT " + json.dumps({k: v for k, v in out.items() if k != "listening"}
                                 | {"listening": [f"{s['addr']}:{s['port']}" for s in out["listening"]]}))
    return 0 if out["state"] == "finished" and out["exactly_once"] and not wide else 1


if __name__ == "__main__":
    raise SystemExit(main())
