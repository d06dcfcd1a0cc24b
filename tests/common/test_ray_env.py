"""What a Ray worker can import: everything the driver reaches, the repository and its PYTHONPATH both (packages
installed with `pip --target` into a folder on PYTHONPATH, as the GPU device script installs its wheels)."""
import os
import subprocess
import sys

from tests.helpers import ROOT, session_ray

PROBE = """
import ray
from common.remote import init_ray, make_actor
init_ray()
class Probe:
    def value(self):
        import probe_mod
        return probe_mod.VALUE + 1
print("GOT", ray.get(make_actor(Probe, "probe", None).value.remote(), timeout=120))
"""


def test_ray_workers_import_what_the_drivers_pythonpath_holds(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "probe_mod.py").write_text("VALUE = 41\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(site)]), RAY_ADDRESS=session_ray())
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
                         env=env)
    assert res.returncode == 0 and "GOT 42" in res.stdout, res.stderr[-3000:]


def test_python_path_puts_the_repository_first_and_keeps_the_rest_once(monkeypatch):
    from common.remote import python_path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/site", ROOT, ""]))
    assert python_path(ROOT) == os.pathsep.join([ROOT, "/opt/site"])
    monkeypatch.delenv("PYTHONPATH")
    assert python_path(ROOT) == ROOT
