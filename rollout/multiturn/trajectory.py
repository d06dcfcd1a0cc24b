"""Multi-turn rollouts: many trajectories against their environments (rollout.env) at once, token-exact.

A trajectory is its prompt ids, then each turn's sampled ids exactly as the engine produced them, then the
observation rendered by the chat template as the next user/tool turn (`PromptRenderer.turn_ids`), and so on; only
sampled ids are trained on and each has the engine's log-prob. A turn cut by `max_new_tokens` still goes to
the environment (its observation then opens with the turn-closing token the model did not write). Trajectories
advance independently: whenever some are ready for their next turn they go to the engines as one call, while the
environments of those whose turn just ended step on worker threads. No turn-synchronous barrier: a slow environment
delays only its own trajectory (`barrier=True` runs turn by turn instead, for the benchmark). Limits:
`env.max_turns`; the context (a trajectory whose next turn would not fit `max_model_len` ends, finish_reason
"length"); `env.timeout_s` per reset or step (a hung or raising environment ends its trajectory with reward 0 and
is counted, the first failure of a call printed with its traceback; a call on which every trajectory failed, or
more hung calls still running than `MAX_HUNG_PER_WORKER` x `env.num_workers`, stops the run naming the
environment).

Each trajectory's turns go to one engine (its prompt's): its history stays in that engine's prefix cache. Which
trajectories share an engine call depends on timing, so multi-turn rollouts sample with the engines' own RNG
(not per-prompt seeds) and are not bit-reproducible.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from common.errors import UserError
from common.timeline import carrying_phase
from common.schema import EnvConfig
from rollout.engine import EnvOutcome, Sample, SamplingConfig
from rollout.render import PromptRenderer


@dataclass
class Trajectory:
    prompt_index: int
    env: object = None
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    mask: list[bool] = field(default_factory=list)  # per completion id: sampled by the model
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per completion id, when the group's samples carry them
    last_turn: list[int] = field(default_factory=list)
    # algorithm.routing_replay: the last turn's routes, which cover the whole context before it (prefix-cache hits
    # keep their routes: rollout.engines.routes); observations after it have none
    routes: Optional[np.ndarray] = None
    reward: float = 0.0
    turns: int = 0
    env_time: float = 0.0
    error: bool = False
    finish_reason: str = "stop"

    def versions_padded(self) -> list[int]:
        """`versions` with the observation tokens since the last turn (not trained on) marked as that turn's."""
        return self.versions + self.versions[-1:] * (len(self.mask) - len(self.versions))

    def add_observation(self, ids: list[int]) -> None:
        """Ids between the model's turns (an observation, the template's turn markers): context, not trained on."""
        self.ids += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_turn(self, s: Sample) -> None:
        """The model's next turn, as the engine sampled it (`s`: generated from `self.ids`)."""
        if s.versions is not None:  # generated ahead (rollout.sources.ahead): each turn's policy version
            self.versions = self.versions_padded() + s.versions.tolist()
        self.ids += s.completion_ids
        self.mask += [True] * len(s.completion_ids)
        self.logprobs += s.rollout_logprobs.tolist()
        self.turns += 1
        self.finish_reason, self.last_turn = s.finish_reason, list(s.completion_ids)
        self.routes = s.routes if s.routes is not None else self.routes

    def sample(self) -> Sample:
        return Sample(self.prompt_index, self.ids[:self.prompt_len], self.ids[self.prompt_len:],
                      np.asarray(self.logprobs, dtype=np.float32),
                      self.finish_reason, self.mask, EnvOutcome(self.reward, self.turns, self.env_time, self.error),
                      np.asarray(self.versions_padded(), dtype=np.int32) if self.versions else None,
                      routes=self.routes)


