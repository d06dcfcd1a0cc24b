"""What trainer.precision changes in a DeepSpeed engine beyond its dtype: fp32 master weights that start from the
checkpoint's own values (not from their bf16 rounding), Adam's first real step a whole one, and the fp32 masters
as the weights a bf16-true run saves.

Why: DeepSpeed clones its fp32 masters from the bf16 parameters, so every master starts exactly on a bf16 value and
the bf16 copy the forward (and the engines) see moves only once a master has drifted half a bf16 step: at a
learning rate of 2e-5 most of a step's update is swallowed (docs/configuration.md, trainer.precision). A master
started from the fp32 file sits between bf16 values, so the rounding dithers instead of swallowing."""
from __future__ import annotations

import glob
import os
from typing import Iterator, Optional

import torch


def checkpoint_tensors(folder: str, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) for each of `names` that a Hugging Face folder's safetensors files hold in a dtype wider
    than bf16/fp16 (a 16-bit file gives nothing the bf16 parameter does not already hold). One tensor at a time."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in names.intersection(f.keys()):
                sl = f.get_slice(name)
                if sl.get_dtype() in ("F32", "F64"):
                    yield name, f.get_tensor(name).float()


def _pairs(optimizer) -> Optional[list[tuple[torch.nn.Parameter, torch.Tensor]]]:
    """(16-bit parameter, its fp32 master) from DeepSpeed's unfused/fused fp16-bf16 optimizers (ZeRO-0), which keep
    them in two parallel lists; None for the others (ZeRO 1-3, BF16_Optimizer), which map masters per parameter."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if low is None or high is None or not isinstance(high[0], list):
        return None
    return [(p, m) for lg, hg in zip(low, high) for p, m in zip(lg, hg)]


def start_masters(optimizer, module: torch.nn.Module, folder: str) -> int:
    """Set every fp32 master whose parameter `folder` stores in fp32 to the file's value (the 16-bit parameter is
    already its rounding). Returns how many were set. Every rank calls it (each sets its own partition)."""
    from deepspeed.utils import safe_set_full_fp32_param

    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    pairs = _pairs(optimizer)
    masters = {id(p): m for p, m in pairs} if pairs is not None else None
    count = 0
    with torch.no_grad():
        for name, value in checkpoint_tensors(folder, set(params)):
            p = params[name]
            if masters is not None:
                masters[id(p)].copy_(value.view_as(masters[id(p)]))
            else:
                safe_set_full_fp32_param(p, value.to(p.device))
            count += 1
    return count


def fresh_adam(optimizer: torch.optim.Optimizer) -> None:
    """Undo DeepSpeed's start-up step: its 16-bit optimizers run one optimizer step on zero gradients to create the
    states, which leaves Adam's step count at 1, so the first real update gets bias correction for step 2 (0.74x
    the learning rate). Zero moments are what a fresh Adam holds; only the count is put back."""
    for state in optimizer.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = step.zero_() if isinstance(step, torch.Tensor) else 0
    for group in optimizer.param_groups:
        if "step" in group:  # FusedAdam counts per group
            group["step"] = 0


def master_state_dict(optimizer, module: torch.nn.Module, keep: bool = True) -> Optional[dict[str, torch.Tensor]]:
    """The module's state dict with each trained parameter's fp32 master in place of its 16-bit copy (ZeRO 0-2;
    under ZeRO-3 the caller saves the gathered 16-bit weights). Tied names get the one master tensor.

    Every rank must call it (under ZeRO 1-2 each master is assembled by an all-reduce); only the rank that writes
    passes `keep`: the others drop each tensor as it arrives and return None, instead of each holding a full fp32
    copy of the model in host memory (8 ranks x 28 GiB for a 7B)."""
    from deepspeed.utils import safe_get_full_fp32_param

    pairs = _pairs(optimizer)
    masters = {id(p): m for p, m in pairs} if pairs is not None else {}
    fp32: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        if p.requires_grad:
            master = masters.get(id(p))
            master = master if master is not None else safe_get_full_fp32_param(p)
            if master is not None and keep:
                fp32[id(p)] = master.detach().view(p.shape).cpu().clone()
    if not keep:
        return None
    return {name: fp32.get(id(t), t.detach()) for name, t in module.state_dict(keep_vars=True).items()}
