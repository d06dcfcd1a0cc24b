"""Asynchronous rollouts (`rollout.max_staleness: K` > 0): the engines generate ahead of the trainer while it
trains. Each sample is one engine request for its whole life (rollout.engines.inflight): the engines keep it across
weight syncs, on the engine its group was given (sticky), and this generator advances them `rollout.chunk_tokens` engine
steps a call, so a weight sync waits for one call, never for the longest generation, and no context is sent twice.

Versions: the engines hold version v after v updates. Step s trains with version s-1 and may take a sample whose
oldest token came from version s-1-K or later. The generator is paced, not filtered: it starts step t's prompts only
once the engines hold version t-1-K or later, so every token of them is recent enough by construction and no sample
is ever dropped for staleness; when step s's samples are not finished as the trainer wants them, it waits.

A generation a sync interrupts continues under the new weights (on its KV so far, or recomputed:
rollout.inflight_kv); each token keeps the version and the log-prob it was sampled with, the behaviour policy the
update's importance weight divides by (algorithm.tis_cap, algorithm.tis_mask).

The generator is one driver thread; `synced` pauses it between calls. Its state at each sync (the prompts queued
with their tokens so far, the data position) is what a checkpoint records (`snapshot`), so a resumed run starts
them again from their tokens so far and trains every prompt once; so does an engine's restart, for its samples.

Dynamic sampling (DAPO's further rounds for a step whose groups' rewards are all equal) asks for them as the step's
samples arrive (`refill`): a further round's prompts are drawn then and started at once, by the engines' current
weights, so it is never staler than the step itself.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from rollout.engine import Request, Sample, SamplingConfig
from rollout.engines.sleep import EngineMemory
from rollout.sources.queue import DriverStats, Seq, StepRollout, staleness_metrics



class AsyncRollout:
    """`engines`: a rollout.group.RolloutGroup; `prompts`: the run's rlhf.stages.data.BatchIterator (this object draws
    from it); `episodes`: what a sample is (rollout/episodes.py); `sampling`: n, budget, temperature, top_p and the
    base seed (None: the engines' own RNG); steps up to `last_step` are generated. A completion's tokens are generated
    here, a chunk a call (`episodes.encode` gives its prompt); whole episodes (multi-turn, agents) are played one
    step's at a time by `episodes.run` through the engines as `TurnGate` hands them over: a sync lands between
    turns."""

    def __init__(self, engines, prompts, episodes, sampling: SamplingConfig, *, max_staleness: int,
                 chunk_tokens: int, last_step: int):
        self.engines, self.prompts, self.episodes, self.sampling = engines, prompts, episodes, sampling
        self.max_staleness, self.chunk_tokens, self.last_step = max_staleness, chunk_tokens, last_step
        self.version, self.next_step, self.keys = 0, 1, 0  # keys: samples drawn so far (each one's request key)
        self.calls = 0  # engine calls made
        self.stats = DriverStats(len(engines.engines))
        self.queue: list[StepRollout] = []
        self.cond = threading.Condition()
        self.pausing = self.closed = False
        self.busy = 0  # engine calls in flight (a sync waits for none)
        # engines Ray restarted, each with the call that brings it to the trainer's weights: made by the controller's
        # thread (`owner`), the one that talks to the trainer ranks, never by the generator's
        self.stale: dict[int, Callable[[int], None]] = {}
        self.owner = threading.current_thread()
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.snapshot = self._state()

    # ---- the controller's rollout source (rollout.sources.RolloutSource) ----
    def generate(self, step: int, attempt: int) -> tuple[list[int], list[Sample], dict[str, float]]:
        """Step `step`'s samples as they finish (a further round of dynamic sampling: new prompts, started now)."""
        ahead = self.take(step) if attempt == 0 else self.refill(step)
        samples = ahead.samples(self.sampling.n)
        with self.cond:
            driver = self.stats.read() if attempt == 0 and not self.episodes.whole else {}
        return ahead.row_ids, samples, {**staleness_metrics(samples, trainer_version=step - 1), **driver}

    def trained(self, samples: list[Sample], step: int) -> dict[str, float]:
        """The staleness of what step `step` trains, over all its rounds."""
        return staleness_metrics(samples, trainer_version=step - 1)

    def engine_memory(self) -> EngineMemory:
        return EngineMemory(self.engines, asleep_between_steps=False)  # a generation is always in flight

    def phase_metrics(self, tokens: float, seconds: float) -> dict[str, float]:
        return {}  # no rollout phase: the step waits for samples generated while earlier steps trained

    def state(self) -> dict:
        return self.snapshot

    def restore(self, state: dict, step: int) -> None:
        self.prompts.load_state(state["prompts"])
        self.load_state(state.get("async"), step)

    # ---- the trainer's side ----
    def take(self, step: int) -> StepRollout:
        """Step `step`'s prompts and samples, once every sample is finished (waiting for them meanwhile)."""
        if step > self.version + 1 + self.max_staleness:
            raise RuntimeError(f"step {step} cannot be generated by version {self.version} within max_staleness")
        self.start()
        while True:
            self._resync_restarted()
            with self.cond:
                while not self.stale and not (self.queue and self.queue[0].step == step and self.queue[0].done):
                    self._raise_error()
                    if self.queue and self.queue[0].step != step:
                        raise RuntimeError(f"step {step} wants its rollout, but step {self.queue[0].step}'s is next")
                    self.cond.wait()
                if not self.stale:
                    return self.queue.pop(0)

    def on_restart(self, engine: int, resync: Callable[[int], None]) -> None:
        """Ray restarted `engine` (rollout.group.RolloutGroup calls this before using it again): `resync(engine)`
        brings it to the trainer's weights. Called on the controller's thread, that is done now; on the generator's
        (or a turn's), the call waits until the controller's thread has done it, at its next `take` or `synced`."""
        with self.cond:
            self.stale[engine] = resync
            self.cond.notify_all()
        if threading.current_thread() is self.owner:
            return self._resync_restarted()
        with self.cond:
            while engine in self.stale and not self.closed:
                self.cond.wait()

    def _resync_restarted(self) -> None:
        """The controller's thread: every restarted engine brought to the trainer's weights, the engines' current
        version (the others receive the weights they hold), so no token is tagged with the wrong version."""
        with self.cond:
            stale = dict(self.stale)
        for engine, resync in stale.items():
            resync(engine)
        with self.cond:
            for engine in stale:
                self.stale.pop(engine, None)
            self.cond.notify_all()

    def refill(self, step: int) -> StepRollout:
        """Another round of new prompts for step `step` (the one being trained), generated ahead of the queue."""
        with self.cond:
            self.queue.insert(0, self._draw(step))
            self.cond.notify_all()
        return self.take(step)

    def start(self) -> None:
        """Start generating (the first `take` does, if nothing did before)."""
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
                self.thread.start()

    def synced(self, push: Callable[[], None], version: int) -> None:
        """Run `push` (a weight sync) between two engine calls; the engines then hold `version`."""
        with self.cond:
            self.pausing = True
        start = time.perf_counter()
        try:
            while True:  # a call in flight that met a restarted engine waits for its resync: done here, meanwhile
                self._resync_restarted()
                with self.cond:
                    while self.busy and not self.stale:
                        self.cond.wait()
                    if not self.stale:
                        break
            self._raise_error()
            waited = time.perf_counter() - start
            push()
            with self.cond:
                self.version = version
                self.snapshot = self._state()
                self.stats.sync_wait, self.stats.sync_pause = waited, time.perf_counter() - start
        finally:
            with self.cond:
                self.pausing = False
                self.cond.notify_all()

    def load_state(self, state: Optional[dict], step: int) -> None:
        """A checkpoint's `snapshot` (None: one from a synchronous run, whose data position `prompts` already holds)."""
        self.version, self.next_step = step, step + 1
        if state is not None:
            self.prompts.load_state(state["prompts"])
            self.queue = [StepRollout.from_state(b) for b in state["queue"]]
            self.next_step, self.keys = state["next_step"], state.get("keys", 0)
            self.keys = max([self.keys] + [s.key + 1 for b in self.queue for s in b.seqs])
            for s in (s for b in self.queue for s in b.seqs if s.key < 0):  # a checkpoint from before request keys
                s.key, self.keys = self.keys, self.keys + 1
        self.snapshot = self._state()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)
        started = [s.key for b in self.queue for s in b.seqs if s.started and s.finish is None]
        if started and not (self.thread and self.thread.is_alive()):  # what nobody will take stops generating
            self.engines.abort(started)

    # ---- the generator thread ----
    def _run(self) -> None:
        try:
            (self._run_turns if self.episodes.whole else self._run_inflight)()
        except Closed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self.cond:
                self.error, self.busy = e, 0
                self.cond.notify_all()

    # ---- engine calls: a sync waits for those in flight, and new ones wait for it ----
    def begin_call(self) -> int:
        """Before an engine call from the generator's side: waits while a sync is waiting (raises Closed once
        closed); the engines' version, which the call's tokens carry. Every begin_call has its end_call."""
        with self.cond:
            while self.pausing and not self.closed:
                self.cond.wait()
            if self.closed:
                raise Closed()
            self.busy += 1
            return self.version

    def end_call(self) -> None:
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()

    def _run_inflight(self) -> None:
        while True:
            with self.cond:
                work = self._next_work()
                if work is None:
                    return
                self.busy, version = self.busy + 1, self.version
            new, rows = work
            cpu = time.thread_time()
            answers, lost = self.engines.advance(new, self.sampling, self.chunk_tokens, rows)
            with self.cond:
                self.calls += 1
                live = {s.key: s for b in self.queue for s in b.seqs if s.finish is None}
                for d in (d for a in answers for d in a.deltas):
                    live[d.key].take(d, version)
                sent = {id(r.prompt_ids): len(r.prompt_ids) for n in new for r in n}  # (shared lists go once)
                self.stats.call(sum(sent.values()), answers, time.thread_time() - cpu)
                for s in live.values():
                    s.started = s.started and s.engine not in lost  # a restarted engine lost its requests
                self.busy -= 1
                self.cond.notify_all()

    def _run_turns(self) -> None:
        """Multi-turn: the oldest step's trajectories, whole, then the next step's."""
        gate = TurnGate(self)
        while True:
            with self.cond:
                rollout = self._next_turns()
                if rollout is None:
                    return
            samples = self.episodes.run([self.prompts.rows[i] for i in rollout.row_ids], self.sampling, gate)
            with self.cond:
                rollout.whole = samples
                self.cond.notify_all()

    def _next_turns(self) -> Optional[StepRollout]:
        """The oldest step whose trajectories are not generated yet, once there is one; None once closed."""
        while not self.closed:
            self._start_allowed()
            waiting = [b for b in self.queue if b.whole is None]
            if waiting:
                return waiting[0]
            self.cond.wait()
        return None

    def _next_work(self) -> Optional[tuple[list[list[Request]], int]]:
        """(each engine's samples to start, the count of unfinished samples) once there are any and no sync is
        waiting; None once closed. Holds the lock."""
        while not self.closed:
            if not self.pausing:
                self._start_allowed()
                live = [(s, b.stops) for b in self.queue for s in b.seqs if s.finish is None]
                if live:
                    new: list[list[Request]] = [[] for _ in self.engines.engines]
                    for s, stops in live:
                        if not s.started:
                            new[s.engine].append(self._request(s, stops))
                            s.started = True
                    return new, len(live)
            self.cond.wait()
        return None

    def _start_allowed(self) -> None:
        """Draw the prompts of every step the engines' version may start: step t once version >= t-1-K."""
        while self.next_step <= min(self.version + 1 + self.max_staleness, self.last_step):
            self.queue.append(self._draw(self.next_step))
            self.next_step += 1

    def _draw(self, step: int) -> StepRollout:
        """The next prompts, as a round of step `step`, n sequences each. Holds the lock."""
        before = self.prompts.state()
        row_ids = self.prompts.next_ids()
        if self.episodes.whole:  # played turn by turn (the environments write the first messages)
            return StepRollout(step, row_ids, [], (), before, multi_turn=True)
        prompt_ids, stops = self.episodes.encode([self.prompts.rows[i] for i in row_ids])
        n, engines = self.sampling.n, len(self.engines.engines)
        # a group's samples share one prompt list: pickled once in a call that starts them
        shared = [list(p) for p in prompt_ids]
        seqs = [Seq(p, key=self.keys + i, engine=(self.keys // n + i // n) % engines)
                for i, p in enumerate(p for p in shared for _ in range(n))]
        self.keys += len(seqs)
        return StepRollout(step, row_ids, seqs, stops, before)

    def _request(self, s: Seq, stops: tuple[int, ...]) -> Request:
        """`s` as an engine request: from its tokens so far (none, unless a checkpoint or a restart left some)."""
        seed = None if self.sampling.seed is None else self.sampling.seed + s.key + 100_003 * len(s.ids)
        context = s.prompt_ids + s.ids if s.ids else s.prompt_ids
        return Request(s.key, context, self.sampling.max_new_tokens - len(s.ids), seed, stops)

    def _state(self) -> dict:
        """What a checkpoint saves: the synchronous loop's data position (before the queued prompts), and this
        generator's own (the queue with its tokens so far)."""
        first = self.queue[0].prompts_before if self.queue else self.prompts.state()
        return {"prompts": first, "async": {"prompts": self.prompts.state(), "next_step": self.next_step,
                                            "keys": self.keys, "queue": [b.state() for b in self.queue]}}

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class Closed(Exception):
    """The generator was closed while a turn waited to start."""


class TurnGate:
    """The engines as a multi-turn runner sees them while generating ahead: a turn's call waits while a sync is
    waiting and holds the next sync off until its samples are back; its tokens carry the version that sampled
    them (rollout.group.RolloutGroup's submit/collect)."""

    def __init__(self, pipeline: AsyncRollout):
        self.pipeline = pipeline

    @property
    def num_engines(self) -> int:
        return self.pipeline.engines.num_engines

    def submit(self, prompt_ids, sampling: SamplingConfig, engines=None):
        version = self.pipeline.begin_call()
        try:
            return version, self.pipeline.engines.submit(prompt_ids, sampling, engines)
        except BaseException:
            self.pipeline.end_call()
            raise

    def collect(self, handle) -> list[Sample]:
        version, submitted = handle
        try:
            samples = self.pipeline.engines.collect(submitted)
        finally:
            self.pipeline.end_call()
        return [replace(s, versions=np.full(len(s.completion_ids), version, dtype=np.int32)) for s in samples]
