"""What tests share besides fixtures: the repository's root, running the CLI (as a subprocess joining the session's
Ray, or in this process), the session's one Ray instance, and reading a live run."""
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 600, cwd: str = ROOT, env: Optional[dict] = None):
    """`python -m rlhf.run ...` as a subprocess that joins the session's Ray (session_ray), with `env` added to
    this process's environment; returns the CompletedProcess (text mode)."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_ADDRESS=session_ray(), **(env or {}))
    return subprocess.run([sys.executable, "-m", "rlhf.run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def child_commands(pid=None) -> list:
    """(process, command line) of each descendant of `pid` (this process by default) still alive: one that exits
    while they are listed is left out (reading its command line would raise)."""
    import psutil
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in children:
        try:
            found.append((p, " ".join(p.cmdline())))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return found


def logged_rows(run_dir) -> int:
    """How many rows the run's metrics.jsonl holds: 0 while it is not written yet or its newest line is half
    written (a reader polling a live run sees either)."""
    from rlhf.outputs.metrics import read_metrics
    try:
        return len(read_metrics(str(run_dir)))
    except (OSError, ValueError):
        return 0


def cli_in_process(*args: str, cwd: str = ROOT):
    """`rlhf.run.main(args)` in this process (no interpreter start-up, imports already warm): the return code and
    what it printed. An exception escaping main() fails the calling test, as a traceback would."""
    import contextlib
    import io

    from rlhf.run import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def session_ray() -> str:
    """The test run's one local Ray instance, started on first use and stopped when the session ends; returns its
    address. 4 logical CPUs, so actors asking 0.5 fit, and 2 logical GPUs so placement logic runs on a CPU host
    (torch still sees no CUDA). In-process tests use it (`ray_local`), `run_cli` runs join it (RAY_ADDRESS): each
    saves its own Ray start. A test that needs Ray to itself (its own cluster) calls `ray.shutdown()` first."""
    import ray

    from common.remote import python_path
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path(ROOT)}})
    return ray.get_runtime_context().gcs_address


def check_trace(run_dir, rows: list) -> None:
    """logging.trace on a finished RL run: its trace parses, with a track for the driver, the steps, and each engine
    and trainer; each step's phases sum to its wall time within 5% (or 50 ms: a tiny recipe's step of under a second,
    beside the rest of the suite, loses that much to the driver's own bookkeeping) and the driver's spans agree with
    `time/*`; the busy fractions are fractions."""
    from common.timeline import DRIVER, STEPS, read_trace
    events = read_trace(os.path.join(str(run_dir), "trace.json"))
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {DRIVER, STEPS} <= set(tracks.values()), tracks
    assert any(t.startswith("rollout engine") for t in tracks.values()), tracks
    assert any(t.startswith("policy trainer") for t in tracks.values()), tracks
    spans = [e for e in events if e["ph"] == "X"]
    for row in (r for r in rows if "time/step" in r):
        step = next(e for e in spans if e["name"] == f"step {row['step']}")
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in spans if lo <= e["ts"] and e["ts"] + e["dur"] <= hi + 1e3 and e is not step]
        driver = sum(e["dur"] for e in inside if tracks[e["tid"]] == DRIVER) / 1e6
        phases = row["time/step"] - row["time/other"]
        slack = max(0.05 * row["time/step"], 0.05)
        assert row["time/other"] <= slack, row
        assert abs(driver - phases) <= slack, (driver, phases)
        assert all(0.0 <= v <= 1.0 for k, v in row.items() if k.startswith("util/") and k != "util/workers")
    check_worker_spans(spans, tracks, rows)


def check_worker_spans(spans: list, tracks: dict, rows: list) -> None:
    """The workers' own spans (common.spans), each on a track beside its actor's calls: a trainer's forward,
    backward, optimizer and update, an engine's generate or advance, each inside a call the driver made to that
    actor; the utilisation they give is a fraction above 0."""
    from common.timeline import INSIDE
    inner = [e for e in spans if tracks[e["tid"]].endswith(INSIDE)]
    names = {(tracks[e["tid"]].split()[0], e["name"]) for e in inner}
    assert {("policy", "forward"), ("policy", "backward"), ("policy", "optimizer"), ("policy", "update")} <= names
    assert {("rollout", "generate"), ("rollout", "advance")} & names, names
    calls: dict = {}
    for e in spans:
        calls.setdefault(tracks[e["tid"]], []).append(e)
    for e in inner:  # (the driver's call spans start when it waits, after it sent the step's calls: 20 ms slack)
        assert any(c["ts"] <= e["ts"] + 2e4 and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + 2e4
                   for c in calls[tracks[e["tid"]].removesuffix(INSIDE)]), e
    perf = [v for r in rows for k, v in r.items() if k in ("perf/policy_trainer_mfu", "perf/prefill_mfu")]
    assert perf and all(0.0 < v <= 1.0 for v in perf), perf
