"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for tests, the benchmark
and the notebook: each node a raylet of its own with ``slots`` of the slot resource.

A raylet waits a fixed 15 s for each port its Python helper agent reports at start-up and aborts when a
busy machine makes the agent miss it. Here every node's agent ports are chosen before it starts and given to
its raylet too (Ray passes three of them; the fourth, the agent's HTTP port, is added to the raylet's
command line by :func:`_agent_ports_given`), so no raylet waits for a port file; a node start that fails
all the same is tried again (``attempts`` times), after ending the processes it left behind. That is the
one private Ray name used here (``ray._private.services.start_ray_process``, wrapped while nodes start): no
public API hands the raylet that port.

Removing a node (:func:`kill_node`, :func:`kill_busy_node`) ends its raylet's worker processes by pid too;
ending the cluster (:func:`shutdown`) ends every process of its session by pid, found from ``/proc`` by the
session directory (:func:`session_processes`), so that no Ray process outlives a test, passed or failed.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import time


def _check(**values) -> None:
    for name, (v, lo) in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def _slots(resource: str, slots: int) -> dict:
    """Ray's node arguments for ``slots`` of ``resource``: GPUs have their own keyword (Ray refuses "GPU" in
    ``resources``), any other name is a custom resource."""
    return {"num_gpus": slots} if resource == "GPU" else {"resources": {resource: slots}}


def local_cluster(nodes: int = 3, slots: int = 2, *, resource: str = "slot", num_cpus: int = 0,
                  attempts: int = 5, connect: bool = True, worker_niceness: int = 0):
    """Start ``nodes`` Ray nodes with ``slots`` of ``resource`` each and ``num_cpus`` CPUs (the jobs' actors
    ask for none; 0 also spares a prestarted Ray worker per node); ``connect``: ``ray.init`` the driver to
    it. ``worker_niceness``: the nice value of Ray's worker processes, which here run the jobs' training.
    Ray's default, 15, lets any other busy process on this one machine starve them; 0 shares the CPU
    fairly with the driver and the notebook. Returns the ``Cluster`` (``remove_node``, ``shutdown``; its
    nodes in ``list_all_nodes()``)."""
    _check(nodes=(nodes, 1), slots=(slots, 1), num_cpus=(num_cpus, 0), attempts=(attempts, 1),
           worker_niceness=(worker_niceness, 0))
    import ray
    from ray.cluster_utils import Cluster

    args = {"num_cpus": num_cpus, **_slots(resource, slots)}
    cluster = None
    for k in range(attempts):  # the head node (GCS and the first raylet)
        before = _children()
        try:
            with _agent_ports_given():
                cluster = Cluster(initialize_head=True, head_node_args={
                    **args, **_ports(), "include_dashboard": False,
                    "_system_config": {"worker_niceness": int(worker_niceness)}})
            break
        except Exception as e:  # a raylet that missed its agents' start-up window: start again
            _end_new(before)
            with contextlib.suppress(Exception):
                ray.shutdown()
            if k == attempts - 1:
                raise RuntimeError(f"could not start a Ray head node in {attempts} attempts: {e!r}") from e
            time.sleep(1.0 + k)
    try:
        for _ in range(nodes - 1):
            add_node(cluster, slots, resource=resource, num_cpus=num_cpus, attempts=attempts)
        if connect:
            ray.init(address=cluster.address, log_to_driver=False, include_dashboard=False)
    except BaseException:
        shutdown(cluster)
        raise
    return cluster


def add_node(cluster, slots: int = 2, *, resource: str = "slot", num_cpus: int = 0, attempts: int = 5):
    """Add one node of ``slots`` to ``cluster`` (tried ``attempts`` times); returns it."""
    _check(slots=(slots, 1), num_cpus=(num_cpus, 0), attempts=(attempts, 1))
    for k in range(attempts):
        before = _children()
        try:
            with _agent_ports_given():
                node = cluster.add_node(num_cpus=num_cpus, **_slots(resource, slots), **_ports())
            cluster.wait_for_nodes()
            return node
        except Exception as e:
            _end_new(before)
            if k == attempts - 1:
                raise RuntimeError(f"could not add a Ray node in {attempts} attempts: {e!r}") from e
            time.sleep(1.0 + k)


def kill_node(cluster, node_id: str) -> None:
    """Remove node ``node_id`` of ``cluster`` as a machine failure would: its raylet and agents end
    (``remove_node``, no grace) and so do the worker processes it started, which on one machine would
    otherwise outlive their raylet (an actor busy in a method keeps training with its gloo peers)."""
    import psutil

    node = next((x for x in cluster.list_all_nodes() if x.node_id == node_id), None)
    if node is None:
        raise ValueError(f"no node {node_id!r} in this cluster")
    workers = []
    for info in node.all_processes.get("raylet", []):
        with contextlib.suppress(psutil.Error):
            workers += psutil.Process(info.process.pid).children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    for p in workers:
        with contextlib.suppress(psutil.Error):
            p.kill()


