"""One agent episode's calls, captured as the engine saw them and stitched into a training sample.

Each call's prompt ids and sampled ids (with the engine's log-probs) are recorded, never re-tokenized from the chat
history. A call whose request extends the episode's conversation (its earlier messages unchanged, the model's last
reply sent back as returned, then new messages; for /v1/completions: the prompt's ids begin with the context's)
continues the same sample: the template's text between the turns goes in unmasked, the sampled ids masked. A call
that does not extend it (the agent rewrote or dropped its history, or sent calls in parallel) opens a new sample: a
history break, counted. The episode trains every sample, with the episode's reward: its contexts are joined into
one training row whose later contexts are separate sequences (`Sample.segments`: their positions restart and each
attends only to itself), so the batch keeps one row per episode and a group's size is the number of its episodes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from rollout.agents.render import chat_ids, continuation_ids, same_message
from rollout.engine import EnvOutcome, Sample
from rollout.multiturn.trajectory import Trajectory


@dataclass
class Plan:
    """A call about to be generated: its prompt ids, and the context it continues (None: a new sample)."""

    prompt_ids: list[int]
    base: Optional[Trajectory] = None
    base_len: int = 0
    messages: Optional[list[dict]] = None  # chat calls: the request's messages, kept to recognise the next call
    tools: Optional[list] = None


@dataclass
class Episode:
    """An agent's run on one dataset row (`index`), named by `key` in its endpoint URL."""

    key: str
    index: int
    samples: list[Trajectory] = field(default_factory=list)  # a context per history break, all trained
    calls: int = 0
    breaks: int = 0
    reward: float = 0.0
    seconds: float = 0.0
    error: Optional[str] = None
    closed: bool = False  # its agent returned or was given up on: a call still in flight is answered, not kept
    history: Optional[tuple[list[dict], dict, Optional[list]]] = None  # the last chat call: messages, reply, tools
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def plan_chat(self, tokenizer, close_id: Optional[int], messages: list[dict], tools: Optional[list]) -> Plan:
        """The prompt of a chat call: the context it extends plus what is new, or its own rendering."""
        with self.lock:
            last = self.samples[-1] if self.samples else None
            if last is not None and self.history is not None:
                before, reply, before_tools = self.history
                n = len(before)
                if (tools == before_tools and len(messages) > n + 1 and same_message(messages[n], reply)
                        and all(same_message(a, b) for a, b in zip(messages[:n], before))):
                    closed = bool(last.last_turn) and last.last_turn[-1] == close_id
                    more = continuation_ids(tokenizer, close_id, messages[:n], messages[n], messages[n + 1:], tools,
                                            closed)
                    if more is not None:
                        return Plan(last.ids + more, last, len(last.ids), messages, tools)
            return Plan(chat_ids(tokenizer, messages, tools), messages=messages, tools=tools)

    def plan_ids(self, prompt_ids: list[int]) -> Plan:
        """The prompt of a /v1/completions call: it continues the context when it begins with the context's ids."""
        with self.lock:
            last = self.samples[-1] if self.samples else None
            if last is not None and len(prompt_ids) > len(last.ids) and prompt_ids[:len(last.ids)] == last.ids:
                return Plan(list(prompt_ids), last, len(last.ids))
            return Plan(list(prompt_ids))

    def record(self, plan: Plan, generated: Sample, reply: Optional[dict]) -> None:
        """A call's result: appended to the context it planned on when that is still the episode's latest (a
        parallel call may have moved it), else a new sample."""
        with self.lock:
            if self.closed:
                return
            self.calls += 1
            last = self.samples[-1] if self.samples else None
            if plan.base is not None and plan.base is last and len(last.ids) == plan.base_len:
                last.add_observation(plan.prompt_ids[plan.base_len:])
            else:
                self.breaks += bool(self.samples)
                self.samples.append(Trajectory(self.index, ids=list(plan.prompt_ids), prompt_len=len(plan.prompt_ids)))
            self.samples[-1].add_turn(generated)
            self.history = (plan.messages, reply, plan.tools) if plan.messages is not None and reply else None

    def sample(self, pad_id: int) -> Sample:
        """The trained sample: every context, joined (`joined`), with the episode's reward (0 when it failed, as an
        environment's failure scores); an episode that made no call trains nothing (one pad token), so the batch
        keeps its shape. The episode is closed: a call of its agent still in flight is answered but not kept."""
        with self.lock:
            self.closed = True
            error = self.error is not None or not self.samples
            s = joined(self.samples) if self.samples else Trajectory(self.index, ids=[pad_id], prompt_len=1).sample()
        s.env = EnvOutcome(0.0 if error else self.reward, self.calls, self.seconds, error, self.breaks)
        return s


def joined(contexts: list[Trajectory]) -> Sample:
    """One sample of an episode's contexts: the first as its prompt and completion, each later one appended whole
    (its prompt as context, not trained; its sampled ids trained), starting a new sequence at `segments`."""
    s = contexts[0].sample()
    if len(contexts) == 1:
        return s
    completion, mask = list(s.completion_ids), list(s.completion_mask)
    logprobs, versions, starts = [s.rollout_logprobs], [s.versions], []
    for t in contexts[1:]:
        later = t.sample()
        starts.append(len(s.prompt_ids) + len(completion))
        completion += later.prompt_ids + later.completion_ids
        mask += [False] * len(later.prompt_ids) + list(later.completion_mask)
        logprobs += [np.zeros(len(later.prompt_ids), np.float32), later.rollout_logprobs]
        if later.versions is not None:  # the context's ids carry its first turn's version (not trained)
            versions += [np.full(len(later.prompt_ids), later.versions[0], np.int32), later.versions]
    return replace(s, completion_ids=completion, completion_mask=mask, rollout_logprobs=np.concatenate(logprobs),
                   versions=np.concatenate(versions) if s.versions is not None else None, segments=starts,
                   finish_reason=later.finish_reason)
