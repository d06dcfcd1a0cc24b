"""The one place plain classes become Ray actors, and `ray.get` with a timeout and an error naming the role/rank."""
from __future__ import annotations

from typing import Any, Sequence


class WorkerDied(RuntimeError):
    pass


def make_actor(cls: type, role: str, options: dict | None, *args, **kwargs):
    """Start `cls(*args, **kwargs)` as a Ray actor. Thread env is pinned: one torch thread per actor."""
    import ray

    opts = {"num_cpus": 0.5, "max_concurrency": 1, **(options or {})}
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **opts.pop("env_vars", {})}
    opts["runtime_env"] = {**opts.get("runtime_env", {}), "env_vars": env}
    return ray.remote(cls).options(name=None, **opts).remote(*args, **kwargs)


def ray_get(refs: Sequence[Any], timeout_s: float, roles: Sequence[str]) -> list:
    """ray.get on a list with a timeout; a dead or failed worker is reported by its role (e.g. 'rollout engine 1')."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    out = []
    for ref, role in zip(refs, roles):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except RayActorError as e:
            raise WorkerDied(f"{role} died: {e}") from None
        except RayTaskError as e:
            raise WorkerDied(f"{role} failed: {e}") from None
        except GetTimeoutError:
            raise WorkerDied(f"{role} did not answer within {timeout_s:.0f} s (a collective that reached only some "
                             "ranks hangs like this)") from None
    return out


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a private local instance whose
    dashboard stays off. Actors request fractional CPUs, so the local instance advertises at least 8 slots."""
    import os

    import ray

    if ray.is_initialized():
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runtime_env = {"env_vars": {"PYTHONPATH": root}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False, runtime_env=runtime_env)
