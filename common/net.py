"""Addresses and folders on this host: a free port, this node's IP, the project's cache folder."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A port free now, released: any process may take it before its user binds it (`reserve_port` may not)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK = "127.0.0.1"
_HELD: dict[int, socket.socket] = {}


def reserve_port() -> int:
    """A free loopback port this process holds (bound with SO_REUSEADDR, not listening) until `release_port`, or
    until a `tcp_store` master in this process binds it beside the hold. While it is held the kernel hands it to no
    other bind, so a vLLM worker, a Ray worker or another run starting at the same moment cannot take the port
    between our choosing it and our store listening on it (a `free_port` port is open to them all along)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    port = sock.getsockname()[1]
    _HELD[port] = sock
    return port


def release_port(port: int) -> None:
    held = _HELD.pop(port, None)
    if held is not None:
        held.close()


def node_host() -> str:
    """Where a rendezvous (DeepSpeed group, sync group) started on this node listens: loopback when the Ray cluster
    is this one node (nothing off the host can then reach the store: `tcp_store`), else this node's IP (the stores
    then accept anyone who can reach the port: a trusted network, docs/configuration.md)."""
    import ray
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return LOOPBACK if len(alive) <= 1 else ray.util.get_node_ip_address()


def node_address() -> tuple[str, int]:
    """`node_host()` and a port for a store this process will listen on: held (`reserve_port`) on loopback."""
    host = node_host()
    return host, (reserve_port() if host == LOOPBACK else free_port())


def tcp_store(host: str, port: int, is_master: bool, world_size=None, timeout_s: float = 300.0):
    """A torch TCPStore at host:port. torch's server listens on every interface whatever `host` says; on a
    loopback `host` the master here listens on a socket bound to loopback alone (torch's `master_listen_fd`)."""
    import datetime

    import torch.distributed as dist

    fd = None
    if is_master and host in (LOOPBACK, "localhost"):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        release_port(port)  # bound beside the hold (if this process held it): the listener keeps the port now
        fd = sock.detach()  # the store owns the descriptor from here (closing the socket object would close it)
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd)


def cache_root() -> str:
    """The project's cache folder (DeepSpeed op builds, vLLM and inductor caches): the user's, not the checkout's,
    so a `ray job submit --working-dir .` job (which runs in a fresh copy of the checkout, git-ignored files left
    out) does not rebuild DeepSpeed's C++ ops every time; RLHF_CACHE_DIR overrides it."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RLHF_CACHE_DIR", os.path.join(user_cache, "rlhf-orchestra"))


def send_json(handler, status: int, body: dict) -> None:
    """Answer an http.server request with `body` as JSON; a client that already hung up (its own timeout) is let go."""
    import json
    data = json.dumps(body).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
