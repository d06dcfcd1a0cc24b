"""Where the train phase goes: one GRPO update (PolicyTrainer.rl_step, DeepSpeed) against the same update written as
a bare PyTorch loop (the HF model, torch.optim.AdamW, the same micro-batches and loss), in one process on CPU.

    python benchmarks/train_phase.py [--size 1M | --model DIR] [--rows 256] [--micro 64] [--repeats 7] [--profile 15]
    OMP_NUM_THREADS=2 python benchmarks/train_phase.py     # two torch threads (default: one, as each trainer rank)

The rows look like one trainer rank's share of vs_trl.py's GRPO step (64 prompts x 8 samples over two ranks):
16-token prompts, 4-16 sampled tokens. The table gives the median seconds per update of both and their ratio (what
the framework adds over the arithmetic); `--profile N` prints the N functions with the most own time inside
rl_step (cProfile), where the framework's share shows up.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: DeepSpeed's set-up resets set_num_threads

from benchmarks.helpers import SIZES, build, print_table  # noqa: E402


def grpo_rows(rows: int, vocab: int, seed: int = 0):
    import torch

    from common.batch import pack_sequences
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (16,), generator=g).tolist() for _ in range(rows)]
    completions = [torch.randint(10, vocab, (int(torch.randint(4, 17, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(rows)]
    batch = pack_sequences(prompts, completions, pad_id=0)
    batch["advantages"] = torch.randn(rows, 1, generator=g) * batch["loss_mask"]
    return batch


class BareLoop:
    """The same update with nothing but PyTorch: forward, the clipped loss over the global token count, backward per
    micro-batch of `micro` rows (in row order), one AdamW step, gradient clipping."""

    def __init__(self, model_path: str, lr: float, micro: int):
        import torch
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.micro = micro

    def step(self, batch) -> None:
        import torch

        from algorithms.logprobs import token_logprobs
        from algorithms.ppo import policy_loss
        tokens = float(batch["loss_mask"].sum())
        for lo in range(0, len(batch["input_ids"]), self.micro):
            mb = {k: v[lo:lo + self.micro] for k, v in batch.items()}
            width = int(mb["attention_mask"].sum(1).max())  # cut to the longest row, as ours does
            ids, attn = mb["input_ids"][:, :width], mb["attention_mask"][:, :width]
            logits = self.model(input_ids=ids, attention_mask=attn).logits
            logp = token_logprobs(logits[:, :-1], ids[:, 1:])
            loss, _ = policy_loss(logp, logp.detach(), mb["advantages"][:, :width - 1], mb["loss_mask"][:, :width - 1],
                                  normalizer=tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def top_functions(fn, n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1M", choices=sorted(SIZES))
    p.add_argument("--model", default=None, help="a checkpoint folder instead of --size (e.g. vs_trl's SFT model)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", type=int, default=15, help="functions to list from a profile of rl_step (0: none)")
    args = p.parse_args()

    import torch

    from actors.policy import PolicyTrainer
    from common.options import AlgorithmConfig, TrainerConfig

    torch.set_num_threads(1)
    model = args.model or build(args.size)
    batch = grpo_rows(args.rows, vocab=300)
    ours = PolicyTrainer(model, TrainerConfig(lr=5e-4, batch_size=args.rows, micro_batch_size=args.micro,
                                              warmup_steps=0, grad_clip=1.0, weight_decay=0.0))
    bare = BareLoop(model, 5e-4, args.micro)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runs = {"ours (PolicyTrainer.rl_step)": lambda: ours.rl_step(dict(batch), AlgorithmConfig()),
            "bare PyTorch loop": lambda: bare.step(batch)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up: first-call allocations and lazy inits
        fn()
    for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["bare PyTorch loop"])
    print(f"{args.rows} rows (16-token prompts, 4-16 sampled tokens), micro-batches of {args.micro}, {args.size} "
          f"model{' ' + model if args.model else ''}, {torch.get_num_threads()} torch thread(s), median of {args.repeats} updates:")
    print_table(["update", "median s", "ratio to bare"],
                [[name, statistics.median(t), statistics.median(t) / base] for name, t in times.items()])
    if args.profile:
        print(f"\nrl_step, the {args.profile} functions with the most own time (cProfile):")
        print(top_functions(runs["ours (PolicyTrainer.rl_step)"], args.profile))


if __name__ == "__main__":
    main()
