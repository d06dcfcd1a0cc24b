"""A restarted engine ends the child processes its killed predecessor left (on GPUs vLLM's engine core, which keeps
its GPU memory while it lives). The mechanism on the real Ray: an actor that, like the engine, reaps, starts a
child in a session of its own (out of reach of any process-group cleanup), and records it; it is killed with -9 and
restarted by Ray."""
import glob
import os
import signal
import subprocess
import sys
import time

import psutil

MAPS_AND_SLEEPS = ("import mmap, sys, time\n"
                   "f = open(sys.argv[1], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096)\n"
                   "open(sys.argv[1] + '.ready', 'w').close(); time.sleep(3600)\n")


class Parent:
    def __init__(self):
        from rollout.engines.reap import actor_key, reap_orphans, record_children
        key = actor_key()
        self.reaped = reap_orphans(key)
        # a child that maps a /dev/shm file, as a tensor-parallel engine's workers map their message queues
        self.shm = f"/dev/shm/rlhf-reap-test-{os.getpid()}"  # (its ".ready" beside it: the map is made)
        self.child = subprocess.Popen([sys.executable, "-c", MAPS_AND_SLEEPS, self.shm], start_new_session=True)
        while not os.path.exists(self.shm + ".ready"):
            time.sleep(0.05)
        record_children(key)

    def pids(self) -> tuple[int, int, list[int], str]:
        return os.getpid(), self.child.pid, self.reaped, self.shm


def test_a_restarted_actor_ends_the_children_its_killed_predecessor_left(ray_local, tmp_path, monkeypatch):
    from common.remote import make_actor
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))  # the pid files go under the cache
    actor = make_actor(Parent, "rollout engine 0", {"max_restarts": 1, "max_task_retries": -1,
                                                   "runtime_env": {"env_vars": {"RLHF_CACHE_DIR": str(tmp_path)}}})
    try:
        host, orphan, reaped, shm = ray_local.get(actor.pids.remote(), timeout=120)
        assert reaped == [] and psutil.pid_exists(orphan) and os.path.exists(shm)
        os.kill(host, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # calls fail while Ray restarts the actor
            try:
                host2, child2, reaped, shm2 = ray_local.get(actor.pids.remote(), timeout=30)
                break
            except Exception:  # noqa: BLE001
                assert time.monotonic() < deadline, "the actor was not restarted"
                time.sleep(0.5)
        assert host2 != host and reaped == [orphan]
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        assert psutil.pid_exists(child2)
        assert not os.path.exists(shm)  # the file the orphan mapped is unlinked with it
    finally:
        ray_local.kill(actor)
        for p in psutil.process_iter(["cmdline"]):
            if p.info["cmdline"] and MAPS_AND_SLEEPS in p.info["cmdline"]:
                p.kill()
        for path in glob.glob("/dev/shm/rlhf-reap-test-*"):
            os.unlink(path)
