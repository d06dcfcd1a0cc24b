"""`python -m rlhf.run` ends through `rlhf.run.exit_now`, which skips the interpreter's teardown: it must still
wait for the run's other threads, run every atexit handler (Ray's shutdown, logging's flush) and flush what was
printed, and exit with the run's code."""
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = """
import atexit, sys, threading, time
from rlhf.run import exit_now
out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
def late():
    time.sleep(0.5)
    open(out + "/thread", "w").write("ran")
threading.Thread(target=late).start()
print("printed, not yet flushed", end="")
exit_now(5)
"""


def test_exit_now_waits_for_threads_runs_atexit_and_flushes(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 5, res.stderr
    assert res.stdout == "printed, not yet flushed"
    assert (tmp_path / "thread").read_text() == "ran" and (tmp_path / "atexit").read_text() == "ran"
