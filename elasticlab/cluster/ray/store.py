"""A job's c10d store on the driver's node: torch's ``TCPStore`` listening on that node's Ray address only.

torch's store binds every interface when it opens its own socket, so the socket is bound here to the node's
cluster address (``ray.util.get_node_ip_address()``) and handed to the store (``master_listen_fd``).
"""
from __future__ import annotations


def node_store(timeout_s: float = 60.0):
    """``(store, host, port)``: a master ``TCPStore`` on this node's Ray address, port chosen by the OS
    (:func:`elasticlab.elastic.rendezvous.bind_store`)."""
    import ray

    from elasticlab.elastic.rendezvous import bind_store

    ip = ray.util.get_node_ip_address()
    store = bind_store(ip, 0, timeout_s=timeout_s)
    return store, ip, int(store.port)
