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


def test_deepspeeds_group_on_one_host_listens_on_loopback_alone():
    """The trainer's process group (actors.dist) on loopback: its store is the project's, not torch's env://."""
    port = free_port()
    code = ("import sys; from actors.dist import init_deepspeed_distributed; "
            f"init_deepspeed_distributed(0, 1, '127.0.0.1', {port}); "
            "from tests.common.test_network import listeners; print('LISTEN', listeners(int(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(port)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    found = eval(next(line for line in out.stdout.splitlines() if line.startswith("LISTEN"))[len("LISTEN "):])
    assert found and all(on_loopback(a) for a in found), f"port {port} listens on {found}"


def test_a_one_node_cluster_rendezvous_on_loopback(ray_local):
    from common.net import node_address
    host, port = ray_local.get(ray_local.remote(node_address).remote())
    assert host == LOOPBACK and port > 0