class EnvCalls:
    """Environment calls on daemon threads, at most `limit` running. A call that outlives `timeout_s` is given up
    (its thread left behind: Python cannot stop it, and as a daemon it cannot keep the process from exiting) and
    frees its slot, so hung environments never stall the others."""

    def __init__(self, limit: int, timeout_s: float, abandoned: Optional[list] = None):
        self.limit, self.timeout_s = limit, timeout_s
        self.queued: deque = deque()
        self.running: dict[Future, tuple[object, float]] = {}  # future -> (trajectory, start time)
        self.threads: dict[Future, threading.Thread] = {}
        self.abandoned = abandoned if abandoned is not None else []  # threads of calls given up on

    def submit(self, key, fn: Callable, *args) -> None:
        self.queued.append((key, fn, args))
        self._start()

    def _start(self) -> None:
        while self.queued and len(self.running) < self.limit:
            key, fn, args = self.queued.popleft()
            fut: Future = Future()
            self.running[fut] = (key, time.monotonic())
            self.threads[fut] = threading.Thread(target=_run_into, args=(fut, fn, args), daemon=True)
            self.threads[fut].start()

    def wait_timeout(self) -> Optional[float]:
        """Seconds until the first running call's deadline."""
        if not self.running:
            return None
        return max(0.0, min(s for _, s in self.running.values()) + self.timeout_s - time.monotonic()) + 0.01

    def finished(self, done) -> list[tuple[object, Optional[Future], float]]:
        """(key, future, seconds) of the calls that completed, then (key, None, seconds) of those now too late."""
        now, out = time.monotonic(), []
        for fut in [f for f in self.running if f in done]:
            key, started = self.running.pop(fut)
            del self.threads[fut]
            out.append((key, fut, now - started))
        for fut, (key, started) in list(self.running.items()):
            if now - started > self.timeout_s:
                del self.running[fut]
                self.abandoned.append(self.threads.pop(fut))
                out.append((key, None, now - started))
        self.abandoned[:] = [t for t in self.abandoned if t.is_alive()]
        self._start()
        return out


def _run_into(fut: Future, fn: Callable, args: tuple) -> None:
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # handed to the runner, which ends that trajectory
        fut.set_exception(e)


MAX_HUNG_PER_WORKER = 4  # timed-out environment calls still running, per env.num_workers, before the run stops


def report_failures(errors: list[str], total: int, what: tuple[str, str], where: str, setting: str) -> None:
    """A warning with the first failure when some of `total` episodes failed (they score 0); UserError when all
    did. `what`: the episode's name, singular and plural; `where`, `setting`: the words that name the source."""
    if errors and len(errors) == total:
        raise UserError(f"every {what[0]} ({len(errors)}) failed{where}{setting}; training on them would learn "
                        f"nothing. The first failure:\n{errors[0]}")
    if errors:
        print(f"warning: {len(errors)} of {total} {what[1]} failed{where} and score 0 (rollout/env_errors); the first "
              f"failure:\n{errors[0]}", file=sys.stderr)


def check_hung(hung: list, workers: int, what: str, section: str, timeout_s: float, fix: str) -> None:
    """Python cannot stop a hung call's thread; past MAX_HUNG_PER_WORKER per worker they are a leak, not a slow
    step, and the run stops naming `fix`."""
    if len(hung) > MAX_HUNG_PER_WORKER * workers:
        raise UserError(f"{len(hung)} {what} are still running after {section}.timeout_s = {timeout_s} s and cannot "
                        f"be stopped; fix {fix} (or raise {section}.timeout_s if it is only slow)")


