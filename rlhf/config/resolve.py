"""The run as it will run: every key whose null default depends on the machine or on other keys, filled in once,
when the config is loaded (`load_config`), so `--print-config` and the run's saved `config.yaml` show what ran, not
`null`, and nothing downstream applies a default again. The rules are here with it: which roles a run starts and how
many ranks each, the threads a worker gets, the engine core's process, the sampling seeds."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from common.schema import precision_of
from common.schema import LOGPROB_DIFF_WARN, RunConfig

ASYNC_TIS_CAP = 2.0  # rollout.max_staleness > 0: algorithm.tis_cap unless set
ASYNC_TIS_MASK = (0.5, 5.0)  # and tis_mask_low / tis_mask_high (IcePop's bounds)


def resolved(cfg: RunConfig) -> RunConfig:
    """`cfg` with every machine- or key-dependent default filled in; a value the user set is kept (idempotent)."""
    cfg = with_machine_dtype(with_worker_threads(cfg))  # (the dtype's probe runs on the workers' threads)
    r, pl, a = cfg.rollout, cfg.placement, cfg.algorithm
    hybrid = pl.mode == "hybrid"  # the engine core stays in the rank's process
    warn = r.logprob_diff_warn if r.logprob_diff_warn is not None else LOGPROB_DIFF_WARN[cfg.model.dtype]
    rollout = replace(r, logprob_diff_warn=warn, seed_per_prompt=seed_per_prompt(r.seed_per_prompt, pl.num_gpus),
                      multiprocess=False if hybrid else multiprocess_engine(r.multiprocess, pl.num_gpus),
                      gpu_memory_utilization=r.gpu_memory_utilization or (0.9 if pl.mode == "split" else 0.5))
    algorithm = replace(a, loss_norm_len=a.loss_norm_len or r.max_new_tokens)
    if r.max_staleness > 0:  # samples of older weights: the off-policy correction is on unless set
        algorithm = replace(algorithm, tis_cap=a.tis_cap or ASYNC_TIS_CAP,
                            tis_mask_low=a.tis_mask_low or ASYNC_TIS_MASK[0],
                            tis_mask_high=a.tis_mask_high or ASYNC_TIS_MASK[1])
    placement = replace(pl, reference_ranks=reference_ranks(pl.reference_ranks, pl.mode, pl.num_gpus,
                                                            cfg.trainer.world_size))
    trainer = replace(cfg.trainer, precision=precision_of(cfg.trainer.precision, cfg.model.dtype))
    return replace(cfg, rollout=rollout, algorithm=algorithm, placement=placement, trainer=trainer)


def with_worker_threads(cfg: RunConfig) -> RunConfig:
    """placement.cpu_threads filled in (`cpu_threads`) for the workers this run starts."""
    ranks = role_ranks(cfg) if cfg.stage == "rl" else {"policy": 1}
    threads = cpu_threads(cfg.placement.cpu_threads, busy_at_once(cfg, ranks))
    return replace(cfg, placement=replace(cfg.placement, cpu_threads=threads))


def with_machine_dtype(cfg: RunConfig) -> RunConfig:
    """`model.dtype: auto` made bfloat16 or float32 by what the run's device does with bf16 (common.fast_dtype), and
    a bf16 trainer.precision the recipe names made fp32 where auto chose float32. Engines and trainers both read
    model.dtype, so they agree. `cfg`'s placement.cpu_threads is resolved."""
    if cfg.model.dtype != "auto":
        return cfg
    from common.fast_dtype import choose_dtype, trainer_precision
    dtype = choose_dtype("auto", machine_device(cfg)).dtype
    precision = trainer_precision(cfg.trainer.precision, "auto", dtype)
    return replace(cfg, model=replace(cfg.model, dtype=dtype), trainer=replace(cfg.trainer, precision=precision))


def machine_device(cfg: RunConfig):
    """The device the run's models compute on (common.fast_dtype.Device), probed on the threads a worker gets
    (placement.cpu_threads, resolved)."""
    from common.fast_dtype import run_device
    return run_device(cfg.placement.num_gpus, cfg.placement.cpu_threads)


def require_resolved(cfg: RunConfig) -> None:
    """For code that takes a RunConfig from a caller (the RL controller): one that skipped `resolved()` would run
    on nulls; say so rather than fill them in a second time (resolved() keeps what is set, so a resolved config is
    its own resolution)."""
    if resolved(cfg) != cfg:
        raise ValueError("the config is not resolved: pass load_config()'s result, or rlhf.config.resolved(cfg)")


