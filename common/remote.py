"""The one place plain classes become Ray actors, `ray.get` with a timeout and an error naming the role/rank, and a
batch put into the object store once for all of a step's calls (`ship`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from common import timeline
from common.batch import Batch, shards


class WorkerDied(RuntimeError):
    """A worker did not answer: `role` names it; `died` is True when its process is gone (Ray restarts an actor made
    with `max_restarts`), `raised` when its method raised (the message then holds the exception and where it was
    raised: a rerun would fail the same way); neither: it timed out. `start_failed`: what raised was its __init__, so
    the worker is gone for good (no restart, no retry of the call)."""

    def __init__(self, message: str, role: str = "", died: bool = False, raised: bool = False,
                 start_failed: bool = False):
        super().__init__(message)
        self.role, self.died, self.raised, self.start_failed = role, died, raised, start_failed
        self.out_of_memory = message.endswith(MEMORY_HINT)


def task_error_cause(error: Exception) -> str:
    """'ValueError: the message (at file.py:123 in fn)' for a Ray task error: the worker's own exception and the
    innermost frame of its traceback, not Ray's `ray::Class.method() (pid=...)` header."""
    import re

    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(error).strip().splitlines()[-1]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(error))
    if frames:
        path, line, fn = frames[-1]
        text += f" (at {path}:{line} in {fn})"
    return text


@dataclass(frozen=True)
class Shipped:
    """A batch put into Ray's object store once, as `len(refs)` contiguous row shards (common.batch.split_batch):
    every call of a step that reads those rows passes the same references, and each worker takes its shard from
    the store, instead of the driver pickling the batch into every call. `batch` stays the driver's own (for a
    call that needs the rows cut another way)."""
    batch: Batch
    refs: list


def ship(batch: Batch, parts: int) -> Shipped:
    import ray
    return Shipped(batch, [ray.put(shard) for shard in shards(batch, parts)])


CPU_PER_ACTOR = 0.5  # Ray CPUs an actor asks for unless its options say otherwise (CPU-only runs)


def make_actor(cls: type, role: str, options: dict | None, *args, **kwargs):
    """Start `cls(*args, **kwargs)` as a Ray actor. Thread env is pinned: one torch thread per actor. An actor that
    asks for no GPU sees none (a CPU-only run on a GPU host stays on the CPU)."""
    import ray

    opts = {"num_cpus": CPU_PER_ACTOR, "max_concurrency": 1, **(options or {})}
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **opts.pop("env_vars", {})}
    if not opts.get("num_gpus"):  # Ray leaves CUDA_VISIBLE_DEVICES alone for zero-GPU actors: they would see all
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    opts["runtime_env"] = {**opts.get("runtime_env", {}), "env_vars": env}
    actor = ray.remote(cls).options(name=None, **opts).remote(*args, **kwargs)
    timeline.ACTORS[role] = actor  # (whose spans the run's timeline collects; a weak reference)
    return actor


def ray_get(refs: Sequence[Any], timeout_s: float, roles: Sequence[str], hint: str = "",
            since: Optional[float] = None) -> list:
    """ray.get on a list with one deadline. Results are waited for together, so a rank that died is reported at
    once by its role (e.g. 'policy trainer 1') even while its peers hang in a collective waiting for it. `hint`:
    which setting to raise, said when the deadline passes. `since`: when the calls were sent (time.time()), if
    before now (their spans in the run's timeline start there)."""
    import time

    import ray
    from ray.exceptions import RayActorError, RayTaskError

    role_of = {ref: role for ref, role in zip(refs, roles)}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    trace, called = timeline.current(), since or time.time()  # (logging.trace: each answer a span on its track)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if ready and trace is not None:
            trace.span(role_of[ready[0]], timeline.phase_name(), called, time.time())
        if not ready:
            raise WorkerDied(f"{', '.join(role_of[r] for r in pending)} did not answer within {timeout_s:.0f} s "
                             f"(a collective that reached only some ranks hangs like this{'; ' * bool(hint)}{hint})",
                             role_of[pending[0]])
        try:
            ray.get(ready[0])
        except RayActorError as e:
            if e.actor_init_failed:  # its __init__ raised: Ray wraps the worker's own error in a death
                raise WorkerDied(memory_hint(f"{role_of[ready[0]]} raised {task_error_cause(e)} while starting"),
                                 role_of[ready[0]], raised=True, start_failed=True) from None
            killed = memory_kill(str(e))  # Ray's paragraph and its top-10 table, as one clause
            raise WorkerDied(memory_hint(f"{role_of[ready[0]]} died: {killed or e}"), role_of[ready[0]],
                             died=True) from None
        except RayTaskError as e:
            raise WorkerDied(memory_hint(f"{role_of[ready[0]]} raised {task_error_cause(e)}"), role_of[ready[0]],
                             raised=True) from None
    return ray.get(list(refs))


MEMORY_HINT = ("it ran out of memory. What lowers it: trainer.max_tokens_per_micro_batch (or a smaller "
               "trainer.micro_batch_size), trainer.gradient_checkpointing=true, trainer.chunked_logprobs=true (if "
               "off), trainer.plan_memory=true (if off) or a lower trainer.memory_limit_gb, "
               "trainer.sequence_parallel_size (more ranks a sequence), "
               "shorter rollout.max_new_tokens or prompts, and on GPUs trainer.zero_stage=3 or "
               "trainer.offload=true; for a rollout engine, rollout.max_model_len and its memory share "
               "(rollout.gpu_memory_utilization, rollout.kv_cache_mb on CPU) (docs/configuration.md)")


def memory_hint(message: str) -> str:
    """`message`, with what lowers memory added when it says a worker ran out of it (a CUDA OOM it raised, or
    Ray's memory monitor killing it)."""
    import re
    if re.search(r"out of memory|OutOfMemory|memory pressure|\bOOM\b", message, re.IGNORECASE):
        return f"{message}. {MEMORY_HINT}"
    return message


def memory_kill(text: str) -> Optional[str]:
    """Ray's memory monitor's report of a worker it killed ("... where the task (actor ID: ..., pid=..., memory
    used=20.21GB) was running was 22.80GB / 24.00GB (0.95), which exceeds the memory usage threshold ...", then a
    table of the node's top processes) as one clause; None for any other death."""
    import re
    found = re.search(r"memory used=([\d.]+\s*[KMGT]?B)\).*? was running was ([\d.]+\s*[KMGT]?B) / ([\d.]+\s*[KMGT]?B)",
                      text, re.DOTALL)
    if found:
        return (f"killed by Ray's memory monitor when it held {found[1]} and the node {found[2]} of "
                f"{found[3]} (out of memory)")
    if re.search(r"low on memory|memory pressure", text):
        return "killed by Ray's memory monitor: the node ran low on memory (out of memory)"
    return None


def python_path(*first: str) -> str:
    """PYTHONPATH for a child process or a Ray worker: `first`, then this process's own PYTHONPATH. Ray assigns
    runtime_env's env_vars (it does not merge them), so naming the repository alone would hide every package
    installed through PYTHONPATH (pip --target folders) from the workers, which then never start."""
    import os
    parts = [*first, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (as under `ray job submit`), else start a private local instance whose
    dashboard stays off. Actors request fractional CPUs, so the local instance advertises at least 8 slots."""
    import os

    import ray

    if ray.is_initialized():
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runtime_env = {"env_vars": {"PYTHONPATH": python_path(root)}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False, runtime_env=runtime_env)
