"""In-flight generation (rollout.max_staleness > 0): each sample is one engine request for its whole life, kept in
the engine across weight syncs, so no context is ever sent again and a sync waits for no generation to finish.

The driver paces the engines: `advance(new, sampling, steps)` adds the new requests and runs `steps` engine steps
(one token for every running request each), returning only what was produced meanwhile. A sync lands between two
calls; after it the kept requests go on under the new weights, by `rollout.inflight_kv`:
- keep: on the KV cache computed so far (as Tinker's in-flight sampler, NeMo-RL's in_flight_weight_updates and
  PipelineRL do): the tokens after the sync are sampled by the new weights reading the old weights' KV of the context;
- recompute: every running request is preempted and its context (prompt and tokens so far) prefilled again under the
  new weights before it continues (vLLM's reset_prefix_cache(reset_running_requests=True)).
Requests added after a sync never reuse an older version's cached prefix (each version salts the prefix cache).
A request that fills the engine's max_model_len ends there with "length", inside the engine.
An engine core in a process of its own (GPU runs' default) steps by itself whenever it has requests; between calls
its scheduler is paused (requests and their KV kept), so there too every token is sampled inside a call, by the
weights the driver tags it with, and a sync lands on an engine that computes nothing (GPU review 4, finding 7).
vLLM's own record of which weights sampled each token (`RequestOutput.weight_versions`) carries the same versions.

`KeptRequests` is vLLM's; `RegeneratedRequests` gives any engine with a `generate` the same interface, its kept
requests' contexts held inside the engine and recomputed every call (the transformers engine)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from rollout.engine import Advanced, Delta, Request, SamplingConfig


def sampled_logprobs(flat) -> np.ndarray:
    """Each position's sampled-token log-prob, (T,) float32, from vLLM's FlatLogprobs (logprobs=0: the sampled token
    alone, and vLLM puts it first at every position)."""
    return np.asarray(flat.logprobs, dtype=np.float32)[list(flat.start_indices)]


@dataclass
class Live:
    """A kept request's account inside the engine: its request, the tokens it has produced in all (to start it
    again under a new LoRA adapter), and what has not been handed out yet."""
    request: Request
    sampling: SamplingConfig
    produced: list[int] = field(default_factory=list)
    delta: Optional[Delta] = None
    prefill: Optional[int] = None  # prompt tokens its first prefill computed (prefix-cache hits not counted)

    def take(self, ids: list[int], logprobs: list[float], finish: Optional[str]) -> None:
        self.produced += ids
        if self.delta is None:
            self.delta = Delta(self.request.key, [], [])
        self.delta.ids += ids
        self.delta.logprobs += logprobs
        self.delta.finish = finish or self.delta.finish


@dataclass
class Counts:
    """Tokens an engine computed: prompt (or context) tokens prefilled, not counting prefix-cache hits, and tokens
    generated. Their ratio is how much context work each generated token cost."""
    prefill: int = 0
    generated: int = 0


def vllm_counts(llm) -> Counts:
    """vLLM's own counters (its engine must log stats): prompt tokens computed locally (every request's and sample's
    prefill, a preempted one's again; prefix-cache hits not counted) and tokens generated, since it started."""
    out = Counts()
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") == "local_compute":
            out.prefill += int(m.value)
        elif m.name == "vllm:generation_tokens":
            out.generated += int(m.value)
    return out


