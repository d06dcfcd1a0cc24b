"""Addresses and folders on this host: a free port, this node's IP, the project's cache folder."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_address() -> tuple[str, int]:
    """This node's IP and a free port on it: where a rendezvous (DeepSpeed group, sync group) can listen."""
    import ray
    return ray.util.get_node_ip_address(), free_port()


def cache_root() -> str:
    """The project's cache folder (DeepSpeed op builds, vLLM and inductor caches): the user's, not the checkout's,
    so a `ray job submit --working-dir .` job (which runs in a fresh copy of the checkout, git-ignored files left
    out) does not rebuild DeepSpeed's C++ ops every time; RLHF_CACHE_DIR overrides it."""
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RLHF_CACHE_DIR", os.path.join(user_cache, "rlhf-orchestra"))
