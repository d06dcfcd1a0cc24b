"""`RolloutGroup`: several rollout engines (data parallel, each a Ray actor) behind one object. Prompts are split
across engines and results come back in input order; a dead engine is restarted (weight syncs: rollout.sync)."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from common.batch import even_spans
from common.remote import WorkerDied, make_actor, ray_get
from rollout.engine import Advanced, Request, Sample, SamplingConfig


@dataclass
class Submitted:
    """A generation in flight: engine `spans[k] = (engine, indices)` works on those prompts and answers `refs[k]`
    (a contiguous range unless the caller chose each prompt's engine)."""
    spans: list[tuple[int, Sequence[int]]]
    refs: list
    prompts: Sequence
    sampling: SamplingConfig
    lives: list = field(default_factory=list)  # lives[k]: the engine's restart count when refs[k] was sent
    samples: Optional[list[Sample]] = None  # once collected
    timeout_s: float = 0.0  # its deadline (RolloutGroup.deadline)
    sent_at: float = field(default_factory=time.time)  # (the start of its spans in the run's timeline)


BASE_TIMEOUT_S = 600.0  # any engine call: a wake-up, a sync, a generation's fixed part
S_PER_TOKEN = 0.05  # a generation's deadline grows by this per token one engine may have to produce in it
TIMEOUT_HINT = "if it was still working, raise rollout.timeout_s"
SHUTDOWN_TIMEOUT_S = 30.0  # an engine's clean shutdown; past it the engine is killed


class RolloutGroup:
    """With `max_restarts` > 0 and an `on_restart(engine)` callback (set by the controller: re-form the sync channel
    and push the current weights), an engine whose process dies is restarted by Ray and its share of the generation
    (or of a call on every engine) is redone; `restarts` counts them. Without a callback, a death raises
    `WorkerDied`."""

    def __init__(self, engines: list, timeout_s: Optional[float] = None, in_trainers: bool = False):
        """`in_trainers`: the engines are hosted by the policy trainer ranks' own actors (placement.mode: hybrid),
        so errors name the rank and a death is the rank's (no restart). `timeout_s` (rollout.timeout_s): every
        engine call's deadline; None = BASE_TIMEOUT_S, and for a generation more by its size (`deadline`)."""
        self.engines, self.timeout_s, self.in_trainers = engines, timeout_s, in_trainers
        self.roles = [f"policy trainer {i}" if in_trainers else f"rollout engine {i}" for i in range(len(engines))]
        self.on_restart: Optional[Callable[[int], None]] = None
        self.lives = [0] * len(engines)  # restarts per engine: a call sent before the last one needs no new restart
        # one lock per engine (multi-turn rollouts collect from several threads): a restart's resync calls every
        # engine, and a second engine dying during it must be restarted without the first's lock, which is held
        # until that resync is done (one lock for all deadlocked there)
        self._restarting = [threading.Lock() for _ in engines]

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def restarts(self) -> int:
        return sum(self.lives)

    @classmethod
    def create(cls, num_engines: int, engine_kwargs: dict, actor_options: list[dict] | None = None, *,
               engine_cls: type, timeout_s: Optional[float] = None, max_restarts: int = 0) -> "RolloutGroup":
        """`start`, then wait until every engine is up."""
        group = cls.start(num_engines, engine_kwargs, actor_options, engine_cls=engine_cls, timeout_s=timeout_s,
                          max_restarts=max_restarts)
        group.ready()
        return group

    @classmethod
    def start(cls, num_engines: int, engine_kwargs: dict, actor_options: list[dict] | None = None, *,
              engine_cls: type, timeout_s: Optional[float] = None, max_restarts: int = 0) -> "RolloutGroup":
        """`num_engines` actors of `engine_cls` (rollout/engines/: VLLMEngine, HFEngine, or a test's own), each built
        with `engine_kwargs`, loading in the background (`ready` waits for them)."""
        options = actor_options or [{}] * num_engines
        engines = [make_actor(engine_cls, f"rollout engine {i}", {"max_restarts": max_restarts, **options[i]},
                              **engine_kwargs) for i in range(num_engines)]
        return cls(engines, timeout_s)

    def ready(self) -> None:
        self._each(lambda e: e.__ray_ready__.remote())

    def deadline(self, prompts: int, sampling: SamplingConfig) -> float:
        """Seconds a generation of `prompts` may take: rollout.timeout_s when set, else scaled by the tokens the
        busiest engine may have to produce (long chain-of-thought sampling outlasts any fixed deadline)."""
        if self.timeout_s is not None:
            return self.timeout_s
        rows = -(-prompts // len(self.engines)) * sampling.n
        return BASE_TIMEOUT_S + S_PER_TOKEN * rows * sampling.max_new_tokens

    # ---- on every engine; each call must be safe to repeat on an engine that was restarted ----
    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Colocated on GPUs: the engines take their memory back (`tags`: only "weights" or "kv_cache")."""
        self._each(lambda e: e.wake_up.remote(tags))

    def sleep(self) -> None:
        """Colocated on GPUs: the engines free their memory for the other roles (rollout.engines.sleep)."""
        self._each(lambda e: e.sleep.remote())

    def load_adapter(self, files: dict[str, bytes]) -> None:
        """LoRA adapter sync: the PEFT adapter's files, which each engine applies to its base model."""
        self._each(lambda e: e.load_adapter.remote(files))

    def update_weights(self, named: list) -> None:
        """Full weights through the driver (tests and small models; runs sync with rollout.sync)."""
        self._each(lambda e: e.update_weights.remote(named))

    def weights_dtypes(self) -> list[str]:
        """Per engine, the dtype its weights were loaded in."""
        return self._each(lambda e: e.weights_dtype.remote())

    def process_ids(self) -> list[list[int]]:
        """Per engine, the pids of its processes (its actor's, then its engine core's when that is separate)."""
        return self._each(lambda e: e.process_ids.remote())

    def _each(self, call: Callable) -> list:
        """`call(engine)` -> ObjectRef on every engine, waited for together; a dead engine is restarted and called
        again."""
        refs = [call(e) for e in self.engines]
        lives = dict(enumerate(self.lives))
        while True:
            try:
                return ray_get(refs, self.timeout_s or BASE_TIMEOUT_S, self.roles, TIMEOUT_HINT)
            except WorkerDied as e:
                i = self._restart(e, lives)
                refs[i], lives[i] = call(self.engines[i]), self.lives[i]

    def generate(self, prompt_ids: Sequence[Sequence[int] | str], sampling: SamplingConfig) -> list[Sample]:
        return self.collect(self.submit(prompt_ids, sampling))

    def submit(self, prompt_ids: Sequence[Sequence[int] | str], sampling: SamplingConfig,
               engines: Optional[Sequence[int]] = None) -> Submitted:
        """Start generating without waiting (`collect` waits). Contiguous chunks per engine; per-prompt seeds are
        offset by the chunk start, so the samples are the same whatever the number of engines. `engines`: each
        prompt's engine instead (a conversation's next turn goes where its history is cached), sampled with the
        engines' own RNG (`sampling.seed` None)."""
        if engines is None:
            spans = [(i, range(lo, hi)) for i, lo, hi in even_spans(len(prompt_ids), len(self.engines))]
        else:
            if sampling.seed is not None:
                raise ValueError("per-prompt seeds follow contiguous chunks: submit with seed=None to choose engines")
            spans = [(i, [k for k, e in enumerate(engines) if e == i]) for i in range(len(self.engines))]
            spans = [(i, idx) for i, idx in spans if idx]
        out = Submitted(spans, [], prompt_ids, sampling, timeout_s=self.deadline(len(prompt_ids), sampling))
        out.refs = [self._generate_span(out, k) for k in range(len(out.spans))]
        out.lives = [self.lives[i] for i, _ in out.spans]
        return out

    def _generate_span(self, sub: Submitted, k: int):
        i, idx = sub.spans[k]
        seed = None if sub.sampling.seed is None else sub.sampling.seed + idx[0]
        budgets = None if sub.sampling.budgets is None else tuple(sub.sampling.budgets[j] for j in idx)
        prompts = [sub.prompts[j] for j in idx]
        return self.engines[i].generate.remote(prompts, replace(sub.sampling, seed=seed, budgets=budgets))

    def collect(self, sub: Submitted) -> list[Sample]:
        """The samples of a `submit`, in prompt order (waited for once; again, the same list). A restarted engine
        redoes its chunk with the same seeds."""
        if sub.samples is not None:
            return sub.samples
        roles = [self.roles[i] for i, _ in sub.spans]
        while True:
            try:
                chunks = ray_get(sub.refs, sub.timeout_s, roles, TIMEOUT_HINT, since=sub.sent_at)
                break
            except WorkerDied as e:
                i = self._restart(e, {j: sub.lives[k] for k, (j, _) in enumerate(sub.spans)})
                for k, (j, _) in enumerate(sub.spans):
                    if j == i:
                        sub.refs[k], sub.lives[k] = self._generate_span(sub, k), self.lives[i]
        out = []
        for (_, idx), chunk in zip(sub.spans, chunks):
            for s in chunk:
                s.prompt_index = idx[s.prompt_index]
            out += chunk
        out.sort(key=lambda s: s.prompt_index)  # (stable: a prompt's n samples keep their order)
        sub.samples = out
        return out

    def advance(self, new: list[list[Request]], sampling: SamplingConfig, steps: int,
                rows: int) -> tuple[list[Advanced], list[int]]:
        """In-flight generation (rollout.engines.inflight): engine i starts `new[i]` and every engine runs `steps`
        steps of its kept requests (`rows` of them in all, for the deadline). Returns each engine's answer, and the
        engines restarted meanwhile: their kept requests are gone (and their counts start again), and the caller starts
        those requests again."""
        lives, lost = list(self.lives), []
        refs = [e.advance.remote(n, sampling, steps) for e, n in zip(self.engines, new)]
        timeout = self.timeout_s or BASE_TIMEOUT_S + S_PER_TOKEN * steps * -(-rows // len(self.engines))
        while True:
            try:
                return ray_get(refs, timeout, self.roles, TIMEOUT_HINT), lost
            except WorkerDied as e:
                i = self._restart(e, dict(enumerate(lives)))
                refs[i], lives[i] = self.engines[i].advance.remote([], sampling, 0), self.lives[i]
                lost.append(i)

    def counters(self) -> list[tuple[int, int]]:
        """Each engine's (prompt tokens computed, tokens generated) since it (last) started."""
        return [tuple(c) for c in self._each(lambda e: e.counters.remote())]

    def abort(self, keys: list[int]) -> None:
        """Drop these kept requests wherever they are."""
        self._each(lambda e: e.abort.remote(keys))

    def _restart(self, error: WorkerDied, lives: dict[int, int]) -> int:
        """The index of the engine that died, once Ray has restarted it and `on_restart` has brought it up to date;
        re-raises `error` when it was not a death of an engine, or nothing can restart it. `lives[i]`: engine i's
        restart count when the failed call was sent; a death another call already handled (two generations in
        flight at once) is neither counted nor pushed weights again."""
        if not (error.died and error.role in self.roles and self.on_restart is not None):
            raise error
        i = self.roles.index(error.role)
        with self._restarting[i]:
            if self.lives[i] > lives[i]:
                return i
            _wait_restarted(self.engines[i], error.role)
            self.lives[i] += 1
            self.on_restart(i)
        return i

    def shutdown(self) -> None:
        """Stop each engine's core cleanly, then the actors (no restart: `ray.kill` is final). An engine that does
        not answer within SHUTDOWN_TIMEOUT_S (one call at a time: a hung generate holds its shutdown back) is killed
        as it is, rather than waited for a whole rollout.timeout_s more."""
        import ray
        self.on_restart = None
        try:
            ray_get([e.shutdown.remote() for e in self.engines], SHUTDOWN_TIMEOUT_S, self.roles)
        except WorkerDied as e:
            print(f"note: {e}; killing it", file=sys.stderr)
        finally:
            for e in self.engines:
                ray.kill(e)
            self.engines = []


def _wait_restarted(engine, role: str, timeout_s: float = 1800.0) -> None:
    """Until Ray has restarted `engine` (calls meanwhile fail as 'temporarily unavailable'); WorkerDied when it was
    dead for good (its max_restarts used up) or did not come back in time."""

    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(engine.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except ActorUnavailableError:  # still restarting
            time.sleep(0.5)
        except RayActorError as e:
            raise WorkerDied(f"{role} died and cannot be restarted again: {e}", role, died=True) from None
        except GetTimeoutError:
            break
    raise WorkerDied(f"{role} died and was not restarted within {timeout_s:.0f} s", role)
