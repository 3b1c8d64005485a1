import torch

torch.set_num_threads(1)

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One quiet local Ray for every Ray test of the session (starting one costs ~10 s)."""
    from piper_plugin.runtime.launch.ray_actors import start_ray

    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    owned = start_ray(None, num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    if owned:
        import ray

        ray.shutdown()
