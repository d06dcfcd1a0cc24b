"""Guards around DeepSpeed that it has no hooks for: checkpoint files loaded weights-only, saved states without
enum pickles, an optimizer step that can be skipped on every rank, ZeRO-3 models built shard by shard."""
from __future__ import annotations

import types
from contextlib import contextmanager
from enum import Enum

import torch


def restricted_load(path: str, map_location=None):
    """DeepSpeed unpickles its checkpoint files with weights_only=False, so a crafted file could run code on load.
    Ours load with weights_only=True: tensors, plain containers and the few DeepSpeed records its ZeRO states hold."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


def plain_enums(obj):
    """`obj` with Enum members replaced by their values (DeepSpeed's ZeroStageEnum is an int enum). Python 3.11.2
    pickles enum members through `getattr`, which a weights-only load must refuse; later 3.11 releases do not."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: plain_enums(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain_enums(v) for v in obj]
    return obj


def skippable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` with a `skip` flag: while it is set, `step()` leaves every parameter and moment as it is, so a bad
    update can be dropped on every rank while DeepSpeed's own step (its counters, the gradient clearing) still runs.
    DeepSpeed has no hook for this; the optimizer is ours, so its step is wrapped on the instance, never by a
    subclass: ZeRO-3's offload_states asserts the class is exactly FusedAdam. Bound as a method, since torch's LR
    scheduler re-wraps `optimizer.step` through its `__func__`."""
    base = type(optimizer).step

    def step(self, *args, **kwargs):
        return None if self.skip else base(self, *args, **kwargs)

    optimizer.skip, optimizer.step = False, types.MethodType(step, optimizer)
    return optimizer


def restricted_checkpoint_engine(config):
    """DeepSpeed's torch checkpoint engine with our two changes: saved states have plain ints for enums, loads
    are weights-only (`restricted_load`). DeepSpeed picks its engine from a fixed list (no hook for a class of
    our own), so the engine object it made is replaced by this subclass after `deepspeed.initialize`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class RestrictedCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict, path: str):
            return super().save(plain_enums(state_dict), path)

        def load(self, path: str, map_location=None):
            return restricted_load(path, map_location)

    return RestrictedCheckpointEngine(config)


@contextmanager
def zero3_loading(config: dict):
    """Under ZeRO-3, `from_pretrained` inside this block builds the model under `deepspeed.zero.Init`: each rank
    allocates only its shard and the checkpoint is loaded into the shards (transformers checks for a live
    `HfDeepSpeedConfig`). Without it every rank loads the full model first (fine for 7B, out of memory for 32B+).
    Other stages: nothing."""
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(config)  # transformers holds only a weak reference: alive for the block
    try:
        yield
    finally:
        del keep


@contextmanager
def suppressed_update(optimizer, scheduler, skip: bool):
    """While `skip`, DeepSpeed's step runs (its counters advance, gradients are cleared) but the wrapped torch
    `optimizer` does not move (`skippable`), and the LR `scheduler` is put back afterwards."""
    if not skip:
        yield
        return
    sched_state, lrs = scheduler.state_dict(), [g["lr"] for g in optimizer.param_groups]
    optimizer.skip = True
    try:
        yield
    finally:
        optimizer.skip = False
        scheduler.load_state_dict(sched_state)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


def stage0_grad_norm(module: torch.nn.Module) -> float:
    """ZeRO 1-3 optimizers record the global grad norm; stage 0 in fp32 does not, so compute it (gradients are
    already averaged over ranks after the boundary backward)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
