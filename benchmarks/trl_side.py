"""The TRL half of benchmarks/vs_trl.py. Runs inside TRL's own virtualenv (never the project's), started by
vs_trl.py with the repo on PYTHONPATH only so that the identical reward function (rollout.rewards) is used.

    python benchmarks/trl_side.py grpo|dpo --model DIR --data FILE.jsonl --out DIR --steps N [--lr 5e-4]
    python benchmarks/trl_side.py grpo --reward math --bf16 --temperature 0.6 ...   # chat prompts (vs_trl_real.py)

Writes `<out>/steps.jsonl` (one row per optimizer step: wall seconds, TRL's logged metrics) and the trained model
in `<out>/final`.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def timing_callback(path: str):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Wall time of every optimizer step, and TRL's logged metrics for it, one JSON row per step. The Trainer
        logs a step's metrics after its on_step_end, so each row is written when its logs arrive."""

        def __init__(self):
            self.last, self.pending, self.file = None, None, open(path, "w", encoding="utf-8")

        def on_train_begin(self, args, state, control, **kwargs):
            self.file.write(json.dumps({"event": "train_begin", "time": time.time()}) + "\n")
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self._flush()
            self.pending, self.last = {"step": state.global_step, "seconds": now - self.last}, now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is not None:
                self.pending.update(logs or {})
                self._flush()

        def on_train_end(self, args, state, control, **kwargs):
            self._flush()

        def _flush(self):
            if self.pending is not None:
                self.file.write(json.dumps(self.pending) + "\n")
                self.file.flush()
                self.pending = None

    return StepTimes()


def common_args(a) -> dict:
    """Settings both trainers share: on CPU, constant LR, no warm-up, clip 1.0, no saving or reporting. `--bf16`
    is TRL's mixed precision (fp32 weights, bf16 autocast), what our DeepSpeed bf16 does too."""
    return dict(output_dir=a.out, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, bf16=a.bf16, fp16=False, seed=a.seed, dataloader_num_workers=0,
                disable_dropout=True)


def run_grpo(a, model, tok, rows: list[dict]):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout.rewards import math_reward, sort_reward

    scorer = math_reward if a.reward == "math" else sort_reward

    def reward(prompts, completions, answer, **_):
        # chat prompts come back as messages: the reply is the last message's text, what our renderer decodes
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return scorer(prompts, texts, answer=answer)

    # one generation batch of prompts x samples completions, trained in `samples` micro-batches of `prompts` rows
    cfg = GRPOConfig(**common_args(a), per_device_train_batch_size=a.prompts, gradient_accumulation_steps=a.samples,
                     num_generations=a.samples, max_completion_length=a.max_new_tokens, temperature=a.temperature,
                     top_p=1.0, top_k=0, beta=a.beta, epsilon=0.2, epsilon_high=a.epsilon_high, num_iterations=1,
                     loss_type=a.loss_type, scale_rewards="group",
                     shuffle_dataset=False)  # rows come in the order our controller draws them
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    peft = None
    if a.lora_rank > 0:  # the reference is then the adapter-disabled model, as ours
        from peft import LoraConfig
        peft = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=a.lora_targets.split(","))
    return GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                       peft_config=peft)


def run_dpo(a, model, tok, rows: list[dict]):
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        """Pairs in the order our loop draws them (the file's order), not reshuffled."""

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    cfg = DPOConfig(**common_args(a), per_device_train_batch_size=a.prompts, beta=0.1, precompute_ref_log_probs=True,
                    loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0])  # = our dpo_nll_coef 1
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    return InOrder(model=model, args=cfg, train_dataset=data, processing_class=tok)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser()
    p.add_argument("algo", choices=["grpo", "dpo"])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--prompts", type=int, default=64, help="prompts (grpo) or pairs (dpo) per step")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--epsilon-high", type=float, default=0.2, help="upper clip (our algorithm.clip_high)")
    p.add_argument("--loss-type", default="grpo", help="TRL's loss_type (dapo = our token-mean over the batch)")
    p.add_argument("--reward", choices=["sort", "math"], default="sort")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (our algorithm.kl_coef)")
    p.add_argument("--lora-rank", type=int, default=0, help="a PEFT LoRA adapter of this rank; 0 = full weights")
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the cores TRL may use)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rows = [json.loads(line) for line in open(a.data, encoding="utf-8")]
    tok = AutoTokenizer.from_pretrained(a.model)
    probe = rows[0]["prompt"]
    plain = not isinstance(probe, str) or tok(probe).input_ids == tok(probe, add_special_tokens=False).input_ids
    assert plain, "prompt tokenization differs"  # chat prompts go through the template, as ours do
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    os.makedirs(a.out, exist_ok=True)
    trainer = (run_grpo if a.algo == "grpo" else run_dpo)(a, model, tok, rows)
    trainer.add_callback(timing_callback(os.path.join(a.out, "steps.jsonl")))
    trainer.train()
    if a.lora_rank > 0:  # a whole model to score, as our run's final/ (merged)
        trainer.model.merge_and_unload().save_pretrained(os.path.join(a.out, "final"))
    else:
        trainer.save_model(os.path.join(a.out, "final"))
    tok.save_pretrained(os.path.join(a.out, "final"))


if __name__ == "__main__":
    main()
