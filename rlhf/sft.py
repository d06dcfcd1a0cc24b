"""The `sft` stage: supervised fine-tuning on prompt/answer rows, evaluated with greedy decoding, saved as a
Hugging Face folder (`<output_dir>/final`) that a later stage's `model.path` can point to."""
from __future__ import annotations

from rlhf.batch import pack_sequences
from rlhf.config import RunConfig
from rlhf.data import BatchIterator, prompt_rows
from rlhf.evaluate import evaluate
from rlhf.loop import run_loop
from rlhf.tiny import ensure_model
from rollout.rewards import resolve_reward_fn


def tokenize_sft(tokenizer, rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids, and answer ids followed by EOS (the model must learn to stop)."""
    prompts = [tokenizer(r["prompt"], add_special_tokens=False).input_ids for r in rows]
    answers = [tokenizer(r["answer"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for r in rows]
    return prompts, answers


def run_sft(cfg: RunConfig) -> dict[str, float]:
    from transformers import AutoTokenizer

    from actors.policy import PolicyTrainer
    from rollout.hf_engine import HFEngine

    # Inputs first: a bad data file or reward function fails in seconds, before any model is built or loaded.
    reward_fn = resolve_reward_fn(cfg.reward.fn, cfg.data.task)
    batches = BatchIterator(prompt_rows(cfg.data, "train", cfg.seed), cfg.trainer.batch_size, cfg.seed)
    eval_rows = prompt_rows(cfg.data, "eval", cfg.seed)
    model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    trainer = PolicyTrainer(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                            trust_remote_code=cfg.model.trust_remote_code, lora=cfg.model.lora)
    engine = HFEngine.from_model(trainer.model, tokenizer.eos_token_id, tokenizer.pad_token_id)

    def step(_: int) -> dict:
        prompts, answers = tokenize_sft(tokenizer, batches.next())
        return trainer.sft_step(pack_sequences(prompts, answers, tokenizer.pad_token_id))

    return run_loop(cfg, step, lambda: evaluate(engine, tokenizer, eval_rows, reward_fn, cfg.eval.max_new_tokens),
                    "eval/exact_match", trainer, batches, model_path)[1]