class TrajectoryRunner:
    """`run(rows, sampling)`: `sampling.n` trajectories per row through `group` (a RolloutGroup: submit/collect;
    or one passed to `run`), returned in row order as Samples, like single-turn generation."""

    def __init__(self, group, renderer: PromptRenderer, env_cls: type, cfg: EnvConfig, max_model_len: int,
                 barrier: bool = False, max_calls_in_flight: int = 2):
        self.group, self.renderer, self.env_cls, self.cfg = group, renderer, env_cls, cfg
        self.max_model_len, self.barrier, self.max_calls = max_model_len, barrier, max_calls_in_flight
        self.chat = bool(renderer.tokenizer.chat_template)
        self.hung: list[threading.Thread] = []  # timed-out calls whose threads still run, over every run

    def run(self, rows: Sequence[dict], sampling: SamplingConfig, group=None) -> list[Sample]:
        group = group or self.group
        trajs = [Trajectory(i) for i, _ in enumerate(rows) for _ in range(sampling.n)]
        stops = self.renderer.stop_ids([[{"role": "user", "content": ""}]] if self.chat else [""])
        one = replace(sampling, n=1, seed=None, stop_token_ids=tuple(dict.fromkeys([*sampling.stop_token_ids,
                                                                                     *stops])))
        envs, ready, errors = EnvCalls(self.cfg.num_workers, self.cfg.timeout_s, self.hung), [], []
        generating: dict[Future, list[Trajectory]] = {}
        with ThreadPoolExecutor(self.max_calls, thread_name_prefix="generate") as calls:
            for t in trajs:
                envs.submit(t, self._reset, t, rows[t.prompt_index])
            while envs.running or envs.queued or generating or ready:
                if ready and len(generating) < self.max_calls and not (
                        self.barrier and (envs.running or envs.queued or generating)):
                    generating[calls.submit(carrying_phase(self._generate), group, ready, one)] = ready
                    ready = []
                    continue
                done, _ = wait([*envs.running, *generating], timeout=envs.wait_timeout(),
                               return_when=FIRST_COMPLETED)
                for fut in [f for f in done if f in generating]:
                    fut.result()  # an engine failure the group could not recover from ends the run here
                    for t in generating.pop(fut):
                        envs.submit(t, t.env.step, self.renderer.decode(t.last_turn))
                for t, fut, seconds in envs.finished(done):
                    t.env_time += seconds
                    if self._after_env(t, fut, sampling.max_new_tokens, errors):
                        ready.append(t)
                self._check_hung()
        self._report(trajs, errors)
        return [t.sample() for t in trajs]

    def _report(self, trajs: list[Trajectory], errors: list[str]) -> None:
        name = getattr(self.env_cls, "__name__", str(self.env_cls))
        report_failures(errors, len(trajs), ("trajectory", "trajectories"),
                        f" in the environment {name}", f" (env.name = {self.cfg.name})")

    def _check_hung(self) -> None:
        check_hung(self.hung, self.cfg.num_workers, f"calls of the environment {self.cfg.name}", "env",
                   self.cfg.timeout_s, "what hangs in its reset/step")

    def close(self) -> None:
        """(Nothing outlives a run: its environment calls' threads end with it, or are counted as hung.)"""

    def _reset(self, t: Trajectory, row: dict) -> str:
        t.env = self.env_cls(**self.cfg.kwargs)
        return t.env.reset(row)

    def _generate(self, group, trajs: list[Trajectory], sampling: SamplingConfig) -> None:
        """One engine call for the trajectories ready for a turn; each goes to its prompt's engine, every turn (its
        conversation so far is in that engine's prefix cache, and the group's samples share their prompt there)."""
        engines = [t.prompt_index % group.num_engines for t in trajs]
        samples = group.collect(group.submit([t.ids for t in trajs], sampling, engines))
        for t, s in zip(trajs, samples):
            t.add_turn(s)

    def _after_env(self, t: Trajectory, fut: Optional[Future], max_new_tokens: int, errors: list[str]) -> bool:
        """An environment answered its reset or step (`fut`; None: it timed out): True when the trajectory goes
        on to another turn, with the observation appended. A failure is described into `errors`."""
        error = fut is None or fut.exception() is not None
        if error:  # hung or raised: this trajectory ends with reward 0, the run goes on
            t.error, t.reward = True, 0.0
            call = "step" if t.turns else "reset"
            errors.append(f"{call} did not return within env.timeout_s = {self.cfg.timeout_s} s" if fut is None
                          else "".join(traceback.format_exception(fut.exception())).rstrip())
            if not t.ids:  # in reset: a one-token row that trains nothing keeps the batch whole
                t.ids, t.prompt_len = [self.renderer.pad_id], 1
            return False
        result = fut.result()
        if t.turns == 0:  # reset: the first user message
            first = str(result)
            t.ids = self.renderer.prompt_ids([{"role": "user", "content": first}] if self.chat else first)
            t.prompt_len = len(t.ids)
        else:
            t.reward += float(result.reward)
            if result.done or result.observation is None or t.turns >= self.cfg.max_turns:
                return False
            closed = bool(t.last_turn) and t.last_turn[-1] == self.renderer.close_id
            t.add_observation(self.renderer.turn_ids(str(result.observation), self.cfg.observation_role,
                                                     closed=closed))
        if len(t.ids) + max_new_tokens > self.max_model_len:  # the next turn would not fit the context
            t.finish_reason = "length"
            return False
        return True
