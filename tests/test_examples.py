"""Every shipped recipe loads and validates."""
import glob
import json
import os

import pytest

from rlhf.config import load_config
from tests.helpers import ROOT

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, ROOT))
def test_example_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.output_dir.startswith("runs/") and len(cfg.output_dir) > len("runs/")


def test_recipes_write_to_folders_of_their_own():
    dirs = [load_config(path).output_dir for path in EXAMPLES]
    assert len(set(dirs)) == len(dirs)


def test_gsm8k_gpu_recipe_reads_both_gsm8k_shapes(tmp_path):
    """The GPU GSM8K recipe on parquet files in verl's shape and in the original one (question, "... #### 72")."""
    import datasets

    from rlhf.stages.data import prompt_rows
    from rollout.rewards import resolve_reward_fn, score_rows

    q = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell altogether?"
    verl = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}
    datasets.Dataset.from_list([verl]).to_parquet(str(tmp_path / "verl.parquet"))
    datasets.Dataset.from_list([{"question": q, "answer": "48 / 2 = 24 in May.\n48 + 24 = 72\n#### 72"}]).to_parquet(
        str(tmp_path / "orig.parquet"))
    recipe = os.path.join(ROOT, "examples", "gpu", "qwen2.5-0.5b-instruct_gsm8k_grpo.yaml")
    shapes = [[f"data.train_path={tmp_path / 'verl.parquet'}"],
              [f"data.train_path={tmp_path / 'orig.parquet'}", "data.prompt_key=question", "data.answer_key=answer",
               "data.apply_chat_template=true"]]
    for overrides in shapes:
        cfg = load_config(recipe, overrides)
        rows = prompt_rows(cfg.data, "train", cfg.seed)
        fn = resolve_reward_fn(cfg.reward.fn, cfg.data.task)
        assert score_rows(fn, [rows[0]] * 2, ["So \\boxed{72}.", "It is 70."]) == [1.0, 0.0]


def test_chat_math_data_is_what_its_script_writes(tmp_path):
    """The shipped data files are reproducible: the script rewrites them byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_chat_math", os.path.join(ROOT, "examples", "data",
                                                                                   "make_chat_math.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(tmp_path))
    for name in ("chat_math_sft.jsonl", "chat_math_rl.jsonl", "chat_math_eval.jsonl"):
        with open(os.path.join(ROOT, "examples", "data", name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name


def test_word_math_data_is_what_its_script_writes(tmp_path):
    import subprocess
    import sys
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "data", "make_word_math.py"), "--out-dir",
                    str(tmp_path)], check=True)
    for name in ("word_math_rl.jsonl", "word_math_eval.jsonl"):
        with open(os.path.join(ROOT, "examples", "data", name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name
    prompts = {json.loads(line)["prompt"][0]["content"] for line in open(tmp_path / "word_math_rl.jsonl")}
    assert not prompts & {json.loads(line)["prompt"][0]["content"] for line in open(tmp_path / "word_math_eval.jsonl")}


def test_the_real_model_recipe_names_the_cache_and_says_how_to_fill_it(tmp_path, monkeypatch):
    from common.errors import UserError
    from rlhf.weights.tiny import ensure_model

    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path))
    cfg = load_config(os.path.join(ROOT, "examples", "smollm2_math_grpo.yaml"))
    assert cfg.model.path == str(tmp_path / "models" / "SmolLM2-135M-Instruct")
    with pytest.raises(UserError, match="python -m rlhf.models smollm2-135m-instruct"):
        ensure_model(cfg.model.path, cfg.model.tiny, str(tmp_path / "run"), 0)
