"""The offline preference stages. `dpo`: the policy learns from chosen/rejected pairs against reference log-probs
computed once, before the first update. `rm`: a reward model learns the same pairs (Bradley-Terry) and reports held-out
pair accuracy. Both save a Hugging Face folder in `<output_dir>/final`."""
from __future__ import annotations

import torch

from common.batch import Batch, chunks, pack_pairs, sequence_logprobs
from rlhf.config import RunConfig
from rlhf.stages.data import BatchIterator, preference_rows, prompt_rows
from rlhf.stages.loop import answer_metric, run_loop
from rlhf.stages.setup import model_and_renderer, policy_and_engine
from rollout.episodes import evaluate_completions
from rollout.render import PromptRenderer
from rollout.rewards import reward_fn_for


def tokenize_pairs(renderer: PromptRenderer, rows: list[dict]) -> Batch:
    """Each pair's prompt rendered as generation sees it, then chosen and rejected (strings or assistant messages)
    with the token that ends them, as SFT renders answers."""
    prompts = [renderer.prompt_ids(r["prompt"]) for r in rows]
    return pack_pairs(prompts, [renderer.answer_ids(r["prompt"], r["chosen"]) for r in rows],
                      [renderer.answer_ids(r["prompt"], r["rejected"]) for r in rows], renderer.pad_id)


def _pair_logps(trainer, renderer: PromptRenderer, rows: list[dict], size: int = 256) -> torch.Tensor:
    """Summed completion log-probs of every pair under the trainer's current weights: (2N,), interleaved."""
    out = []
    for i in range(0, len(rows), size):
        batch = tokenize_pairs(renderer, rows[i:i + size])
        out.append(sequence_logprobs(trainer.compute_logprobs(batch), batch["loss_mask"]))
    return torch.cat(out)


def _pair_accuracy(chosen_minus_rejected: torch.Tensor) -> dict[str, float]:
    return {"eval/pair_accuracy": (chosen_minus_rejected > 0).float().mean().item(),
            "eval/margin": chosen_minus_rejected.mean().item()}


def run_dpo(cfg: RunConfig) -> dict[str, float]:
    train, held_out = preference_rows(cfg.data, "train", cfg.seed), preference_rows(cfg.data, "eval", cfg.seed)
    eval_rows = prompt_rows(cfg.data, "eval", cfg.seed)
    reward_fn = reward_fn_for(cfg.reward, cfg.data.task)
    model_path, renderer = model_and_renderer(cfg)
    trainer, engine = policy_and_engine(cfg, model_path, renderer)
    # The trainer before its first update *is* the reference: score every pair once, keep no second model.
    for rows in (train, held_out):
        for row, pair in zip(rows, _pair_logps(trainer, renderer, rows).view(-1, 2).tolist()):
            row["ref_logps"] = pair
    batches = BatchIterator(train, cfg.trainer.batch_size // 2, cfg.seed)

    def step(_: int) -> dict:
        rows = batches.next()
        batch = tokenize_pairs(renderer, rows)
        batch["ref_logps"] = torch.tensor([v for r in rows for v in r["ref_logps"]])
        return trainer.dpo_step(batch, cfg.algorithm)

    def eval_fn() -> dict:
        ref = torch.tensor([v for r in held_out for v in r["ref_logps"]])
        ratios = _pair_logps(trainer, renderer, held_out) - ref
        return {**evaluate_completions(engine, renderer, eval_rows, reward_fn, cfg.eval, cfg.seed),
                **_pair_accuracy(ratios[0::2] - ratios[1::2])}

    return run_loop(cfg, step, eval_fn, answer_metric(cfg), trainer, batches, model_path)[1]


def run_rm(cfg: RunConfig) -> dict[str, float]:
    from actors.reward_model import RewardModel

    batches = BatchIterator(preference_rows(cfg.data, "train", cfg.seed), cfg.trainer.batch_size // 2, cfg.seed)
    held_out = preference_rows(cfg.data, "eval", cfg.seed)
    model_path, renderer = model_and_renderer(cfg)
    rm = RewardModel(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                     trust_remote_code=cfg.model.trust_remote_code)

    def eval_fn() -> dict:
        scores = torch.cat([rm.score(b) for b in chunks(tokenize_pairs(renderer, held_out), 256)])
        return _pair_accuracy(scores[0::2] - scores[1::2])

    return run_loop(cfg, lambda _: rm.rm_step(tokenize_pairs(renderer, batches.next())), eval_fn,
                    "eval/pair_accuracy", rm, batches, model_path)[1]
