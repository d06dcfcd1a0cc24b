"""The GPU device script's rehearsal on CPU: a lent GPU gives 15 minutes in all, so the script must not be the
first place its import path runs. On the device the project's packages are wheels installed with `pip --target`
into a folder on PYTHONPATH, under a system interpreter that has none of them: here the same layout is this venv's
site-packages on PYTHONPATH under the interpreter the venv was made from."""
import json
import os
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import ROOT


def bare_python() -> str:
    """The interpreter without the venv's packages (as the device's python3 is without ray and deepspeed)."""
    return getattr(sys, "_base_executable", sys.executable)


@pytest.mark.slow
def test_the_gpu_check_runs_its_rows_from_packages_on_pythonpath_under_a_bare_interpreter(tmp_path):
    base = bare_python()
    if subprocess.run([base, "-c", "import ray"], capture_output=True).returncode == 0:
        pytest.fail(f"{base} has ray installed itself: it does not rehearse the device's layout")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=os.pathsep.join([sysconfig.get_paths()["purelib"], ROOT]), PYTHONUNBUFFERED="1")
    res = subprocess.run([base, "benchmarks/gpu_check.py", "--size", "1M", "--dtype", "float32", "--seq", "64",
                          "--steps", "2", "--batch", "4", "--micro", "2", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["zero"] for r in data["train"]] == [2, 3], data["train"]
    assert not [r for r in data["train"] if "error" in r], data["train"]
    assert data["sync"].get("engine_weights_equal") is True, data["sync"]
    assert data["hybrid"].get("engine_weights_equal") is True, data["hybrid"]
    assert any(r["finding"].startswith("3: an actor asking no GPU") and r["ok"] for r in data["rules"])
    assert "tokens_per_s" in res.stdout and "engine_weights_equal" in res.stdout  # each part's table printed


def test_the_device_script_stops_at_once_without_its_wheels(tmp_path):
    """Without .whl/ it says what to run, before any time is spent."""
    script = os.path.join(ROOT, "benchmarks", "gpu_run.sh")
    res = subprocess.run(["bash", script], cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "make-wheels.sh" in res.stderr