def role_ranks(cfg: RunConfig, needs_critic: Optional[bool] = None) -> dict[str, int]:
    """Actors per role. Under `placement.mode: hybrid` the engines live inside the policy ranks: no rollout role.
    `needs_critic`: whether the estimator trains a critic; None = read it from algorithm.name."""
    if needs_critic is None:
        from algorithms.estimators import estimator
        needs_critic = estimator(cfg.algorithm.name).needs_critic
    ranks = {"policy": cfg.trainer.world_size}
    if cfg.placement.mode != "hybrid":
        ranks["rollout"] = cfg.rollout.num_engines
    if cfg.algorithm.kl_mode() != "off" and cfg.model.lora.rank == 0:
        ranks["reference"] = reference_ranks(cfg.placement.reference_ranks, cfg.placement.mode,
                                             cfg.placement.num_gpus, cfg.trainer.world_size)
    if needs_critic:
        ranks["critic"] = cfg.trainer.world_size
    if cfg.reward.model_path is not None:
        ranks["reward"] = 1
    if cfg.teacher.path is not None:  # hosted like the reference: a copy beside each trainer rank on GPUs
        ranks["teacher"] = reference_ranks(cfg.placement.reference_ranks, cfg.placement.mode,
                                           cfg.placement.num_gpus, cfg.trainer.world_size)
    return ranks


def busy_at_once(cfg: RunConfig, ranks: dict[str, int]) -> int:
    """The most worker processes that compute at the same time: the trainers (policy and critic ranks) in the
    update, the engines in the rollout, the scorers in between; trainers and engines together under
    rollout.max_staleness > 0."""
    train, engines = ranks["policy"] + ranks.get("critic", 0), ranks.get("rollout", 0)
    if cfg.rollout.max_staleness > 0:
        return train + engines
    return max(train, engines, ranks.get("reference", 0), ranks.get("reward", 0), ranks.get("teacher", 0))


def cpu_threads(requested: Optional[int], busy_at_once: int, cores: Optional[int] = None) -> int:
    """Torch threads per worker process: `placement.cpu_threads`, else $OMP_NUM_THREADS when the user set it, else
    the host's cores over the workers that compute at once. The phases take turns (every trainer rank trains, then
    every engine generates), so one rank and one engine each get all the cores while the other waits; threads beyond
    the cores only contend."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    if cores is None:  # the cores this process may use (a cpuset), not the host's
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, busy_at_once))


def multiprocess_engine(requested, num_gpus: int) -> bool:
    """`rollout.multiprocess`, or by default vLLM's multiprocess engine core on GPUs (the scheduler runs beside the
    model, not in its way) and the in-process one on CPU (a second process costs far more start-up than it gains
    there)."""
    return requested if requested is not None else num_gpus > 0


def reference_ranks(requested: Optional[int], mode: str, num_gpus: int, world_size: int) -> int:
    """`placement.reference_ranks`, or by default one reference copy per trainer rank when colocated on GPUs (each
    bundle already holds a trainer rank; scoring is split across them instead of queueing on GPU 0; hybrid too),
    else one."""
    if requested is not None:
        return requested
    return world_size if num_gpus > 0 and mode in ("colocate", "hybrid") else 1


def seed_per_prompt(requested: Optional[bool], num_gpus: int) -> bool:
    """`rollout.seed_per_prompt`, or by default on CPU only. vLLM samples seeded requests row by row in Python
    (its GPU top-k/top-p kernels and FlashInfer skip them), so on GPUs the default trades bit-reproducible
    rollouts for sampling speed; set it true to get both runs' rollouts equal."""
    return requested if requested is not None else num_gpus == 0


def precision_facts(cfg: RunConfig) -> tuple[dict, str, Optional[str]]:
    """What a resolved run computes in and why the machine suits it: the metrics' first row (`run/dtype`,
    `run/precision` and what was measured), the start-up's line, and a warning where the run puts bf16 matmuls on
    a device that runs them slowly (an explicit bfloat16 or bf16-mixed)."""
    from common.fast_dtype import choose_dtype
    device = machine_device(cfg)
    p = cfg.trainer.precision
    choice = choose_dtype(cfg.model.dtype, device, uses_bf16=p == "bf16-mixed")
    facts = {"run/dtype": cfg.model.dtype, "run/precision": p, "run/device": device.kind}
    if device.kind == "cpu":
        facts.update({"run/cpu_isa": device.isa, "run/bf16_gflops": device.bf16_gflops,
                      "run/fp32_gflops": device.fp32_gflops})
    line = f"precision: model.dtype {cfg.model.dtype}, trainer.precision {p} ({choice.why})"
    return facts, line, choice.warning
