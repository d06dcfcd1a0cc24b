"""Workloads as users bring them, through `python -m rlhf.run`: a Llama-style checkpoint this project did not
create (its tokenizer adds <s>, no pad token, two eos ids) trained by GRPO on a prompt file with no answer column;
and the chat recipe pair (TRL-style `messages` for SFT, verl-style nested ground truth for GRPO, the math verifier).
rollouts.jsonl must show the prompts exactly as the model saw them."""
import json

import pytest

from rlhf.config import DataConfig
from rlhf.outputs.metrics import read_metrics
from rlhf.stages.tasks import make_rows
from tests.fixtures.foreign import build_foreign_model, train_elsewhere
from tests.helpers import run_cli


def read_rollouts(run_dir) -> list[dict]:
    with open(run_dir / "rollouts.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_grpo_on_a_foreign_bos_checkpoint_and_a_prompt_only_file(tmp_path):
    from transformers import AutoTokenizer

    model = build_foreign_model(str(tmp_path / "model"))
    train_elsewhere(model, steps=60)
    prompts = [r["prompt"] for r in make_rows(DataConfig(task="sort", num_train=256, max_items=4), "train", 0)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"question": p}) + "\n" for p in prompts))
    out = tmp_path / "grpo"
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={model}", f"output_dir={out}",
                  "data.task=null", f"data.train_path={tmp_path / 'prompts.jsonl'}",
                  f"data.eval_path={tmp_path / 'prompts.jsonl'}", "data.prompt_key=question",
                  "reward.fn=sort",  # reads the numbers from the prompt: no answer column needed
                  "rollout.prompts_per_step=16", "trainer.batch_size=128", "trainer.max_steps=4", "eval.every=0",
                  "eval.n_samples=2", "logging.rollouts_every=2", "logging.rollouts_per_step=3",
                  "placement.mode=hybrid", timeout=900)  # one process fewer: the tokenizer is what this test is about
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == list(range(5))
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows[1:])  # trainer saw the ids vLLM generated from
    assert {"eval/accuracy", "eval/pass@1", "eval/pass@2"} <= set(rows[0]) and "eval/accuracy" in rows[-1]
    tok = AutoTokenizer.from_pretrained(model)
    dumps = read_rollouts(out)
    assert [d["step"] for d in dumps] == [2, 2, 2, 4, 4, 4]
    for d in dumps:
        assert d["prompt"].startswith("<s>sort ") and d["prompt"].count("<s>") == 1
        assert d["prompt"] == tok.decode(tok(d["prompt"][3:]).input_ids)  # = tokenizer(prompt), rendered
        assert d["finish_reason"] in ("stop", "length") and 0.0 <= d["reward"] <= 1.0


@pytest.mark.slow
def test_chat_recipe_pair_sft_then_grpo(tmp_path):
    from transformers import AutoTokenizer

    sft, rl, evals = tmp_path / "sft", tmp_path / "grpo", tmp_path / "eval.jsonl"
    with open("examples/data/chat_math_eval.jsonl") as f:
        evals.write_text("".join(f.readlines()[:32]))  # both runs evaluate twice: 32 of the 128 prompts
    res = run_cli("--config", "examples/chat_math_sft.yaml", f"output_dir={sft}", "trainer.max_steps=40",
                  "eval.every=0", "checkpoint.every=0", f"data.eval_path={evals}", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "eval/accuracy" in res.stdout
    res = run_cli("--config", "examples/chat_math_grpo.yaml", f"output_dir={rl}", f"model.path={sft}/final",
                  "trainer.max_steps=2", "eval.every=0", "rollout.prompts_per_step=16",
                  "logging.rollouts_every=1", f"data.eval_path={evals}", "placement.mode=hybrid", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(rl))
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows[1:]) and "eval/pass@4" in rows[0]
    tok = AutoTokenizer.from_pretrained(sft / "final")
    with open("examples/data/chat_math_rl.jsonl") as f:
        templated = {tok.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True, tokenize=False)
                     for line in f}
    dumps = read_rollouts(rl)
    assert [d["step"] for d in dumps] == [1] * 4 + [2] * 4
    for d in dumps:
        assert d["prompt"] in templated and d["prompt"].endswith("<|im_start|>assistant\n")
        assert d["completion"].endswith(("<|im_end|>", "<|endoftext|>")) == (d["finish_reason"] == "stop")
        assert d["reward"] in (0.0, 1.0)
