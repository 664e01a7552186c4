"""A job's c10d store on the driver's node: torch's ``TCPStore`` listening on that node's Ray address only.

torch's store binds every interface when it opens its own socket, so the socket is bound here to the node's
cluster address (``ray.util.get_node_ip_address()``) and handed to the store (``master_listen_fd``).
"""
from __future__ import annotations

import datetime
import socket


def node_store(timeout_s: float = 60.0):
    """``(store, host, port)``: a master ``TCPStore`` on this node's Ray address, port chosen by the OS."""
    import ray
    import torch.distributed as dist

    ip = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
        sock.listen(128)
        store = dist.TCPStore(ip, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now
    return store, ip, int(store.port)
