"""One policy update (rl_step) on rows of very uneven length, micro-batched by rows (trainer.micro_batch_size) or by
padded tokens (trainer.max_tokens_per_micro_batch), each padded or packed without padding (trainer.packing), in
one process on CPU.

    python benchmarks/micro_batch_bench.py [--size 1M] [--rows 128] [--min-len 16] [--max-len 192] [--repeats 5]
                                           [--attn sdpa]

Row lengths are drawn uniformly from [min-len, max-len] (multi-turn trajectories look like this). Every setting sees
the same rows; the table gives the median seconds per update, the tokens the linear layers compute (padded rows x
width, or the real tokens when packed), and the speed-up over micro-batches of rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, build, print_table  # noqa: E402


def make_batch(rows: int, lo: int, hi: int, vocab: int, seed: int = 0):
    import torch

    from common.batch import pack_sequences
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g).tolist()
    prompts = [[5] * 8 for _ in lengths]
    completions = [torch.randint(10, vocab, (n - 8,), generator=g).tolist() for n in lengths]
    batch = pack_sequences(prompts, completions, pad_id=0)
    batch["advantages"] = torch.randn(rows, 1, generator=g) * batch["loss_mask"]
    return batch


def computed_tokens(trainer, batch) -> int:
    """Tokens through the linear layers: rows x width padded, the real tokens packed."""
    return sum(int(mb["attention_mask"].sum()) if trainer.ds.packing else mb["input_ids"].numel()
               for _, mb in trainer.ds._micro_batches(batch, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1M", choices=sorted(SIZES))
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch (the row setting)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--attn", default="sdpa", help="trainer.attn_implementation (flash_attention_2 on GPU)")
    args = p.parse_args()

    import torch

    from actors.policy import PolicyTrainer
    from common.schema import AlgorithmConfig, TrainerConfig

    torch.set_num_threads(1)
    model = build(args.size)
    batch = make_batch(args.rows, args.min_len, args.max_len, vocab=300)
    budget = args.micro * (args.min_len + args.max_len) // 2  # the same rows per micro-batch on average
    settings = {f"{args.micro} rows": (None, False), f"{budget} tokens": (budget, False),
                f"{args.micro} rows, packed": (None, True), f"{budget} tokens, packed": (budget, True)}
    trainers = {name: PolicyTrainer(model, TrainerConfig(lr=1e-5, batch_size=args.rows, micro_batch_size=args.micro,
                                                         warmup_steps=0, max_tokens_per_micro_batch=b, packing=pack,
                                                         attn_implementation=args.attn))
                for name, (b, pack) in settings.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.rl_step(dict(batch), AlgorithmConfig())
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times[f"{args.micro} rows"])
    table = [[name, statistics.median(times[name]), computed_tokens(t, batch),
              len(t.ds._micro_batches(batch, 1)), base / statistics.median(times[name])]
             for name, t in trainers.items()]
    print(f"{args.rows} rows of {args.min_len}-{args.max_len} tokens, {args.size} model, {args.attn}, one thread, "
          f"median of {args.repeats} updates:")
    print_table(["micro-batches by", "median s", "tokens computed", "micro-batches", "speed-up"], table)


if __name__ == "__main__":
    main()
