"""Which opening lets SmolLM2-135M-Instruct play the guessing game (rollout.multiturn.guess)? For each candidate
opening: how often the model's first turn is a bare number or holds one, and, after a first guess of 5 answered
"higher", how often its next turn names a number in the range it was told. Sampled by vLLM at the recipe's temperature,
16 samples each, through the checkpoint's chat template. Prints a table (docs/real-model.md quotes it).

    .venv/bin/python benchmarks/guess_openings.py
"""
from __future__ import annotations

import argparse
import re
import sys

OPENINGS = [
    "Let's play a game. I am thinking of a whole number from 1 to 10. Guess it: reply with just the number.",
    "Guess my secret number. It is between 1 and 10. Reply with one number only, for example: 5",
    "Pick a number from 1 to 10. Reply with just the number.",
    "I picked a number from 1 to 10. What is your guess? Answer with a single number.",
]
FOLLOW_UP = "higher, 6 to 10"  # what GuessNumber answers a guess of 5 when the secret is above it


def first_number(text: str):
    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.6)
    args = p.parse_args()
    sys.path.insert(0, ".")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from rlhf import smollm2
    from rollout.engines.vllm import VLLMEngine

    path = smollm2.model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    llm = VLLMEngine(path, dtype="bfloat16", max_model_len=384, kv_cache_mb=256).llm
    params = SamplingParams(temperature=args.temperature, max_tokens=16, n=args.samples, seed=0)

    def sample(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        return [o.text for o in llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs]

    print(f"| opening | first turn a bare number | holds a number | after '{FOLLOW_UP}': a number in 6..10 |")
    print("|---|---|---|---|")
    for opening in OPENINGS:
        first = sample([{"role": "user", "content": opening}])
        bare = sum(bool(re.fullmatch(r"\s*\d+\.?\s*", t)) for t in first) / len(first)
        held = sum(first_number(t) is not None for t in first) / len(first)
        nxt = sample([{"role": "user", "content": opening}, {"role": "assistant", "content": "5"},
                      {"role": "user", "content": FOLLOW_UP}])
        in_range = sum(6 <= (first_number(t) or 0) <= 10 for t in nxt) / len(nxt)
        print(f"| {opening} | {bare:.2f} | {held:.2f} | {in_range:.2f} |")


if __name__ == "__main__":
    main()