def kill_busy_node(cluster, scheduler, *, ready=None, exclude=(), timeout_s: float = 300.0,
                   poll_s: float = 0.2) -> tuple[str, list[str]]:
    """Remove (:func:`kill_node`) a node on which a job trains at that moment, the choice and the kill made
    together: inside ``scheduler.hold()`` (a :class:`~elasticlab.cluster.ray.RayCluster`; no request goes
    out meanwhile, so no generation ends but by a fault or its finish), the node hosting a rank of the most
    jobs whose :meth:`~elasticlab.cluster.ray.RayJob.live_nodes` are steady and for which ``ready(name,
    status)`` holds (e.g. a checkpoint behind it and work ahead), leaving out ``exclude`` (e.g. the head
    node). Tried every ``poll_s`` until ``timeout_s`` or the end of every job, then TimeoutError. Returns
    ``(node_id, jobs)``:
    the jobs that had a worker on it."""
    end = time.monotonic() + timeout_s
    while True:
        with scheduler.hold():
            on: dict[str, list[str]] = {}
            for name in [row["name"] for row in scheduler.jobs()]:
                h = scheduler.job(name)
                nodes = h.live_nodes() if h is not None and hasattr(h, "live_nodes") else []
                if nodes and (ready is None or ready(name, h.status())):
                    for node in set(nodes) - set(exclude):
                        on.setdefault(node, []).append(name)
            if on:
                victim = max(sorted(on), key=lambda n: len(on[n]))
                kill_node(cluster, victim)
                return victim, sorted(on[victim])
        if time.monotonic() > end or scheduler.wait(timeout=0):
            raise TimeoutError(f"no node hosted a ready, steadily training job within {timeout_s} s "
                               f"(or every job ended): {scheduler.jobs()}")
        time.sleep(poll_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ports() -> dict:
    """A node's agent ports, chosen now (free at this moment) instead of by the agents at start-up."""
    names = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
             "runtime_env_agent_port")
    return {k: _free_port() for k in names}


@contextlib.contextmanager
def _agent_ports_given():
    """While nodes start: give each raylet its agent's HTTP port (``--dashboard_agent_listen_port``, which
    Ray's launcher leaves out), read from the agent command the raylet is given."""
    from ray._private import services

    start = services.start_ray_process

    def start_with_port(command, process_type, *args, **kwargs):
        if process_type == "raylet":
            for arg in command:
                m = re.search(r"--listen-port=(\d+)", arg) if arg.startswith("--dashboard_agent_command=") \
                    else None
                if m and int(m.group(1)) > 0:
                    command = [*command, f"--dashboard_agent_listen_port={m.group(1)}"]
                    break
        return start(command, process_type, *args, **kwargs)

    services.start_ray_process = start_with_port
    try:
        yield
    finally:
        services.start_ray_process = start


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _end_new(before: set[int]) -> None:
    """End the processes a failed node start left behind: this process's children that are new since
    ``before`` (a head's GCS, a raylet's agents), by pid."""
    import psutil

    for pid in _children() - before:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def session_dir(cluster) -> str:
    """The Ray session directory of ``cluster`` (its head node's): every process of the cluster names it
    on its command line or holds a file in it open (logs, sockets)."""
    return cluster.head_node.get_session_dir_path()


def session_processes(session: str, *, name: str | None = None) -> list:
    """The live processes of the Ray session whose directory is ``session`` (from :func:`session_dir`):
    its GCS, raylets and agents (the directory on their command lines) and its workers (a log file in it
    open), zombies left out; ``name``: only the workers whose title starts with ``ray::<name>`` (an actor
    class). Read from ``/proc``, not from Ray, so it sees workers that outlived their raylet."""
    import psutil

    session = session.rstrip("/")
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            cmd = p.info["cmdline"] or []
            if name is not None and not (cmd and cmd[0].startswith(f"ray::{name}")):
                continue
            if any(c.endswith(session) or session + "/" in c for c in cmd) or \
                    _holds_file_in(p.pid, session + "/"):
                out.append(p)
    return out


def _holds_file_in(pid: int, directory: str) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory):
                    return True
    return False


def shutdown(cluster, timeout_s: float = 10.0) -> None:
    """Disconnect the driver and end every node of ``cluster`` and every process of its session, by pid:
    the raylets' worker processes (which on one machine could outlive them), and then whatever of the
    session is still alive (:func:`session_processes`: a worker of a removed node, an agent a failed
    start left). Safe to call twice; raises if a process of the session survives ``timeout_s``."""
    import psutil
    import ray

    if cluster.head_node is None:  # shut down already
        return
    session = session_dir(cluster)
    workers = []
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get("raylet", []):
            with contextlib.suppress(psutil.Error):
                workers += psutil.Process(info.process.pid).children(recursive=True)
    with contextlib.suppress(Exception):
        ray.shutdown()
    try:
        cluster.shutdown()
    finally:
        left = workers + session_processes(session)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, alive = psutil.wait_procs(left, timeout=timeout_s)
        alive = [p for p in alive if _running(p)]
        if alive:
            raise RuntimeError(f"Ray processes of {session} still alive after shutdown: "
                               f"{[p.pid for p in alive]}")


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