class KeptRequests:
    """The kept requests of one vLLM engine (`llm`: its vllm.LLM, in this process). Steps its LLMEngine directly:
    vLLM's own `LLM.generate` runs until every request it knows of has finished."""

    def __init__(self, llm, inflight_kv: str = "keep"):
        self.llm, self.engine, self.inflight_kv = llm, llm.llm_engine, inflight_kv
        self.max_model_len = self.engine.model_config.max_model_len
        self.live: dict[str, Live] = {}
        self.version = 0  # syncs seen: the prefix cache's salt
        self.lora_request = None
        # The counts `advance` reports are the samples' own, added when a sample ends (so a run's ratio pairs each
        # prompt with its whole completion), plus contexts computed again: the engine's prefill counter less the
        # kept requests' first prefills (`first`) and what requests that are not kept computed (`other`:
        # evaluations, the synchronous loop).
        self.ended = Counts()
        self.first = self.other = 0
        core = self.engine.engine_core
        self.own_process = hasattr(core, "call_utility")  # a SyncMPClient: its core runs in its own process
        self.held = False  # that core's scheduler paused: it computes nothing until the next call
        self.engine.set_weight_version(self._salt())
        self.routes = None  # rollout.engines.routes.EngineRoutes (algorithm.routing_replay): ended requests' routes

    def advance(self, new: list[Request], sampling: SamplingConfig, steps: int) -> Advanced:
        ended = [self._add(r, sampling) for r in new]
        if steps > 0 and self.live:
            self._release()
            for _ in range(steps):
                if not self.live or not self.engine.has_unfinished_requests():
                    break
                self._step()
            self._hold()
        deltas = [d for d in ended if d is not None] + self._hand_out()
        again = vllm_counts(self.llm).prefill - self.other - self.first  # preempted, recomputed, restarted
        return Advanced(deltas, self.ended.prefill + max(again, 0), self.ended.generated)

    def generate(self, inputs: list[dict], params: list, lora_request=None) -> list:
        """`LLM.generate`'s work (an evaluation, the synchronous loop), beside the kept requests if there are any;
        what it computes is not counted as theirs."""
        if self.live:
            return self.run_beside(inputs, params)
        self._release()
        before = vllm_counts(self.llm).prefill
        outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
        self.other += vllm_counts(self.llm).prefill - before
        return outputs

    def run_beside(self, inputs: list[dict], params: list) -> list:
        """`LLM.generate`'s work while requests are kept: these requests to their end (their final outputs, in
        order); the kept ones advance meanwhile and keep what they produce for the next `advance`."""
        ids = [f"g{self.version}-{i}" for i in range(len(inputs))]
        before = vllm_counts(self.llm).prefill - self.first
        for rid, inp, p in zip(ids, inputs, params):
            self.engine.add_request(rid, dict(inp, cache_salt=self._salt()), p, lora_request=self.lora_request)
        self._release()
        done: dict[str, object] = {}
        while len(done) < len(ids):
            for rid, out in self._step().items():
                done[rid] = out
        self._hold()
        self.other += vllm_counts(self.llm).prefill - self.first - before  # (less kept requests' first prefills)
        return [done[rid] for rid in ids]

    def synced(self) -> None:
        """After a full-weight reload: later requests get a fresh prefix-cache salt; kept ones go on by
        inflight_kv (recompute: preempted, re-prefilled by the new weights)."""
        self.version += 1
        self.engine.set_weight_version(self._salt())  # (nothing runs: held, or no request kept)
        if self.live and self.inflight_kv == "recompute":
            self.llm.reset_prefix_cache(reset_running_requests=True)
        elif not self.live:  # (with requests running it cannot; the salt keeps later ones off the old blocks)
            self.llm.reset_prefix_cache()

    def new_adapter(self, lora_request) -> None:
        """A LoRA adapter sync: the old adapter goes, so every kept request starts again under the new one from
        its context so far (prompt and tokens produced), inside the engine: the recompute of a full-weight sync."""
        self.version += 1
        self.engine.set_weight_version(self._salt())
        old, self.lora_request = self.live, lora_request
        self.engine.abort_request(list(old))
        self.live = {}
        self.llm.reset_prefix_cache()  # (what the old adapter cached; nothing runs now)
        for rid, live in old.items():
            r = live.request
            again = replace(r, prompt_ids=r.prompt_ids + live.produced, max_tokens=r.max_tokens - len(live.produced))
            if self._add(again, live.sampling, rid=rid) is not None:  # no room left: it ends here
                live.take([], [], "length")
            self.live[rid] = live

    def abort(self, keys: list[int]) -> None:
        wanted = set(keys)
        rids = [rid for rid, live in self.live.items() if live.request.key in wanted]
        self.engine.abort_request(rids)
        for rid in rids:
            del self.live[rid]

    def _add(self, r: Request, sampling: SamplingConfig, rid: Optional[str] = None) -> Optional[Delta]:
        """Start `r` in the engine (None), or its end at once where it has no room to produce a token."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - len(r.prompt_ids)
        if room <= 0 or r.max_tokens <= 0:  # (a request started again after an adapter sync, at its end)
            return Delta(r.key, [], [], "length")
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=min(r.max_tokens, room), logprobs=0, seed=r.seed,
                                stop_token_ids=list(r.stop_token_ids), detokenize=False, flat_logprobs=True,
                                output_kind=RequestOutputKind.DELTA)
        rid = rid or f"k{r.key}"
        self.engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids), "cache_salt": self._salt()}, params,
                                lora_request=self.lora_request)
        self.live.setdefault(rid, Live(r, sampling))
        return None

    def _step(self) -> dict[str, object]:
        """One engine step: kept requests' tokens recorded; finished outputs of other requests returned by id."""

        finished = {}
        for out in self.engine.step():
            live = self.live.get(out.request_id)
            if live is None:
                if out.finished:
                    finished[out.request_id] = out
                continue
            c = out.outputs[0]
            if live.prefill is None:  # its first output: the prompt has been computed
                live.prefill = len(live.request.prompt_ids) - (out.num_cached_tokens or 0)
                self.first += live.prefill
            logps = sampled_logprobs(c.logprobs).tolist() if c.token_ids else []
            finish = ("length" if c.finish_reason == "length" else "stop") if out.finished else None
            live.take(list(c.token_ids), logps, finish)
        return finished

    def _hold(self) -> None:
        """An engine core in its own process: pause its scheduler with the requests and their KV kept (vLLM's
        pause "keep": answered once the core is idle, after every output it sent before), then take in what it
        produced up to there. The in-process core only steps when `_step` asks it to."""
        if not self.own_process or self.held or not self.live:
            return
        self.engine.engine_core.call_utility("pause_scheduler", "keep", False)
        self.held = True
        waiting = self.engine.engine_core.outputs_queue  # (its outputs arrive in order, before the pause's answer)
        while not waiting.empty():
            self._step()

    def _release(self) -> None:
        if self.held:
            self.engine.engine_core.call_utility("resume_scheduler")
            self.held = False

    def _hand_out(self) -> list[Delta]:
        out, ended = [], {}
        for rid, live in list(self.live.items()):
            if live.delta is not None:
                out.append(live.delta)
                if live.delta.finish is not None:
                    del self.live[rid]
                    self.ended.prefill += live.prefill or 0
                    self.ended.generated += len(live.produced)
                    ended[rid] = live
                live.delta = None
        if self.routes is not None and ended:  # (a request started again after an adapter sync: its whole context)
            routes = self.routes.fetch({rid: len(x.request.prompt_ids) + len(x.produced) - 1
                                        for rid, x in ended.items()}, list(self.live))
            rids = {x.request.key: rid for rid, x in ended.items()}
            for delta in out:
                if delta.key in rids:
                    delta.routes = routes[rids[delta.key]]
        return out

    def _salt(self) -> str:
        return f"v{self.version}"


