"""The training loop the in-process stages share (sft, dpo, rm): evaluate first, step, evaluate every
`eval.every` steps and at the end, log every step, save."""
from __future__ import annotations

import time
from typing import Callable

from rlhf.config import RunConfig, to_yaml
from rlhf.metrics import MetricsLogger


def run_loop(cfg: RunConfig, step_fn: Callable[[int], dict], eval_fn: Callable[[], dict],
             save_fn: Callable[[], str], headline: str) -> tuple[dict, dict]:
    """Returns (first evaluation, last metrics row); prints `<stage> done: <headline> before -> after`."""
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.trainer.max_steps, to_yaml(cfg), desc=cfg.stage)
    first = eval_fn()
    logger.log(0, first, advance=False)
    row: dict = {}
    for step in range(1, cfg.trainer.max_steps + 1):
        start = time.perf_counter()
        row = step_fn(step)
        row["time/step"] = time.perf_counter() - start
        if step == cfg.trainer.max_steps or (cfg.eval.every and step % cfg.eval.every == 0):
            row.update(eval_fn())
        logger.log(step, row)
    out = save_fn()
    logger.console(f"{cfg.stage} done: {headline} {first[headline]:.3f} -> {row[headline]:.3f}, model saved to {out}")
    logger.close()
    return first, row
