"""The cluster's decisions driving a job launched under ``torchrun`` (c10d rendezvous), one agent per slot.

:class:`TorchrunJob` has the job-handle interface :class:`~elasticlab.cluster.LocalCluster` uses
(``status``, ``step_times``, ``metrics``, ``events``, ``resize``, ``pause``, ``resume``, ``stop``), so the
same scheduling loop drives it. Each slot is one elastic agent (``python -m torch.distributed.run
--nnodes=1:MAX --nproc-per-node=1 --rdzv_backend=c10d``), standing for one node; no cluster manager of our
own: membership is torchrun's rendezvous.

* grow: start more agents on the same rendezvous; torchrun restarts the workers at the new world size and
  they resume from the newest valid checkpoint (:func:`elasticlab.elastic.worker.torchrun_main`);
* shrink: end the newest agents with their workers (the rendezvous store is hosted by this object);
  the survivors' collectives fail, their agents re-rendezvous without them and resume likewise;
* pause: end every agent; resume: a fresh rendezvous at ``n`` agents.

Steps since the last checkpoint are replayed after a membership change; the sample record keeps the replay
(rows of the latest generation count, :func:`elasticlab.elastic.effective_rows`). The batch is the task's
(``torchrun_main`` has no way to set it on a running job), so torchrun jobs run in fixed-batch mode.
Run as ``python -m elasticlab.cluster.torchrun --entrypoint ... --checkpoint-dir ...`` it is the worker.

Addresses. Nothing here listens on every interface (torch's ``TCPStore`` does, whatever host it is given,
so the sockets are bound here and handed to it, :func:`bind_store`): the rendezvous store listens on
``host`` (127.0.0.1 by default, or the cluster address for agents on other hosts), each agent advertises its
``--local-addr``, the rank-0 worker's store listens on that address (:func:`worker_store`) and gloo on the
interface that holds it. A non-loopback address needs the shared token (``ELASTICLAB_TORCHRUN_TOKEN``,
:func:`check_token`): it names every rendezvous and worker-store key (:func:`rdzv_id`), and travels by
environment, never on a command line. ``python -m elasticlab.cluster.torchrun store --bind HOST:PORT`` and
``... agent --endpoint HOST:PORT --local-addr ADDR --nnodes MIN:MAX -- SCRIPT ARGS`` run the same pieces
by hand, one per host.
"""
from elasticlab.cluster.torchrun.cli import agent_main, exit_now, main, store_main
from elasticlab.cluster.torchrun.job import TorchrunJob, agent_command, start_torchrun_job
from elasticlab.elastic.rendezvous import (
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    bind_store,
    check_token,
    interface_of,
    is_loopback,
    listening_sockets,
    rdzv_id,
    source_address,
    split_endpoint,
    token_digest,
    worker_store,
)

__all__ = [
    "TorchrunJob", "start_torchrun_job", "agent_command", "main", "store_main", "agent_main", "exit_now",
    "TOKEN_ENV", "MIN_TOKEN_CHARS", "is_loopback", "check_token", "token_digest", "rdzv_id", "split_endpoint",
    "bind_store", "interface_of", "source_address", "worker_store", "listening_sockets",
]
