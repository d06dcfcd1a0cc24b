"""Shared fixtures. One torch thread per process: on a 2-core machine more threads only contend."""
import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model + tokenizer folder, built once per test session."""
    from rlhf.config import TinyModelConfig
    from rlhf.tiny import save_tiny_model
    return save_tiny_model(TinyModelConfig(), str(tmp_path_factory.mktemp("tiny") / "model"))


def run_cli(*args: str, timeout: float = 600, cwd: str = ROOT):
    """`python -m rlhf.run ...` as a subprocess; returns the CompletedProcess (text mode)."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "rlhf.run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


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


@pytest.fixture(scope="module")
def ray_local():
    """A private local Ray instance (never joins another cluster); 4 logical CPUs so actors asking 0.5 fit, and 2
    logical GPUs so placement logic runs on a CPU host (torch still sees no CUDA)."""
    import ray
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()
