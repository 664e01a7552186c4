"""``python -m elasticlab.cluster.torchrun``: one torchrun worker, or the ``store`` / ``agent`` commands
that run the same pieces by hand, one per host."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from elasticlab.cluster.torchrun.job import agent_command
from elasticlab.elastic.rendezvous import (
    TOKEN_ENV,
    bind_store,
    check_token,
    split_endpoint,
)


def store_main(argv) -> int:
    """``store --bind HOST:PORT``: host a rendezvous store on that address only, until SIGTERM/SIGINT.
    Prints ``{"event": "store", "host", "port", "pid"}``. A non-loopback HOST needs the token
    (``$ELASTICLAB_TORCHRUN_TOKEN``)."""
    ap = argparse.ArgumentParser(prog="python -m elasticlab.cluster.torchrun store",
                                 description="host the c10d rendezvous store of torchrun agents")
    ap.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0)")
    a = ap.parse_args(argv)
    host, port = split_endpoint(a.bind)
    try:
        check_token(host, os.environ.get(TOKEN_ENV) or None, "--bind address")
    except ValueError as exc:
        ap.error(str(exc))
    store = bind_store(host, port)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(json.dumps({"event": "store", "host": host, "port": int(store.port), "pid": os.getpid()}),
          flush=True)
    done.wait()
    return 0


def agent_main(argv) -> int:
    """``agent --endpoint HOST:PORT [--local-addr ADDR] [--nnodes MIN:MAX] [--name N] -- SCRIPT ARGS``:
    exec one torchrun agent the way :class:`TorchrunJob` starts them (see :func:`agent_command`)."""
    ap = argparse.ArgumentParser(prog="python -m elasticlab.cluster.torchrun agent",
                                 description="one torchrun agent joining a store hosted with `store`")
    ap.add_argument("--endpoint", required=True, help="HOST:PORT of the rendezvous store")
    ap.add_argument("--local-addr", default="127.0.0.1",
                    help="this host's cluster address (default 127.0.0.1)")
    ap.add_argument("--nnodes", default="1:2")
    ap.add_argument("--name", default="job", help="the job's name (same on every host)")
    ap.add_argument("--max-restarts", type=int, default=50)
    ap.add_argument("target", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (or -- -m MODULE ARGS)")
    a = ap.parse_args(argv)
    target = a.target[1:] if a.target[:1] == ["--"] else a.target
    if not target:
        ap.error("give the training script after --")
    try:
        cmd, env = agent_command(a.endpoint, a.local_addr, a.nnodes, target, name=a.name,
                                 token=os.environ.get(TOKEN_ENV) or None, max_restarts=a.max_restarts)
    except ValueError as exc:
        ap.error(str(exc))
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 1  # not reached


def main(argv=None) -> int:
    """One torchrun worker: :func:`elasticlab.elastic.worker.torchrun_main` with JSON step lines (or the
    ``store`` / ``agent`` commands, see :func:`store_main`, :func:`agent_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["store"]:
        return store_main(argv[1:])
    if argv[:1] == ["agent"]:
        return agent_main(argv[1:])
    from elasticlab.elastic.worker import torchrun_main

    ap = argparse.ArgumentParser(description="one torchrun worker of a LocalCluster job")
    ap.add_argument("--entrypoint", required=True)
    ap.add_argument("--entry-kwargs", default="{}")
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--record-samples", default=None)
    ap.add_argument("--options", default="{}")
    a = ap.parse_args(argv)
    opts = json.loads(a.options)
    out = torchrun_main(a.entrypoint, checkpoint_dir=a.checkpoint_dir, record_samples=a.record_samples,
                        entry_kwargs=json.loads(a.entry_kwargs), log_steps=True, **opts)
    # torchrun_main also returns when its agent ends it for a membership change (it checkpoints and
    # leaves): the job is done only if the newest checkpoint has all its work
    from elasticlab.elastic.checkpoint import CheckpointDir
    from elasticlab.elastic.checkpoint import load as load_checkpoint

    path, _ = CheckpointDir(a.checkpoint_dir).latest()
    state = load_checkpoint(path) if path is not None else {"step": 0, "sampler": {"epoch": 0}}
    max_steps = opts.get("max_steps")
    complete = (max_steps is not None and int(state["step"]) >= max_steps) or \
        int(state["sampler"]["epoch"]) >= int(opts.get("epochs", 1))
    print(json.dumps({"event": "done" if complete else "left", **out}), flush=True)
    return 0


def exit_now(code: int = 0) -> None:
    """End a torchrun worker without the interpreter's teardown: torchrun waits for the worker's exit
    before it re-rendezvous, and the teardown (scikit-learn's and OpenMP's exit handlers among others)
    took 2-10 s of every membership change on 2 loaded cores. Everything the worker keeps is written
    by then (checkpoints are fsynced, the sample record closed, the group destroyed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
