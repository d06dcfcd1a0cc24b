"""A restarted engine first ends the child processes its killed predecessor left behind. On GPUs vLLM's engine core
is a child process that holds its share of the GPU until it exits; Ray reaps an actor's children only when the actor
exits cleanly, and vLLM's core has no parent-death check, so after a `kill -9` or an OOM kill the orphan keeps the
memory and the restarted engine cannot allocate. Each engine records its children (pid and start time, so a reused
pid is never taken for one) in a file named by its Ray actor id, which a restart keeps, with the /dev/shm files they
map: a tensor-parallel engine's message queues and shared buffers (hundreds of MB), which nobody unlinks after a
kill."""
from __future__ import annotations

import json
import os
from typing import Optional

from common.net import cache_root


def actor_key() -> Optional[str]:
    """This Ray actor's id (the same across its restarts), or None outside an actor."""
    try:
        import ray
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - no Ray, or not in an actor
        return None


OURS = ("psm_", "sem.mp-", "vllm", "rlhf-")  # SharedMemory, multiprocessing's semaphores, vLLM's, this project's


def mapped_shm(pids: list[int]) -> set[str]:
    """The /dev/shm files that processes `pids` map and that still have a name."""
    import psutil
    paths = set()
    for pid in pids:
        try:
            paths |= {m.path for m in psutil.Process(pid).memory_maps() if m.path.startswith("/dev/shm/")}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return {p for p in paths if os.path.exists(p)}


def _pid_file(key: str) -> str:
    return os.path.join(cache_root(), "engine-children", f"{key}.json")


def reap_orphans(key: Optional[str], timeout_s: float = 30.0) -> list[int]:
    """Kill the children the previous incarnation of actor `key` recorded, where still alive; their pids."""
    import psutil

    if key is None or not os.path.isfile(_pid_file(key)):
        return []
    with open(_pid_file(key)) as f:
        recorded = json.load(f)
    recorded = recorded if isinstance(recorded, dict) else {"children": recorded, "shm": []}  # (an older file)
    found = []
    for pid, started in recorded["children"]:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 1e-3:
                found.append(proc)
        except psutil.Error:
            continue
    for proc in found:
        proc.kill()
    psutil.wait_procs(found, timeout=timeout_s)
    for path in recorded["shm"]:
        if os.path.exists(path):
            os.unlink(path)
    os.unlink(_pid_file(key))
    return [p.pid for p in found]


def record_children(key: Optional[str]) -> None:
    """Write down this process's children (recursively) for a restart of actor `key` to reap."""
    import psutil

    if key is None:
        return
    children = [(c.pid, c.create_time()) for c in psutil.Process().children(recursive=True)]
    # (its own too, taken as it starts: the executor's semaphores; only names Python's multiprocessing and vLLM
    # give, never a file of Ray's or of another program)
    shm = sorted(p for p in mapped_shm([os.getpid()] + [pid for pid, _ in children])
                 if os.path.basename(p).startswith(OURS))
    os.makedirs(os.path.dirname(_pid_file(key)), exist_ok=True)
    with open(_pid_file(key) + ".tmp", "w") as f:
        json.dump({"children": children, "shm": shm}, f)
    os.replace(_pid_file(key) + ".tmp", _pid_file(key))
