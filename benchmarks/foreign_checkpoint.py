"""A checkpoint this project did not create, trained the way others train: GRPO must improve it on its own evaluation.

    python benchmarks/foreign_checkpoint.py                 # build, SFT elsewhere (plain PyTorch), then our GRPO
    python benchmarks/foreign_checkpoint.py --grpo-steps 20

The checkpoint is Llama-style and unlike ours: its tokenizer adds `<s>` to every encoded text (a post-processor,
as Llama's does), has no pad token, and its `generation_config` lists two eos ids. `--chat` gives it a Llama-3-like
chat template that writes `<s>` itself and closes turns with `<|eot_id|>`. It is fine-tuned on the sort task by a
plain PyTorch loop, which tokenizes as users' trainers do (`tokenizer(prompt)`, so with `<s>`). Then
`python -m rlhf.run --config examples/sort_grpo.yaml model.path=<it>` trains it, and the table shows the greedy
evaluation before and after, from the run's own metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.fixtures.foreign import build_foreign_model, train_elsewhere  # noqa: E402


def main() -> None:
    from benchmarks.helpers import print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=1200)
    ap.add_argument("--hidden", type=int, default=192, help="hidden size (a multiple of 32)")
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "foreign"))
    a = ap.parse_args()
    model = os.path.join(a.out, "model")
    start = time.perf_counter()
    build_foreign_model(model, hidden=a.hidden)
    train_elsewhere(model, a.sft_steps)
    sft_s = time.perf_counter() - start
    run = os.path.join(a.out, "grpo")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlhf.run", "--config", "examples/sort_grpo.yaml", f"model.path={model}",
                    f"output_dir={run}", f"trainer.max_steps={a.grpo_steps}", "checkpoint.resume=false",
                    "logging.rollouts_every=10", "logging.rollouts_per_step=2"], check=True, cwd=ROOT)
    grpo_s = time.perf_counter() - start
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval/exact_match" in r]
    with open(os.path.join(run, "rollouts.jsonl")) as f:
        print("a dumped rollout:", f.readline().strip())
    print_table(["checkpoint", "SFT elsewhere s", "GRPO steps", "GRPO wall s", "eval EM before", "eval EM after"],
                [["foreign Llama, <s> added", sft_s, a.grpo_steps, grpo_s, evals[0]["eval/exact_match"],
                  evals[-1]["eval/exact_match"]]])


if __name__ == "__main__":
    main()
