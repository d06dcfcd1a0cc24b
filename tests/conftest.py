"""Shared fixtures. One torch thread per process: on a 2-core machine more threads only contend."""
import os
import secrets
import sys
from typing import Optional

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The session's Ray (session_ray) authenticates drivers by token; run_cli's drivers inherit it. Set before Ray is
# imported: Ray reads the mode once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `make test` hands whole files to two pytest-xdist workers in this order (--dist loadfile --no-loadscope-reorder):
# roughly longest first, so neither worker is left alone with a long file at the end, and the short files fill the
# gaps. test_stages goes first: its fixture trains the shared SFT run (one core) that most e2e files wait for, while
# the other worker runs the engine tests, which do not need it.
LONGEST_FIRST = ["e2e/test_real_model.py",  # the real model: its conversion, a 2-step GRPO, a 2-step LoRA game
                 "e2e/test_stages.py",
                 "rollout/test_vllm_engine.py",
                 "e2e/test_gemma.py",  # Gemma-3-270M: download and conversion (~3 min on CI), one agreement check
                 "e2e/test_real_workloads.py",
                 "e2e/test_resume.py",
                 "e2e/test_faults.py",
                 "e2e/test_job_submit.py",
                 "e2e/test_hybrid.py",
                 "e2e/test_pipeline.py",
                 "actors/test_trainer_group.py",
                 "actors/test_multi_rank.py",
                 "test_device_script.py",
                 "test_placement.py",
                 "e2e/test_two_nodes.py",
                 "e2e/test_multiturn.py",
                 "e2e/test_agent.py",
                 "rollout/test_agent.py"]


def pytest_collection_modifyitems(config, items):
    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model + tokenizer folder, built once per test session."""
    from rlhf.config import TinyModelConfig
    from rlhf.weights.tiny import save_tiny_model
    return save_tiny_model(TinyModelConfig(), str(tmp_path_factory.mktemp("tiny") / "model"))


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


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """Ray, for tests that start actors in-process: the session's instance (see session_ray)."""
    import ray
    session_ray()
    return ray
