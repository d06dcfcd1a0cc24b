"""Checking a weight sync (`rollout.verify_sync_every`): both ends fingerprint every tensor as it passes (the
trainer's `WeightSender` what it sends, each engine's `WeightReceiver` what reaches its reload), and the driver
compares them. A sync that "succeeded" while a tensor arrived stale or damaged (a buffer reused too early, a bucket
read twice) is then named, instead of showing only as log-prob drift. The hybrid placement's `local` channel hands
tensors over by reference, so it has nothing to check."""
from __future__ import annotations

from typing import Iterator

import torch

from common.errors import TrainingStopped

_CHUNK_WORDS = 1 << 22  # int32 words fingerprinted at a time: bounded temporary memory on a large tensor
_MOD = (1 << 61) - 1  # the sums stay integers every serializer carries (vLLM's collective_rpc: msgspec, 64-bit)


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two integers that change with any bit of `t`: its bytes read as int32 words, their sum and their sum weighted
    by position (mod a prime, so a swap of two words shows). Computed where the tensor is (GPU or CPU)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words, plain, weighted = raw.view(torch.int32), 0, 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        plain = (plain + int(w.sum())) % _MOD
        weighted = (weighted + int((w * pos).sum())) % _MOD
    return plain, weighted


def recorded(named: Iterator[tuple[str, torch.Tensor]], into: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` unchanged, each tensor's fingerprint written into `into` as it passes."""
    for name, tensor in named:
        into[name] = fingerprint(tensor)
        yield name, tensor


def verify_sync(trainers: list, group, channel: str) -> int:
    """After a sync with verification on: every engine received every tensor its feeding trainer rank sent (rank 0
    under broadcast), bit for bit. Returns the tensors checked; a difference stops the run (TrainingStopped) naming
    the engine and the first tensor."""
    from common.remote import ray_get
    from rollout.group import BASE_TIMEOUT_S
    from rollout.sync.ipc import feeding_rank

    roles, timeout_s = [f"policy trainer {r}" for r in range(len(trainers))], group.timeout_s or BASE_TIMEOUT_S
    sent = ray_get([t.sync_fingerprints.remote() for t in trainers], timeout_s, roles)
    got = ray_get([e.sync_fingerprints.remote() for e in group.engines], timeout_s, group.roles)
    checked = 0
    for i, received in enumerate(got):
        src = feeding_rank(i, len(trainers)) if channel == "ipc" else 0
        if not sent[src]:
            raise RuntimeError(f"weight sync check: policy trainer {src} fingerprinted nothing; was the channel "
                               "formed with verify=True?")
        problem = first_difference(sent[src], {k: tuple(v) for k, v in received.items()})
        if problem is not None:
            raise TrainingStopped(f"weight sync check failed: {group.roles[i]} {problem} than policy trainer {src} "
                                  "sent, so the engines no longer generate with the trained weights. Rerun the same "
                                  "command to resume from the last checkpoint; if it repeats, set "
                                  "rollout.sync_channel=broadcast and report it")
        checked += len(received)
    return checked


def first_difference(sent: dict, received: dict) -> str | None:
    """What is wrong with `received` against `sent` (name -> fingerprint), in the order the tensors were sent."""
    for name, fp in sent.items():
        if name not in received:
            return f"never received {name!r}, {len(received)} of {len(sent)} tensors arrived, fewer"
        if tuple(received[name]) != tuple(fp):
            return f"received {name!r} with other contents"
    extra = sorted(set(received) - set(sent))
    return f"received {extra[0]!r}, which is more" if extra else None
