"""The engine/trainer agreement the rollout tests measure, as the update's `rollout/logprob_diff` does."""
import torch


def logprob_diff(trainer_logprobs: torch.Tensor, batch: dict) -> float:
    """Mean |rollout_logprobs - trainer log-probs| over sampled tokens (batch: common.batch.samples_to_batch)."""
    mask = batch["loss_mask"]
    return ((trainer_logprobs - batch["rollout_logprobs"]).abs() * mask).sum().item() / max(mask.sum().item(), 1)
