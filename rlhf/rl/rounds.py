"""The rollout phase's parts that are not the controller's: one round's result (`Round`), the choice of groups
across rounds (`select_groups`), what the models say about the chosen rollout's tokens before the update
(`TokenScores`, and from it `teacher_kl`), and what a rollout measures (`rollout_metrics`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from algorithms.advantages import choose_groups, informative_groups
from algorithms.masked import masked_mean
from common.batch import RolloutBatch
from rollout.sources.queue import prefill_per_token


@dataclass(frozen=True)
class Round:
    """One rollout round: the rows drawn (dataset row indices), their rollout (n_samples a row, adjacent, with
    rewards), the round's metrics, and which of its groups have rewards that differ."""
    row_ids: list[int]
    batch: RolloutBatch
    metrics: dict
    signal: torch.Tensor  # (groups,) bool


@dataclass(frozen=True)
class TokenScores:
    """What the models say about a rollout's tokens before the update (the step's "ref" phase): (B, L-1) fp32 each,
    zero outside loss_mask, None where nothing asked for it."""
    old_logprobs: Optional[torch.Tensor]  # the policy's; None when the update's own forward gives them (fused)
    ref_logprobs: Optional[torch.Tensor]  # the reference's (KL)
    old_values: Optional[torch.Tensor]  # the critic's (PPO)
    teacher_logprobs: Optional[torch.Tensor] = None  # the teacher's (on-policy distillation)


def teacher_kl(rollout: RolloutBatch, scores: TokenScores) -> Optional[torch.Tensor]:
    """(B, L-1) log pi(y_t) - log pi_teacher(y_t) on the sampled tokens (the per-token reverse-KL estimate), the
    student's log-probs being the engine's, those the tokens were sampled with; None without a teacher."""
    if scores.teacher_logprobs is None:
        return None
    return (rollout.rollout_logprobs - scores.teacher_logprobs) * rollout.loss_mask


COUNTS = ("rollout/driver_tokens", "rollout/driver_cpu_s", "rollout/prefill_tokens", "rollout/generated_tokens")


def merged_metrics(rounds: list[Round]) -> dict:
    """A step's metrics over its rounds: what the engines and the driver computed (COUNTS) summed, since every
    round's generation was paid for; everything else the newest round's that has it."""
    out: dict = {}
    for r in rounds:
        out.update(r.metrics)
    for key in COUNTS:
        counts = [r.metrics[key] for r in rounds if key in r.metrics]
        if counts:
            out[key] = sum(counts)
    if "rollout/generated_tokens" in out and "rollout/prefill_tokens" in out:
        out["rollout/prefill_per_token"] = prefill_per_token(out["rollout/prefill_tokens"],
                                                             out["rollout/generated_tokens"])
    return out


def select_groups(rounds: list[Round], want: int, n: int, pad_id: int) -> tuple[RolloutBatch, dict, list[int]]:
    """The first `want` groups with signal across the rounds (n samples a group), topped up with all-equal ones:
    (their rollout, the metrics: merged_metrics' with the selection's, their dataset rows)."""
    groups = [r.batch.samples[g * n:(g + 1) * n] for r in rounds for g in range(len(r.batch.samples) // n)]
    signal = torch.cat([r.signal for r in rounds])
    chosen = choose_groups(signal, want).tolist()
    samples = [replace(s, prompt_index=i) for i, g in enumerate(chosen) for s in groups[g]]
    rewards = torch.cat([r.batch.rewards.view(-1, n) for r in rounds])[chosen].flatten()
    metrics = {**merged_metrics(rounds), "rollout/kept_group_frac": min(int(signal.sum()), want) / want,
               "rollout/informative_frac": signal.float().mean().item(), "rollout/fill_rounds": len(rounds)}
    row_ids = [i for r in rounds for i in r.row_ids]
    return RolloutBatch.of(samples, rewards, pad_id), metrics, [row_ids[g] for g in chosen]


def rollout_metrics(rollout: RolloutBatch, kl: Optional[torch.Tensor], n: int,
                    from_rewards: bool) -> dict[str, float]:
    """What a step's rollout measures: rewards, lengths, truncation, the KL to the reference (`kl`, per token) and,
    where rewards drive the advantages (`from_rewards`), the share of groups of `n` whose rewards differ (GRPO/RLOO
    learn from those only)."""
    samples, rewards = rollout.samples, rollout.rewards
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
    out = {}
    if from_rewards and n > 1 and len(rewards) % n == 0:
        out["rollout/signal_frac"] = informative_groups(rewards.flatten(), n).float().mean().item()
    if kl is not None:
        out["rollout/kl"] = masked_mean(kl, rollout.loss_mask).item()
    return {**out, "rollout/reward_mean": rewards.mean().item(), "rollout/reward_std": rewards.std().item(),
            "rollout/response_len": lengths.mean().item(),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples)}


def agreement_alarm(trained: dict[str, float], floor: float, replay: str) -> Optional[str]:
    """What to say when a step's moe/router_agreement fell below rollout.router_agreement_warn (samples generated
    ahead are routed by older weights, so only a step of fresh samples is judged); None when nothing."""
    agree = trained.get("moe/router_agreement")
    if agree is None or agree >= floor or trained.get("rollout/staleness_max", 0) > 0:
        return None
    fix = "replayed (algorithm.routing_replay: rollout)" if replay == "rollout" else \
        "set algorithm.routing_replay: rollout to train on the engine's routing"
    return (f"moe/router_agreement = {agree:.3f} < rollout.router_agreement_warn = {floor:g}: the trainer's routers "
            f"send {1 - agree:.1%} of token-layers to other experts than the engine did; {fix}")
