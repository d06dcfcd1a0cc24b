"""Config dtype names -> torch dtypes, and the trainer's precision (trainer.precision) in Lightning's names."""
from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weights_dtype(precision: str) -> torch.dtype:
    """The dtype the trainer's weights are held in (the forward's parameters)."""
    return {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}.get(precision, torch.float32)


def autocast(precision: str, device: torch.device):
    """The context a forward runs under: bf16 autocast for bf16-mixed, nothing otherwise."""
    if precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
