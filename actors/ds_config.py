"""What a trainer's DeepSpeed engine is given: its config (ZeRO stage, precision, batch counts), the optimizer and
the learning-rate schedule."""
from __future__ import annotations

import torch

from actors.ds_guards import skippable
from common.schema import TrainerConfig, precision_of


def deepspeed_config(tr: TrainerConfig, dtype: str, world_size: int) -> dict:
    """`dtype`: model.dtype, which sets the precision where trainer.precision is null (common.schema.precision_of);
    only the 16-bit "true" precisions keep 16-bit weights with fp32 masters (bf16-mixed autocasts fp32 weights).
    The batch is counted over the data-parallel ranks: a sequence-parallel group trains one share of rows."""
    precision = precision_of(tr.precision, dtype)
    data_parallel = world_size // tr.sequence_parallel_size
    grad_accum = tr.batch_size // (tr.micro_batch_size * data_parallel)
    return {
        "train_batch_size": tr.micro_batch_size * grad_accum * data_parallel,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": tr.grad_clip,
        # ZeRO-3's zero.Init would replace torch.nn.functional.linear process-wide and for good, and an engine in
        # the same process (placement.mode=hybrid) would run DeepSpeed's version inside its compiled forward
        "zero_optimization": {"stage": tr.zero_stage, "memory_efficient_linear": False},
        "bf16": {"enabled": precision == "bf16-true", "check_grad_overflow": True},  # ZeRO skips inf/NaN grads
        "fp16": {"enabled": precision == "fp16-true"},
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's CPU Adam is a C++ build at start
        "steps_per_print": 10**9,
        # (read where DeepSpeed is given no groups: transformers' zero.Init counts the batch over data ranks by it)
        **({"sequence_parallel_size": tr.sequence_parallel_size} if tr.sequence_parallel_size > 1 else {}),
    }


def make_optimizer(params: list, tr: TrainerConfig) -> torch.optim.Optimizer:
    """torch AdamW (no C++ build), except where DeepSpeed demands its own: ZeRO-3 moves states to CPU and back
    (trainer.offload) only for its FusedAdam, a CUDA op built on first use (rlhf.rl.preflight checks it can be)."""
    if tr.offload and tr.zero_stage == 3 and torch.cuda.is_available():
        from deepspeed.ops.adam import FusedAdam
        return skippable(FusedAdam(params, lr=tr.lr, weight_decay=tr.weight_decay, adam_w_mode=True))
    return skippable(torch.optim.AdamW(params, lr=tr.lr, weight_decay=tr.weight_decay))


def warmup_lambda(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
