"""Closed by default: on one host the rendezvous stores (weight sync, DeepSpeed's group) listen on loopback alone;
torch's own TCPStore server listens on every interface whatever host it is given."""
import os
import subprocess
import sys

from common.net import LOOPBACK, free_port, tcp_store
from tests.helpers import ROOT


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of the sockets listening on `port` in this network
    namespace, IPv4 and IPv6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def on_loopback(address: str) -> bool:
    return address == "0100007F" or address == "00000000000000000000000001000000"  # 127.0.0.1, ::1


def test_a_store_on_loopback_listens_on_loopback_alone():
    port = free_port()
    store = tcp_store(LOOPBACK, port, is_master=True, timeout_s=10)
    found = listeners(port)
    assert found and all(on_loopback(a) for a in found), f"port {port} listens on {found}"
    client = tcp_store(LOOPBACK, port, is_master=False, timeout_s=10)
    store.set("k", "v")
    assert client.get("k") == b"v"


def _group_listeners(world_size: int, port: int) -> list[str]:
    """Rank 0 of a `world_size` DeepSpeed group on loopback (actors.dist), each rank a process: what listens on
    `port` once the group is up."""
    code = ("import sys; from actors.dist import init_deepspeed_distributed; "
            "rank, world, port = map(int, sys.argv[1:]); init_deepspeed_distributed(rank, world, '127.0.0.1', port); "
            "from tests.common.test_network import listeners; import torch.distributed as d; "
            "print('LISTEN', listeners(port) if rank == 0 else []); d.barrier()")
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world_size), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world_size)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return eval(next(line for line in outs[0][0].splitlines() if line.startswith("LISTEN"))[len("LISTEN "):])


def test_deepspeeds_group_on_one_host_listens_on_loopback_alone_and_a_single_rank_on_nothing():
    """The trainer's process group (actors.dist): two ranks meet at the project's loopback store, not torch's
    env://; one rank has nobody to meet, so it opens no port at all (none a racing process could take first)."""
    port = free_port()
    found = _group_listeners(2, port)
    assert found and all(on_loopback(a) for a in found), f"port {port} listens on {found}"
    port = free_port()
    assert _group_listeners(1, port) == []


def test_a_held_port_is_given_to_no_other_bind_and_our_store_listens_on_it():
    """reserve_port: between choosing the port and the store listening, no other bind (a plain one, or any bind
    to port 0) gets it; the store's own listener binds beside the hold and takes the port over."""
    import socket

    from common.net import _HELD, release_port, reserve_port
    port = reserve_port()
    other = socket.socket()
    try:
        other.bind((LOOPBACK, port))
        raise AssertionError(f"a plain bind took held port {port}")
    except OSError:
        pass
    finally:
        other.close()
    for _ in range(2000):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            assert s.getsockname()[1] != port
    store = tcp_store(LOOPBACK, port, is_master=True, timeout_s=10)
    assert port not in _HELD and listeners(port)
    tcp_store(LOOPBACK, port, is_master=False, timeout_s=10).set("k", "v")
    assert store.get("k") == b"v"
    release_port(port)  # a no-op once the store took it


def test_a_one_node_cluster_rendezvous_on_loopback_with_the_port_left_to_the_driver(ray_local):
    from actors.group import _rendezvous
    from common.net import node_address, release_port
    assert ray_local.get(ray_local.remote(_rendezvous).remote()) == (LOOPBACK, None)
    host, port = node_address()
    assert host == LOOPBACK and port > 0
    release_port(port)
