"""Agents as they are written: a function `run(row, client) -> reward` (`agent.fn: package.module:function`, sync or
async) whose `client` is an `openai.OpenAI` (an `AsyncOpenAI` for an async function) pointed at the rollout's own
OpenAI-compatible endpoint (rollout.agents.server), one URL per episode, so its calls are captured token by token.

    def run(row, client):
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["q"]}],
                                               tools=TOOLS)
        ...  # call tools, send their results back, as with any OpenAI-compatible server
        return float(answer == row["answer"])

`AgentRunner.run(rows, sampling)` plays `sampling.n` episodes per row (agent.concurrency at once) and returns one
Sample per episode in row order, like rollout.multiturn.trajectory's runner, so GRPO/RLOO/PPO, LoRA, asynchronous RL and
evaluation take it unchanged. The calls of all episodes are batched into engine calls (at most
`max_calls_in_flight` at once), held until arrivals are quiet (QUIET_S, at most HOLD_S); every call samples with
the run's rollout settings (temperature, top-p: what the trainer's log-probs assume), the request's `max_tokens`
capping `rollout.max_new_tokens`. `serve` answers one open-ended episode without a run (rlhf.agent_serve). An agent that
raises, outlives `agent.timeout_s` or returns something other than a number ends its own episode (reward 0, counted
in rollout/env_errors, the first error printed once a step); a step on which every episode failed stops the run.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import secrets
import sys
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from common.errors import UserError, load_named
from common.remote import WorkerDied
from common.schema import AgentConfig
from common.timeline import carrying_phase
from rollout.agents.episode import Episode, Plan
from rollout.agents.render import ToolCalls
from rollout.agents.server import AgentEndpoint, ApiError, completion_body
from rollout.engine import Sample, SamplingConfig
from rollout.multiturn.trajectory import EnvCalls, check_hung, report_failures
from rollout.render import PromptRenderer, RenderError


def load_agent(name: str) -> Callable:
    """The function named `package.module:function` (agent.fn); UserError saying what is wrong otherwise."""
    fn = load_named(name, "agent.fn", "package.module:function")
    if not callable(fn) or len(inspect.signature(fn).parameters) < 2:
        raise UserError(f"agent.fn = {name!r}: {name.partition(':')[2]} must be a function run(row, client) -> reward")
    return fn


@dataclass
class Call:
    """One endpoint call waiting for the engines."""

    plan: Plan
    max_tokens: int
    episode: int = 0  # its episode's row: every call of an episode goes to that row's engine (its prefix cache)
    done: threading.Event = field(default_factory=threading.Event)
    sample: Optional[Sample] = None
    error: Optional[str] = None


class Calls:
    """One `run`'s calls waiting for an engine call, and the sampling they get (a run's own: an evaluation may run
    beside a rollout generated ahead); `arrived` completes when one comes (the runner's loop waits on it)."""

    def __init__(self, sampling: SamplingConfig):
        self.sampling, self.lock, self.items, self.arrived = sampling, threading.Lock(), [], Future()
        self.first_at = self.last_at = 0.0

    def put(self, call: Call) -> None:
        with self.lock:
            self.last_at = time.monotonic()
            if not self.items:
                self.first_at = self.last_at
            self.items.append(call)
            if not self.arrived.done():
                self.arrived.set_result(None)

    def hold(self) -> Optional[float]:
        """Seconds to keep the waiting calls for more (0: send them now), None when none waits: until the calls
        have been quiet for QUIET_S, at most HOLD_S after the first."""
        with self.lock:
            if not self.items:
                return None
            return max(0.0, min(self.last_at + QUIET_S, self.first_at + HOLD_S) - time.monotonic())

    def take(self) -> list[Call]:
        with self.lock:
            items, self.items = self.items, []
            if self.arrived.done():
                self.arrived = Future()
            return items


# Calls wait for others to form one engine call: agents started together call within a fraction of a second of each
# other, and a first engine call of a few prompts would hold the engine for a whole generation while the rest wait.
QUIET_S, HOLD_S = 0.02, 0.25


def _failed(calls: list[Call], error: BaseException) -> None:
    for c in calls:
        c.error = f"the engines failed: {type(error).__name__}: {error}"
        c.done.set()


def reward_of(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"the agent returned {value!r}; return its reward, a finite number")
    return float(value)


class AgentRunner:
    """Episodes of `agent.fn` through `group` (a RolloutGroup, or the one `run` is given), behind one endpoint."""

    def __init__(self, group, renderer: PromptRenderer, cfg: AgentConfig, max_model_len: int,
                 max_calls_in_flight: int = 2, model_name: str = "policy", token: Optional[str] = None):
        self.group, self.renderer, self.cfg, self.max_model_len = group, renderer, cfg, max_model_len
        self.fn = load_agent(cfg.fn) if cfg.fn else None  # (None: `serve` only)
        self.max_calls_in_flight = max_calls_in_flight
        self.tools = ToolCalls(cfg.tool_parser, renderer.tokenizer)
        self.live: dict[str, tuple[Episode, Calls]] = {}  # episode key -> the episode and its run's calls
        self.live_lock = threading.Lock()
        self.hung: list[threading.Thread] = []
        self.http = None  # the sync agents' shared httpx client, made on first use
        self.rejected = 0  # calls the engine raised for (each ended its episode, not the run)
        self.endpoint = AgentEndpoint(self._handle, model_name, cfg.host, cfg.port, token)

    def close(self) -> None:
        self.endpoint.close()
        if self.http is not None:
            self.http.close()

    # ---- the rollout ----
    def _calls(self, sampling: SamplingConfig) -> Calls:
        """A run's queue, its calls sampled one at a time and stopping at the turn's end."""
        stops = self.renderer.stop_ids([[{"role": "user", "content": ""}]] if self.renderer.tokenizer.chat_template
                                       else [""])
        return Calls(replace(sampling, n=1, seed=None,
                             stop_token_ids=tuple(dict.fromkeys([*sampling.stop_token_ids, *stops]))))

    def serve(self, key: str, sampling: SamplingConfig, stop: threading.Event, group=None) -> Episode:
        """Answer calls under `key`, one open-ended episode, until `stop` is set; its captured samples are returned
        (`python -m rlhf.agent_serve`: the endpoint without a training run, for curl and for trying an agent)."""
        group, queue, episode = group or self.group, self._calls(sampling), Episode(key, 0)
        with self.live_lock:
            self.live[key] = (episode, queue)
        try:
            while not stop.is_set():
                hold = queue.hold()
                if hold == 0.0:
                    self._generate(group, queue.take(), queue.sampling)
                else:
                    wait([queue.arrived], timeout=0.5 if hold is None else hold)
        finally:
            self._retire([episode], queue)
        return episode

    def run(self, rows: Sequence[dict], sampling: SamplingConfig, group=None) -> list[Sample]:
        group, queue = group or self.group, self._calls(sampling)
        episodes = [Episode(secrets.token_hex(8), i) for i, _ in enumerate(rows) for _ in range(sampling.n)]
        with self.live_lock:
            self.live.update({e.key: (e, queue) for e in episodes})
        agents, generating = EnvCalls(self.cfg.concurrency, self.cfg.timeout_s, self.hung), {}
        with self.live_lock:
            if self.http is None and not inspect.iscoroutinefunction(self.fn):
                self.http = _shared_http(self.cfg.concurrency)
        try:
            with ThreadPoolExecutor(self.max_calls_in_flight, thread_name_prefix="agent-generate") as pool:
                for e in episodes:
                    agents.submit(e, self._play, e, rows[e.index])
                while agents.running or agents.queued or generating:
                    room = len(generating) < self.max_calls_in_flight
                    hold = queue.hold() if room else None
                    if hold == 0.0:
                        calls = queue.take()
                        generating[pool.submit(carrying_phase(self._generate), group, calls, queue.sampling)] = calls
                        continue
                    timeout = agents.wait_timeout()
                    timeout = hold if timeout is None or (hold is not None and hold < timeout) else timeout
                    # (an arrival is awaited only with room and nothing held: else it would spin this loop)
                    done, _ = wait([*agents.running, *generating, *([queue.arrived] if room and hold is None
                                                                    else [])],
                                   timeout=timeout, return_when=FIRST_COMPLETED)
                    for fut in [f for f in done if f in generating]:
                        del generating[fut]
                        fut.result()  # an engine failure the group could not recover from ends the run here
                    for e, fut, seconds in agents.finished(done):
                        self._settle(e, fut, seconds)
                    self._check_hung()
        finally:
            self._retire(episodes, queue)
        self._report(episodes)
        return [e.sample(self.renderer.pad_id) for e in episodes]

    def _play(self, episode: Episode, row: dict):
        import openai
        url = self.endpoint.url(episode.key)
        if inspect.iscoroutinefunction(self.fn):
            async def play():
                async with openai.AsyncOpenAI(base_url=url, api_key=self.endpoint.token, max_retries=0,
                                              timeout=self.cfg.timeout_s) as client:
                    return await self.fn(row, client)
            return asyncio.run(play())
        return self.fn(row, openai.OpenAI(base_url=url, api_key=self.endpoint.token, max_retries=0,
                                          timeout=self.cfg.timeout_s, http_client=self.http))

    def _settle(self, e: Episode, fut: Optional[Future], seconds: float) -> None:
        e.seconds = seconds
        with self.live_lock:  # its late calls now get 404
            self.live.pop(e.key, None)
        with e.lock:  # and one still generating is not kept
            e.closed = True
        if fut is None:
            e.error = f"the agent did not return within agent.timeout_s = {self.cfg.timeout_s} s"
        elif fut.exception() is not None:
            e.error = "".join(traceback.format_exception(fut.exception())).rstrip()
        else:
            try:
                e.reward = reward_of(fut.result())
            except TypeError as err:
                e.error = str(err)

    def _retire(self, episodes: list[Episode], queue: Calls) -> None:
        with self.live_lock:
            for e in episodes:
                self.live.pop(e.key, None)
            for call in queue.take():
                call.error = "the episode ended"
                call.done.set()

    def _generate(self, group, calls: list[Call], sampling: SamplingConfig) -> None:
        """One engine call for `calls`. A request the engine rejects (it raised, past the endpoint's own checks) fails
        its own call only, and so ends at most its own episode: a call of several is redone a request at a time to
        find it. An engine that died or hung, and that the group could not bring back, ends the run."""
        budgets, engines = tuple(c.max_tokens for c in calls), [c.episode % group.num_engines for c in calls]
        try:
            samples = group.collect(group.submit([c.plan.prompt_ids for c in calls], replace(
                sampling, max_new_tokens=max(budgets), budgets=budgets), engines))
        except WorkerDied as e:
            if e.raised and not e.start_failed and len(calls) > 1:
                for c in calls:
                    self._generate(group, [c], sampling)
                return
            _failed(calls, e)
            if not e.raised or e.start_failed:  # (an engine whose restart raised in __init__ is gone for good)
                raise
            self.rejected += 1
            print(f"warning: the engine rejected one agent call (its episode ends; {self.rejected} so far): {e}",
                  file=sys.stderr)
            return
        except BaseException as e:
            _failed(calls, e)
            raise
        for c, s in zip(calls, samples):
            c.sample = s
            c.done.set()

    def _report(self, episodes: list[Episode]) -> None:
        errors = [e.error for e in episodes if e.error is not None]
        report_failures(errors, len(episodes), ("agent episode", "agent episodes"), "", f" (agent.fn = {self.cfg.fn})")

    def _check_hung(self) -> None:
        check_hung(self.hung, self.cfg.concurrency, f"episodes of agent.fn = {self.cfg.fn}", "agent",
                   self.cfg.timeout_s, "what hangs in the agent")

    # ---- the endpoint's side: one call ----
    def _handle(self, key: str, kind: str, body: dict) -> dict:
        with self.live_lock:
            episode, queue = self.live.get(key, (None, None))
        if episode is None:
            raise ApiError(404, f"episode {key} has ended (its agent returned or ran past agent.timeout_s) or "
                                "never began", code="episode_ended")
        request = _validated(kind, body)
        asked = _asked_tokens(request)
        with episode.lock:
            if episode.calls >= self.cfg.max_calls:
                raise ApiError(400, f"this episode has made agent.max_calls = {self.cfg.max_calls} calls; return "
                                    "its reward (or raise agent.max_calls)", code="max_calls_exceeded")
        plan = self._plan(episode, kind, request)
        room = self.max_model_len - len(plan.prompt_ids)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(plan.prompt_ids)} tokens and rollout.max_model_len = "
                                f"{self.max_model_len} leaves no room to generate", code="context_length_exceeded",
                           param="messages" if kind == "chat" else "prompt")
        budget = queue.sampling.max_new_tokens
        call = Call(plan, min(room, budget, asked or budget), episode.index)
        with self.live_lock:
            if key not in self.live:
                raise ApiError(404, f"episode {key} has ended", code="episode_ended")
            queue.put(call)
        if not call.done.wait(self.cfg.timeout_s) or call.error is not None:
            raise ApiError(503, f"the call was not generated: {call.error or 'agent.timeout_s passed'}")
        return self._respond(episode, kind, request, call, queue.sampling.stop_token_ids)

    def _plan(self, episode: Episode, kind: str, request) -> Plan:
        try:
            if kind == "chat":
                tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
                return episode.plan_chat(self.renderer.tokenizer, self.renderer.close_id,
                                         [dict(m) for m in request.messages], tools)
            prompt = request.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return episode.plan_ids(self.renderer.prompt_ids(prompt))
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                vocab = len(self.renderer.tokenizer)
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:  # (the engine would refuse the whole call, every episode's in it)
                    raise ApiError(400, f"prompt: token id {bad} is not in the vocabulary [0, {vocab})",
                                   param="prompt")
                return episode.plan_ids(prompt)
        except RenderError as e:
            raise ApiError(400, str(e), param="messages") from None
        raise ApiError(400, "prompt must be one string or one list of token ids", param="prompt")

    def _respond(self, episode: Episode, kind: str, request, call: Call, stops: tuple[int, ...]) -> dict:
        s = call.sample
        ids = s.completion_ids
        body_ids = ids[:-1] if s.finish_reason == "stop" and ids and ids[-1] in stops else ids
        tok, reply, finish = self.renderer.tokenizer, None, s.finish_reason
        if kind == "chat":
            text = tok.decode(body_ids, skip_special_tokens=not request.tools)
            reply, called = self.tools.message(text, request)
            finish = "tool_calls" if called else finish
            out = reply
        else:
            out = tok.decode(body_ids, skip_special_tokens=True)
        episode.record(call.plan, s, reply)
        logprobs = [{"token": tok.decode([i]), "logprob": float(lp), "bytes": None, "top_logprobs": []}
                    for i, lp in zip(ids, s.rollout_logprobs)] if request.logprobs else None
        return completion_body(kind, self.endpoint.model, out, finish, len(call.plan.prompt_ids), list(ids),
                               logprobs, call.plan.prompt_ids if getattr(request, "return_token_ids", False) else None)


