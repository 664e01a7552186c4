"""torchrun across hosts: agents in Linux network namespaces joined by a bridge (issue 17).

The controller hosts the c10d rendezvous store on the bridge's address in the root namespace; agents run
under ``ip netns exec``, each advertising its namespace's address, so the rendezvous, the workers' store
and gloo cross veth pairs and a bridge rather than loopback. One agent trains, a second joins from
another namespace mid-epoch (``--nnodes 1:2``; two namespaces keep it near 60 s on 2 cores, the
benchmark runs three and a leave). Checked: training finishes; every sample of the epoch is seen exactly
once apart from counted replays; every listening socket of the job is bound to its own namespace's
address (never 0.0.0.0, ::, or loopback); the join's latency (resize call -> first step at the new size)
and its phases are printed as ``RESULT {json}`` (``pytest -s``).
Needs root and ``ip netns``: skipped otherwise. The scenario is ``benchmarks/bench_torchrun_netns.py``.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_torchrun_netns as bench  # noqa: E402


def _links_and_namespaces() -> str:
    return (subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
            + subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)


@pytest.fixture
def netns():
    why = bench.netns_unavailable()
    if why:
        pytest.skip(why)
    net = bench.Netns(2)
    yield net
    net.close()
    left = _links_and_namespaces()
    assert net.bridge not in left and not any(n in left for n in net.names), left


def test_netns_setup_is_removed_on_close():
    why = bench.netns_unavailable()
    if why:
        pytest.skip(why)
    with bench.Netns(2) as net:
        here = _links_and_namespaces()
        assert net.bridge in here and all(n in here for n in net.names)
        got = subprocess.run(["ip", "-n", net.names[1], "-4", "-o", "addr"], capture_output=True, text=True)
        assert net.addrs[1] in got.stdout and net.addrs[0] not in got.stdout   # a namespace of its own
    left = _links_and_namespaces()
    assert net.bridge not in left and not any(n in left for n in net.names)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_agents_across_network_namespaces_with_a_join(netns, tmp_path, monkeypatch):
    monkeypatch.chdir(bench.ROOT)
    out = bench.run(str(tmp_path), agents=2, step_delay=0.03, timeout_s=200, netns=netns)
    print("RESULT " + json.dumps({k: v for k, v in out.items() if k != "listening"}))
    assert out["state"] == "finished", out["error"]
    assert out["exactly_once"], (out["missing"], out["duplicates"])
    assert out["world_sizes"][:2] == [1, 2], out["world_sizes"]
    assert out["ranks_at"]["2"] == [0, 1], out["ranks_at"]
    (join,) = out["changes"]
    assert join["world_size"] == 2 and 0 < join["latency_s"] < 120, join
    # what listened, and where: the controller's store on the bridge; stores and gloo in the namespaces
    listening = out["listening"]
    assert not [s for s in listening if s["addr"] != s["expected"]], listening
    assert any(s["addr"] == netns.bridge_addr for s in listening), listening
    assert {s["addr"] for s in listening} & set(netns.addrs), listening
    assert not [s for s in listening if s["addr"] in ("0.0.0.0", "::") or s["addr"].startswith("127.")]
