"""What generating ahead (rollout.sources.ahead) holds: each sample in progress, each step's prompts with their samples,
their form in a checkpoint, and the staleness of what a step trains."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import numpy as np

from rollout.engine import Delta, EnvOutcome, Sample


@dataclass
class Seq:
    """One sample in progress: its prompt, and its tokens so far with the log-prob and policy version of each. It
    lives in engine `engine` as request `key` once `started` (never in a checkpoint: a resumed run starts it again
    from its tokens so far)."""
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Optional[str] = None  # "stop" (an eos or stop token) or "length" (the budget or the context), once done
    key: int = -1
    engine: int = 0
    started: bool = False
    # algorithm.routing_replay, once ended (Sample.routes); not in a checkpoint (tokens x layers x k bytes a sample):
    # an ended sample restored from one trains with its row's routes left out (the trainer's own routing)
    routes: Optional[np.ndarray] = None

    def take(self, delta: Delta, version: int) -> None:
        """What its request produced while the engines held `version`."""
        self.ids += delta.ids
        self.logprobs += delta.logprobs
        self.versions += [version] * len(delta.ids)
        self.finish = delta.finish
        self.routes = delta.routes if delta.routes is not None else self.routes

    def state(self) -> dict:
        """As JSON, copied (a checkpoint's snapshot must not change as the sample goes on)."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "routes")
        return {k: list(v) if isinstance(v, list) else v for k, v in values}


@dataclass
class StepRollout:
    """The prompts one step trains on (dataset row ids, drawn when the generator started them), n samples each,
    adjacent; `prompts_before` is the data position before they were drawn (where a synchronous resume redraws
    them). Multi-turn (`multi_turn`): no `seqs`; `whole` holds the trajectories once every one has ended (a checkpoint
    keeps them; the trajectories of a step still being played are played again after a resume)."""
    step: int
    row_ids: list[int]
    seqs: list[Seq]
    stops: tuple[int, ...]
    prompts_before: dict
    multi_turn: bool = False
    whole: Optional[list[Sample]] = None

    @property
    def done(self) -> bool:
        return self.whole is not None if self.multi_turn else all(s.finish is not None for s in self.seqs)

    def samples(self, n: int) -> list[Sample]:
        if self.multi_turn:
            return self.whole
        return [Sample(i // n, s.prompt_ids, s.ids, np.asarray(s.logprobs, dtype=np.float32), s.finish,
                       versions=np.asarray(s.versions, dtype=np.int32), routes=s.routes)
                for i, s in enumerate(self.seqs)]

    def state(self) -> dict:
        return {"step": self.step, "row_ids": self.row_ids, "seqs": [s.state() for s in self.seqs],
                "stops": list(self.stops), "prompts_before": self.prompts_before, "multi_turn": self.multi_turn,
                "whole": None if self.whole is None else [_sample_state(s) for s in self.whole]}

    @classmethod
    def from_state(cls, d: dict) -> "StepRollout":
        whole = d.get("whole")
        multi_turn = d.get("multi_turn", d.get("turns", False))  # ("turns" in checkpoints of 2026-12-03)
        return cls(d["step"], d["row_ids"], [Seq(**dict(s, started=False)) for s in d["seqs"]], tuple(d["stops"]),
                   d["prompts_before"], multi_turn, None if whole is None else [_sample_from_state(s) for s in whole])


def _sample_state(s: Sample) -> dict:
    """A finished trajectory as JSON (float32 log-probs survive the round trip through float64 exactly)."""
    return {"prompt_index": s.prompt_index, "prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids,
            "rollout_logprobs": s.rollout_logprobs.tolist(), "finish_reason": s.finish_reason,
            "completion_mask": s.completion_mask, "env": None if s.env is None else asdict(s.env),
            "versions": None if s.versions is None else s.versions.tolist(), "segments": s.segments}


def _sample_from_state(d: dict) -> Sample:
    return Sample(d["prompt_index"], d["prompt_ids"], d["completion_ids"],
                  np.asarray(d["rollout_logprobs"], dtype=np.float32), d["finish_reason"], d["completion_mask"],
                  None if d["env"] is None else EnvOutcome(**d["env"]),
                  None if d["versions"] is None else np.asarray(d["versions"], dtype=np.int32),
                  d.get("segments"))  # (absent from checkpoints before 2026-12-05)


def staleness_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """Per sample: how many versions its oldest token is behind the trainer's, and how many versions sampled it."""
    versions = [s.versions if s.versions is not None and len(s.versions) else None for s in samples]
    behind = np.array([0 if v is None else trainer_version - int(v.min()) for v in versions])
    spans = np.array([0 if v is None else len(np.unique(v)) for v in versions])
    return {"rollout/staleness_mean": float(behind.mean()), "rollout/staleness_max": float(behind.max()),
            "rollout/versions_per_sample": float(spans.mean()), "rollout/interrupted_frac": float((spans > 1).mean())}


def prefill_per_token(prefill: float, generated: float) -> float:
    """Context tokens the engines computed per token they generated."""
    return prefill / max(generated, 1)


class DriverStats:
    """What generating a step cost the driver and the engines, accumulated as calls come back and read (then reset)
    once a step: `rollout/driver_tokens` (token ids the driver sent to and received from the engines),
    `rollout/driver_cpu_s` (CPU seconds of the generator's thread), `rollout/prefill_per_token` (prompt or context
    tokens the engines computed, not counting prefix-cache hits, per token they generated; the two counts too, as
    `rollout/prefill_tokens` and `rollout/generated_tokens`, so a run's ratio can be pooled), and of the last sync,
    `rollout/sync_wait_s` (waiting for the engine call in flight) and `rollout/sync_pause_s` (pause to resume).
    The counts leave evaluations out: the synchronous loop counts its own generation call, and generating ahead
    a sample's counts come when it ends (rollout.engine.Advanced)."""

    def __init__(self, engines: int):
        self.last = [(0, 0)] * engines  # each engine's (prefill, generated) totals as last reported
        self.tokens = self.cpu = self.prefill = self.generated = 0.0
        self.sync_wait = self.sync_pause = 0.0

    def call(self, sent: int, answers: list, cpu_s: float) -> None:
        """One advance call: `sent` token ids out, each engine's rollout.engine.Advanced back."""
        self.moved(sent + sum(len(d.ids) for a in answers for d in a.deltas))
        self.cpu += cpu_s
        self.counted([(a.prefill_tokens, a.generated_tokens) for a in answers])

    def moved(self, tokens: int) -> None:
        self.tokens += tokens

    def rebase(self, totals: list[tuple[int, int]]) -> None:
        """Each engine's totals now, as the point the next counts start from: what came before is not this
        step's (the synchronous loop: an evaluation between two steps)."""
        self.last = [tuple(t) for t in totals]

    def counted(self, totals: list[tuple[int, int]]) -> None:
        """Each engine's (prefill, generated) totals now (rollout.group.RolloutGroup.counters)."""
        for i, (prefill, generated) in enumerate(totals):
            p, g = self.last[i]
            restarted = prefill < p or generated < g  # its counts began again
            self.prefill += prefill - (0 if restarted else p)
            self.generated += generated - (0 if restarted else g)
            self.last[i] = (prefill, generated)

    def read(self, ahead: bool = True) -> dict[str, float]:
        """The metrics since the last read (`ahead` false: the synchronous loop's, which has no thread or pause)."""
        out = {"rollout/driver_tokens": self.tokens,
               "rollout/prefill_per_token": prefill_per_token(self.prefill, self.generated),
               "rollout/prefill_tokens": self.prefill, "rollout/generated_tokens": self.generated}
        if ahead:
            out.update({"rollout/driver_cpu_s": self.cpu, "rollout/sync_wait_s": self.sync_wait,
                        "rollout/sync_pause_s": self.sync_pause})
        self.tokens = self.cpu = self.prefill = self.generated = 0.0
        return out
