"""A model folder whose tokenizer has its own code (an `auto_map` in tokenizer_config.json, run with
model.trust_remote_code): the trainer's Hugging Face copies (every checkpoint's, the final model) carry that
tokenizer and its code. Before, they were saved through transformers' generic tokenizer: the folder kept the
auto_map but not the code file, so the next stage could not load it."""
import json
import shutil

import pytest

from rlhf.config import TrainerConfig

CODE = '''from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    """The tiny kit's tokenizer, under a class only this folder's code defines."""
'''


def with_custom_tokenizer(model_dir: str, folder) -> str:
    shutil.copytree(model_dir, folder)
    (folder / "custom_tok.py").write_text(CODE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.slow
def test_a_tokenizer_with_its_own_code_is_saved_with_the_trainers_model(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from actors.policy import PolicyTrainer
    from actors.reward_model import RewardModel

    model = with_custom_tokenizer(tiny_model_dir, tmp_path / "custom")
    tr = TrainerConfig(batch_size=4, micro_batch_size=4)
    PolicyTrainer(model, tr, trust_remote_code=True).save_hf(str(tmp_path / "policy"), model)
    RewardModel(model, tr, trust_remote_code=True).save_hf(str(tmp_path / "rm"), model)
    for saved in ("policy", "rm"):
        tok = AutoTokenizer.from_pretrained(str(tmp_path / saved), trust_remote_code=True)
        assert type(tok).__name__ == "CustomTokenizer"
        assert tok("3 1 2").input_ids == AutoTokenizer.from_pretrained(tiny_model_dir)("3 1 2").input_ids
