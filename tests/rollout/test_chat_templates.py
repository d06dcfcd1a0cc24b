"""data.chat_template: a chat template for a checkpoint that has none (a base model such as Gemma-3-270M), built in
or from a Jinja file; a stage started from the run's saved model renders the same way without naming it again."""
import json

import pytest

from common.errors import UserError
from rollout.render import PromptRenderer
from tests.fixtures.foreign import CHAT_TEMPLATE, build_foreign_model, foreign_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort 3 1 ="}]


@pytest.fixture(scope="module")
def base_with_gemma_tokens(tmp_path_factory):
    """A base checkpoint's folder (no chat template) whose vocabulary has Gemma's turn markers, as Gemma-3's has."""
    out = str(tmp_path_factory.mktemp("gemma_tokens"))
    tok = foreign_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.save_pretrained(out)
    return out


def test_the_gemma_template_writes_gemma_turns_with_one_bos_and_stops_on_the_turn_close(base_with_gemma_tokens):
    r = PromptRenderer.from_pretrained(base_with_gemma_tokens, chat_template="gemma")
    ids = r.prompt_ids(CHAT)
    assert r.render_text(ids) == "<s><start_of_turn>user\nBe brief.\n\nsort 3 1 =<end_of_turn>\n<start_of_turn>model\n"
    assert ids.count(r.tokenizer.bos_token_id) == 1
    close = r.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert r.close_id == close and close in r.stop_ids([CHAT])
    assert r.answer_ids(CHAT, "1 3")[-1] == close  # SFT trains the model to close its turn
    assert PromptRenderer.from_pretrained(base_with_gemma_tokens).close_id is None  # the folder itself is unchanged


def test_a_template_file_is_used_and_a_bad_name_or_missing_markers_are_named(tmp_path, base_with_gemma_tokens):
    path = tmp_path / "llama3.jinja"
    path.write_text(CHAT_TEMPLATE)
    r = PromptRenderer.from_pretrained(base_with_gemma_tokens, chat_template=str(path))
    assert r.render_text(r.prompt_ids(CHAT[1:])).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(UserError, match=r"data.chat_template: 'chatml' writes <\|im_start\|> and <\|im_end\|>"):
        PromptRenderer.from_pretrained(base_with_gemma_tokens, chat_template="chatml")
    with pytest.raises(UserError, match="neither a built-in .* nor a file"):
        PromptRenderer.from_pretrained(base_with_gemma_tokens, chat_template=str(tmp_path / "nosuch.jinja"))


def test_an_sft_run_saves_its_template_with_the_model_for_the_next_stage(tmp_path):
    """SFT on a base checkpoint (no chat template) with data.chat_template as a file: the final folder's tokenizer
    holds the template, so GRPO from it renders exactly what SFT trained on."""
    from rlhf.config import load_config
    from rlhf.stages.sft import run_sft

    base = build_foreign_model(str(tmp_path / "base"))
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
    with open("examples/data/chat_math_eval.jsonl") as f:
        (tmp_path / "eval.jsonl").write_text("".join(f.readlines()[:4]))
    cfg = load_config("examples/chat_math_sft.yaml", [
        f"output_dir={tmp_path / 'run'}", f"model.path={base}", f"data.chat_template={tmp_path / 't.jinja'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}", "trainer.max_steps=2", "trainer.batch_size=8",
        "trainer.micro_batch_size=8", "trainer.warmup_steps=0", "eval.every=0", "checkpoint.every=0"])
    run_sft(cfg)
    final = tmp_path / "run" / "final"
    jinja = final / "chat_template.jinja"  # where transformers 5 saves it; older ones, into tokenizer_config.json
    saved = jinja.read_text() if jinja.exists() else json.load(open(final / "tokenizer_config.json"))["chat_template"]
    assert saved == CHAT_TEMPLATE
    again = PromptRenderer.from_pretrained(str(final))
    first = PromptRenderer.from_pretrained(base, chat_template=str(tmp_path / "t.jinja"))
    assert again.prompt_ids(CHAT) == first.prompt_ids(CHAT) and again.close_id == first.close_id is not None
