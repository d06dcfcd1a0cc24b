"""Shared fixtures, the test lanes and the order `make test` runs files in. Helpers are tests/helpers.py, fixture
code (environments, agents, foreign checkpoints) tests/fixtures/. One torch thread per process: on a 2-core machine
more threads only contend."""
import os
import secrets
import sys

import pytest

from tests.helpers import session_ray

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The session's Ray (session_ray) authenticates drivers by token; run_cli's drivers inherit it. Set before Ray is
# imported: Ray reads the mode once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))

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
                 "benchmarks/test_device_script.py",
                 "rlhf/rl/test_placement.py",
                 "e2e/test_two_nodes.py",
                 "e2e/test_multiturn.py",
                 "e2e/test_agent.py",
                 "rollout/test_agent.py"]


def pytest_collection_modifyitems(config, items):
    """The lanes, by where a test is and what it uses: `e2e` (tests/e2e/: whole runs of python -m rlhf.run) and
    `ray` (it starts Ray actors, or a run that joins the session's Ray); `make test-fast` runs neither, nor `slow`.
    Then the order above."""
    for item in items:
        if item.nodeid.startswith("tests/e2e/"):
            item.add_marker(pytest.mark.e2e)
        calls = set(getattr(getattr(item, "function", None), "__code__", compile("", "", "exec")).co_names)
        if "ray_local" in getattr(item, "fixturenames", ()) or calls & {"run_cli", "session_ray"}:
            item.add_marker(pytest.mark.ray)  # (run_cli's runs join the session's Ray, which starts it)
    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model + tokenizer folder, built once per test session."""
    from rlhf.config import TinyModelConfig
    from rlhf.weights.tiny import save_tiny_model
    return save_tiny_model(TinyModelConfig(), str(tmp_path_factory.mktemp("tiny") / "model"))


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """Ray, for tests that start actors in-process: the session's instance (see session_ray)."""
    import ray
    session_ray()
    return ray
