"""The offline preference stages. `dpo`: the policy learns from chosen/rejected pairs against reference log-probs
computed once, before the first update. `rm`: a reward model learns the same pairs (Bradley-Terry) and reports held-out
pair accuracy. Both save a Hugging Face folder in `<output_dir>/final`."""
from __future__ import annotations

import torch

from rlhf.batch import Batch, chunks, pack_pairs, sequence_logprobs
from rlhf.config import RunConfig
from rlhf.data import BatchIterator, preference_rows, prompt_rows
from rlhf.evaluate import evaluate
from rlhf.loop import run_loop
from rlhf.tiny import ensure_model
from rollout.rewards import resolve_reward_fn


def tokenize_pairs(tokenizer, rows: list[dict]) -> Batch:
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    eos = [tokenizer.eos_token_id]
    return pack_pairs([ids(r["prompt"]) for r in rows], [ids(r["chosen"]) + eos for r in rows],
                      [ids(r["rejected"]) + eos for r in rows], tokenizer.pad_token_id)


def _pair_logps(trainer, tokenizer, rows: list[dict], size: int = 256) -> torch.Tensor:
    """Summed completion log-probs of every pair under the trainer's current weights: (2N,), interleaved."""
    out = []
    for i in range(0, len(rows), size):
        batch = tokenize_pairs(tokenizer, rows[i:i + size])
        out.append(sequence_logprobs(trainer.compute_logprobs(batch), batch["loss_mask"]))
    return torch.cat(out)


def _pair_accuracy(chosen_minus_rejected: torch.Tensor) -> dict[str, float]:
    return {"eval/pair_accuracy": (chosen_minus_rejected > 0).float().mean().item(),
            "eval/margin": chosen_minus_rejected.mean().item()}


def run_dpo(cfg: RunConfig) -> dict[str, float]:
    from transformers import AutoTokenizer

    from actors.policy import PolicyTrainer
    from rollout.hf_engine import HFEngine

    train, held_out = preference_rows(cfg.data, "train", cfg.seed), preference_rows(cfg.data, "eval", cfg.seed)
    eval_rows, reward_fn = prompt_rows(cfg.data, "eval", cfg.seed), resolve_reward_fn(cfg.reward.fn, cfg.data.task)
    model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    trainer = PolicyTrainer(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                            trust_remote_code=cfg.model.trust_remote_code)
    # The trainer before its first update *is* the reference: score every pair once, keep no second model.
    for rows in (train, held_out):
        for row, pair in zip(rows, _pair_logps(trainer, tok, rows).view(-1, 2).tolist()):
            row["ref_logps"] = pair
    batches = BatchIterator(train, cfg.trainer.batch_size // 2, cfg.seed)
    engine = HFEngine.from_model(trainer.model, tok.eos_token_id, tok.pad_token_id)

    def step(_: int) -> dict:
        rows = batches.next()
        batch = tokenize_pairs(tok, rows)
        batch["ref_logps"] = torch.tensor([v for r in rows for v in r["ref_logps"]])
        return trainer.dpo_step(batch, cfg.algorithm)

    def eval_fn() -> dict:
        ratios = _pair_logps(trainer, tok, held_out) - torch.tensor([v for r in held_out for v in r["ref_logps"]])
        return {**evaluate(engine, tok, eval_rows, reward_fn, cfg.eval.max_new_tokens),
                **_pair_accuracy(ratios[0::2] - ratios[1::2])}

    return run_loop(cfg, step, eval_fn, "eval/exact_match", trainer, batches, model_path)[1]


def run_rm(cfg: RunConfig) -> dict[str, float]:
    from transformers import AutoTokenizer

    from actors.reward_model import RewardModel

    batches = BatchIterator(preference_rows(cfg.data, "train", cfg.seed), cfg.trainer.batch_size // 2, cfg.seed)
    held_out = preference_rows(cfg.data, "eval", cfg.seed)
    model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    rm = RewardModel(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                     trust_remote_code=cfg.model.trust_remote_code)

    def eval_fn() -> dict:
        scores = torch.cat([rm.score(b) for b in chunks(tokenize_pairs(tok, held_out), 256)])
        return _pair_accuracy(scores[0::2] - scores[1::2])

    return run_loop(cfg, lambda _: rm.rm_step(tokenize_pairs(tok, batches.next())), eval_fn,
                    "eval/pair_accuracy", rm, batches, model_path)[1]