def _shared_http(connections: int):
    """One connection pool for every sync episode: a client of its own builds an SSL context while holding the
    GIL, which spread a step's first calls out and split them into several engine calls
    (benchmarks/results/agent_endpoint.md)."""
    import httpx
    import openai
    return openai.DefaultHttpxClient(limits=httpx.Limits(max_connections=connections,
                                                         max_keepalive_connections=connections))


def _asked_tokens(request) -> Optional[int]:
    """The call's max_completion_tokens (or max_tokens: no deprecation here), None when unset; ApiError 400 below 1,
    which the engine would refuse for the whole call it joins (every episode's in it)."""
    for name in ("max_completion_tokens", "max_tokens"):
        asked = vars(request).get(name)
        if asked is not None:
            if asked < 1:
                raise ApiError(400, f"{name}: must be at least 1, got {asked}", param=name)
            return asked
    return None


def _validated(kind: str, body: dict):
    """The request as vLLM's OpenAI protocol model reads it; ApiError 400 naming the field otherwise."""
    from pydantic import ValidationError
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
    try:
        request = Model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{where}: {first.get('msg')}", param=where or None) from None
    for name, bad, why in (("stream", bool(request.stream), "streaming is not served"),
                           ("n", (request.n or 1) != 1, "one choice per call: the run samples rollout.n_samples "
                                                        "episodes per row"),
                           ("stop", bool(request.stop), "stop strings are not served: a turn ends at the model's "
                                                        "turn-closing token")):
        if bad:
            raise ApiError(400, f"{name}: {why}", param=name)
    return request
