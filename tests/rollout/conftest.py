import os

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A private local Ray instance (never joins another cluster); 4 logical CPUs so actors asking 0.5 fit."""
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    yield ray
    ray.shutdown()
