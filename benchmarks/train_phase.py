"""Where the train phase goes: one GRPO update (PolicyTrainer.rl_step, DeepSpeed) against the same update written as
a bare PyTorch loop (the HF model, torch.optim.AdamW, the same micro-batches and loss), in one process on CPU.

    python benchmarks/train_phase.py [--size 1M | --model DIR] [--vocab N] [--rows 256] [--micro 64] [--repeats 7]
                                     [--profile 15]
    OMP_NUM_THREADS=2 python benchmarks/train_phase.py     # two torch threads (default: one, as each trainer rank)

The rows look like one trainer rank's share of vs_trl.py's GRPO step (64 prompts x 8 samples over two ranks):
16-token prompts, 4-16 sampled tokens. The table gives the median seconds per update of both and their ratio (what
the framework adds over the arithmetic), and ours with logits for every position (what it computed before it kept
only those from the first trained token on: actors.logits); `--vocab N` widens the model's vocabulary to N (a real
tokenizer's 32k-150k: the LM head's share grows with it); `--profile N` prints the N functions with the most own
time inside rl_step (cProfile), where the framework's share shows up. A second table puts the update's arithmetic rate
(6 x parameters x the rows' real tokens, per second: the arithmetic the update cannot avoid) beside what one
matmul reaches on this core, at the model's own shapes and at 1024^3: how close the update is to the machine's.
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

    def __init__(self, model_path: str, lr: float, micro: int, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32)
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


def with_vocab(model_path: str, vocab: int) -> str:
    """A copy of the model with its vocabulary resized to `vocab` (new rows random): the LM head of a real tokenizer."""
    import tempfile

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    out = os.path.join(tempfile.mkdtemp(prefix="rlhf-vocab-"), f"vocab-{vocab}")
    model.save_pretrained(out)
    return out


def matmul_gflops(m: int, k: int, n: int, repeats: int = 20) -> float:
    """Median GFLOP/s of (m x k) @ (k x n) in fp32 on the current torch threads."""
    import torch
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def arithmetic_rate(model_path: str, batch, micro: int, seconds: float) -> list[list]:
    """The update's GFLOP/s (6 N T: forward 2, backward 4, for N parameters and the T real tokens of the rows; the
    padding a micro-batch computes is not counted) beside matmul rates: at the model's MLP shape for one padded
    micro-batch, and at 1024^3."""
    import json
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    from transformers import AutoModelForCausalLM
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    widths = [int(batch["attention_mask"][lo:lo + micro].sum(1).max()) * len(batch["input_ids"][lo:lo + micro])
              for lo in range(0, len(batch["input_ids"]), micro)]
    tokens = int(batch["attention_mask"].sum())
    update = 6 * n_params * tokens / seconds / 1e9
    mlp = matmul_gflops(widths[0], cfg["hidden_size"], cfg["intermediate_size"])
    big = matmul_gflops(1024, 1024, 1024)
    return [["the update (6 x params x real tokens)", update, update / big],
            [f"matmul {widths[0]}x{cfg['hidden_size']}x{cfg['intermediate_size']} (the model's MLP)", mlp, mlp / big],
            ["matmul 1024^3", big, 1.0]]


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
    p.add_argument("--vocab", type=int, default=0, help="resize the model's vocabulary to this many tokens")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", type=int, default=15, help="functions to list from a profile of rl_step (0: none)")
    args = p.parse_args()

    import torch

    from actors.policy import PolicyTrainer
    from common.schema import AlgorithmConfig, TrainerConfig

    torch.set_num_threads(1)
    model = args.model or build(args.size)
    if args.vocab:
        model = with_vocab(model, args.vocab)
    batch = grpo_rows(args.rows, vocab=300)
    tr = TrainerConfig(lr=5e-4, batch_size=args.rows, micro_batch_size=args.micro, warmup_steps=0, grad_clip=1.0,
                       weight_decay=0.0)
    ours, every = PolicyTrainer(model, tr), PolicyTrainer(model, tr)
    every.ds.trims_logits = False
    bare = BareLoop(model, 5e-4, args.micro)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runs = {"ours (PolicyTrainer.rl_step)": lambda: ours.rl_step(dict(batch), AlgorithmConfig()),
            "ours, logits for every position": lambda: every.rl_step(dict(batch), AlgorithmConfig()),
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
          f"model{' ' + model if args.model else ''}{f', vocabulary {args.vocab}' if args.vocab else ''}, "
          f"{torch.get_num_threads()} torch thread(s), median of "
          f"{args.repeats} updates:")
    print_table(["update", "median s", "ratio to bare"],
                [[name, statistics.median(t), statistics.median(t) / base] for name, t in times.items()])
    print(f"\nArithmetic rate, {torch.get_num_threads()} torch thread(s):")
    print_table(["what", "GFLOP/s", "of 1024^3 matmul"],
                arithmetic_rate(model, batch, args.micro, statistics.median(times["ours (PolicyTrainer.rl_step)"])))
    if args.profile:
        print(f"\nrl_step, the {args.profile} functions with the most own time (cProfile):")
        print(top_functions(runs["ours (PolicyTrainer.rl_step)"], args.profile))


if __name__ == "__main__":
    main()
