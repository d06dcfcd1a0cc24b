"""One LoRA update of ours against the same update written the way TRL computes it, on identical rows: does our
LoRA path (PEFT inside DeepSpeed, shared-prefix forward, tempered log-probs, KL to the adapter-disabled model) send
the adapter the gradient TRL's would?

    python benchmarks/lora_one_update.py [--precision bf16-true,bf16-mixed] [--prompts 16] [--samples 4]

Rows: held-out word problems, `--samples` completions each sampled from the base model (transformers, temperature
0.6), scored by the math verifier, GRPO advantages. Both sides start from the same adapter (A copied from ours, B
zero), so step 1's gradient reaches only B; a second pass with B set to a small random matrix (the same on both
sides) checks A's gradient too. The reference side: the fp32 model under bf16 autocast (TRL's --bf16), PEFT's LoRA,
log-probs of softmax(logits / T), the clipped objective with k3 KL in the loss, DAPO's token-mean. Printed: per
module kind, the cosine and norm ratio of ours against it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import print_table  # noqa: E402

TEMPERATURE, BETA, TARGETS = 0.6, 0.01, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sampled_rows(model_dir: str, prompts: int, samples: int):
    """Prompts from the held-out file with `samples` base-model completions each, packed, with advantages."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from common.batch import pack_sequences
    from rollout.render import PromptRenderer
    from rollout.rewards import math_reward

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = [json.loads(line) for line in open(os.path.join(root, "examples/data/word_math_eval.jsonl"))][:prompts]
    renderer = PromptRenderer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    torch.manual_seed(0)
    ids, outs, rewards = [], [], []
    for r in rows:
        prompt, stops = renderer.prompt_ids(r["prompt"]), list(renderer.stop_ids([r["prompt"]]))
        got = model.generate(torch.tensor([prompt] * samples), do_sample=True, temperature=TEMPERATURE, top_k=0,
                             max_new_tokens=64, eos_token_id=stops, pad_token_id=renderer.pad_id)
        for seq in got[:, len(prompt):].tolist():
            end = next((i for i, t in enumerate(seq) if t in stops), None)
            ids.append(prompt)
            outs.append(seq if end is None else seq[:end + 1])
        rewards += math_reward([r["prompt"]] * samples, [renderer.decode(o) for o in outs[-samples:]],
                               answer=[r["reward_model"]["ground_truth"]] * samples)
    batch = pack_sequences(ids, outs, pad_id=renderer.pad_id)
    r = torch.tensor(rewards).view(prompts, samples)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    batch["advantages"] = adv * batch["loss_mask"]
    return batch, statistics.mean(rewards)


def trl_style_grads(model_dir: str, batch, adapter: dict) -> dict:
    """The adapter's gradient as TRL computes it: fp32 weights under bf16 autocast, PEFT LoRA."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                                       task_type="CAUSAL_LM"))
    model.load_state_dict({k: v.float() for k, v in adapter.items()}, strict=False)
    mask = batch["loss_mask"].float()

    def logps():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(
            -1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    with torch.no_grad(), model.disable_adapter():
        ref = logps()
    logp = logps()
    ratio = torch.exp(logp - logp.detach())  # on-policy: 1, the gradient of the clipped objective
    adv = batch["advantages"]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    total = ((loss + BETA * kl) * mask).sum() / mask.sum()
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def summed_gradients(model) -> dict:
    """name -> each trained parameter's gradient summed over the step's micro-batches, filled in as the backward
    runs (the step's optimizer zeroes .grad before the caller could read it)."""
    grads: dict = {}

    def keep(g, name):
        grads[name] = grads.get(name, 0) + g.detach().clone()
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: keep(g, name))
    return grads


def our_grads(model_dir: str, batch, precision: str, adapter: dict | None) -> tuple[dict, dict]:
    """Our PolicyTrainer's adapter gradient on the same rows (the LoRA recipe's settings), and its adapter."""
    import torch

    from actors.policy import PolicyTrainer
    from rlhf.config import AlgorithmConfig, LoraConfig, TrainerConfig

    tr = TrainerConfig(lr=5e-4, batch_size=len(batch["input_ids"]), micro_batch_size=16, warmup_steps=0,
                       shared_prefix=True, precision=precision)
    trainer = PolicyTrainer(model_dir, tr, dtype="bfloat16", lora=LoraConfig(rank=16, alpha=32, target_modules=TARGETS),
                            logprob_temperature=TEMPERATURE)
    if adapter is not None:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if n in adapter:
                    p.copy_(adapter[n])
    state = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    grads = summed_gradients(trainer.model)
    ref = trainer.compute_ref_logprobs(batch)
    trainer.rl_step(dict(batch, ref_logprobs=ref), AlgorithmConfig(kl_coef=BETA, clip_low=0.2, clip_high=0.28))
    return grads, state


def compare(ours: dict, theirs: dict) -> list[list]:
    import torch
    rows = []
    for kind in TARGETS:
        for factor in ("lora_A", "lora_B"):
            names = [n for n in ours if f".{kind}." in n and factor in n]
            if not names:
                continue
            a = torch.cat([ours[n].float().flatten() for n in names])
            b = torch.cat([theirs[n].float().flatten() for n in names])
            if b.norm() == 0:
                continue
            rows.append([f"{kind}.{factor}", float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
                         float(a.norm() / b.norm())])
    return rows


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16-true,bf16-mixed")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    a = p.parse_args()
    from rlhf import smollm2
    model = smollm2.provision()
    batch, reward = sampled_rows(model, a.prompts, a.samples)
    print(f"rows: {len(batch['input_ids'])}, mean reward {reward:.3f}")
    for precision in a.precision.split(","):
        _, start = our_grads(model, batch, precision, None)  # only for its freshly initialised adapter
        g = torch.Generator().manual_seed(1)
        warm = {n: (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) if "lora_B" in n else v
                for n, v in start.items()}
        table = []
        for label, adapter in (("B = 0 (step 1)", start), ("B random (later steps)", warm)):
            ours, _ = our_grads(model, batch, precision, adapter)
            theirs = trl_style_grads(model, batch, adapter)
            table += [[label, *row] for row in compare(ours, theirs)]
        print(f"\ntrainer.precision={precision}: adapter gradient, ours against TRL's computation")
        print_table(["adapter", "module.factor", "cosine", "norm ours / TRL"], table)


if __name__ == "__main__":
    main()