class RegeneratedRequests:
    """Kept requests for an engine that can only `generate` whole calls: each `advance` continues every kept
    request by up to `steps` tokens, its context (prompt and tokens so far) held here and computed again each call.
    Inside the engine, so nothing crosses the driver twice; the recompute of rollout.inflight_kv either way."""

    def __init__(self, engine, counts: Counts, max_model_len: Optional[int] = None):
        """`counts`: what the engine's `generate` counts (its Counts), reported with every answer."""
        self.engine, self.counts, self.max_model_len = engine, counts, max_model_len
        self.live: dict[int, Live] = {}
        self.calls = 0

    def advance(self, new: list[Request], sampling: SamplingConfig, steps: int) -> Advanced:
        for r in new:
            self.live[r.key] = Live(r, sampling)
        live = list(self.live.values())
        counts = self.counts
        if not live:
            return Advanced([], counts.prefill, counts.generated)
        budgets = tuple(max(0, min(steps, self._left(x))) for x in live)
        stops = tuple(dict.fromkeys(t for x in live for t in x.request.stop_token_ids))
        seed = None if sampling.seed is None else sampling.seed + 100_003 * self.calls
        self.calls += 1
        call = replace(sampling, n=1, max_new_tokens=max(max(budgets), 1), budgets=budgets, seed=seed,
                       stop_token_ids=stops)
        samples = self.engine.generate([x.request.prompt_ids + x.produced for x in live], call)
        out = []
        for x, s, budget in zip(live, samples, budgets):
            ids = s.completion_ids[:budget]
            x.produced += ids
            ended = s.finish_reason == "stop" and len(ids) == len(s.completion_ids)
            finish = "stop" if ended else "length" if self._left(x) <= 0 or budget == 0 else None
            out.append(Delta(x.request.key, ids, s.rollout_logprobs[:len(ids)].tolist(), finish))
            if finish is not None:
                del self.live[x.request.key]
        return Advanced(out, counts.prefill, counts.generated)

    def _left(self, x: Live) -> int:
        """Tokens `x` may still produce: its budget, and the room its context leaves in max_model_len."""
        left = x.request.max_tokens - len(x.produced)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - len(x.request.prompt_ids) - len(x.produced))
        return left

    def abort(self, keys: list[int]) -> None:
        for k in keys:
            self.live.pop(k, None)
