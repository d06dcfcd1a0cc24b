"""The prompt renderer against tokenizers unlike ours: a Llama-style one that adds <s> (and one whose chat template
writes <s> itself, with two eos ids), and the tiny model's ChatML. Every stage's ids come from here."""
import pytest

from common.batch import pack_pairs
from common.errors import UserError
from rlhf.stages.preference import tokenize_pairs
from rlhf.stages.sft import tokenize_sft
from rollout.render import PromptRenderer
from tests.fixtures.foreign import build_foreign_model

USER = [{"role": "user", "content": "sort 3 1 ="}]


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """(plain, chat) renderers of Llama-style checkpoints whose tokenizer adds <s>."""
    root = tmp_path_factory.mktemp("foreign")
    return (PromptRenderer.from_pretrained(build_foreign_model(str(root / "plain"))),
            PromptRenderer.from_pretrained(build_foreign_model(str(root / "chat"), chat=True)))


@pytest.fixture(scope="module")
def chatml(tiny_model_dir):
    return PromptRenderer.from_pretrained(tiny_model_dir)


def test_string_prompt_gets_the_tokenizers_bos_once(foreign):
    r = foreign[0]
    tok, bos = r.tokenizer, r.tokenizer.bos_token_id
    ids = r.prompt_ids("sort 3 1 =")
    assert ids == tok("sort 3 1 =").input_ids and ids[0] == bos and ids.count(bos) == 1
    assert r.prompt_ids("<s>sort 3 1 =") == ids  # a prompt that already holds <s> does not get a second one
    assert r.pad_id == tok.eos_token_id  # no pad token: pad with eos, never None


def test_no_bos_where_the_tokenizer_adds_none(chatml):
    tok = chatml.tokenizer
    assert chatml.prompt_ids("sort 3 1 =") == tok("sort 3 1 =", add_special_tokens=False).input_ids


@pytest.mark.parametrize("which", ["foreign", "chatml"])
def test_chat_prompts_are_the_templates_generation_prompt(which, foreign, chatml):
    r = foreign[1] if which == "foreign" else chatml
    expected = r.tokenizer.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    assert r.prompt_ids(USER) == expected
    if which == "foreign":  # the template writes <s>; rendering adds no second one
        assert expected.count(r.tokenizer.bos_token_id) == 1


def test_apply_chat_template_wraps_a_string_as_one_user_message(chatml, tiny_model_dir):
    wrapped = PromptRenderer.from_pretrained(tiny_model_dir, chat=True)
    assert wrapped.prompt_ids("sort 3 1 =") == chatml.prompt_ids(USER)
    assert wrapped.render_text(wrapped.prompt_ids("x")).startswith("<|im_start|>user\nx<|im_end|>")


def test_stop_ids_are_eos_generation_config_and_the_turn_close(foreign, chatml):
    tok = foreign[1].tokenizer
    eos, eot = tok.convert_tokens_to_ids(["</s>", "<|eot_id|>"])
    assert foreign[0].stop_ids(["p"]) == (eos, eot)  # generation_config lists both
    im_end = chatml.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chatml.stop_ids(["sort 1 ="]) == (chatml.eos_id,)
    assert chatml.stop_ids([USER]) == (chatml.eos_id, im_end)  # chat-rendered: the turn close stops too


def test_sft_rows_are_rendered_as_generation_sees_them(foreign):
    r = foreign[0]
    rows = [{"prompt": "sort 3 1 =", "answer": " 1 3"}, {"prompt": "sort 9 =", "answer": " 9"}]
    batch = tokenize_sft(r, rows)
    for i, row in enumerate(rows):
        prompt = r.prompt_ids(row["prompt"])  # what rollout and evaluation generate from
        length = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :length].tolist()
        assert ids[:len(prompt)] == prompt and ids[0] == r.tokenizer.bos_token_id
        assert ids[len(prompt):] == r.tokenizer(row["answer"], add_special_tokens=False).input_ids + [r.eos_id]
        assert batch["loss_mask"][i].nonzero().flatten().tolist() == list(range(len(prompt) - 1, length - 1))


def test_conversations_train_on_assistant_turns_and_their_close(chatml):
    conv = USER + [{"role": "assistant", "content": "1 3"}, {"role": "user", "content": "again"},
                   {"role": "assistant", "content": "ok"}]
    batch = tokenize_sft(chatml, [{"messages": conv}])
    ids = batch["input_ids"][0].tolist()
    assert ids == chatml.tokenizer.apply_chat_template(conv)["input_ids"]
    targets = [ids[j + 1] for j in batch["loss_mask"][0].nonzero().flatten().tolist()]
    assert chatml.render_text(targets) == "1 3<|im_end|>ok<|im_end|>"  # not the user turns, not the "\n" after


def test_answers_as_strings_or_assistant_messages_render_alike(chatml, foreign):
    r = foreign[1]
    as_text = tokenize_pairs(r, [{"prompt": USER, "chosen": " 1 3", "rejected": " 3 1"}])
    as_messages = tokenize_pairs(r, [{"prompt": USER, "chosen": [{"role": "assistant", "content": " 1 3"}],
                                      "rejected": [{"role": "assistant", "content": " 3 1"}]}])
    assert all((as_text[k] == as_messages[k]).all() for k in as_text)
    chosen = r.answer_ids(USER, " 1 3")
    assert chosen[-1] == r.tokenizer.convert_tokens_to_ids("<|eot_id|>")  # the chat answer ends its turn
    expected = pack_pairs([r.prompt_ids(USER)], [chosen], [r.answer_ids(USER, " 3 1")], r.pad_id)
    assert (as_text["input_ids"] == expected["input_ids"]).all()


def test_chat_without_a_template_is_a_clear_error(foreign):
    with pytest.raises(UserError, match="no chat_template"):
        PromptRenderer(foreign[0].tokenizer, chat=True)
    with pytest.raises(UserError, match="needs a chat template"):
        foreign[0].prompt_ids(USER)
    with pytest.raises(UserError, match="role"):
        foreign[1].answer_ids(USER, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("which", ["foreign", "chatml"])
def test_a_trajectory_of_sampled_turns_and_observations_is_the_templates_conversation(which, foreign, chatml):
    """Turn ids as an engine samples them (ending with the turn-closing token), observations rendered by turn_ids:
    the same ids the template gives the whole conversation, so nothing is re-tokenized or dropped between turns."""
    r = chatml if which == "chatml" else foreign[1]
    close = r.stop_ids(USER)[-1]
    answers, observations = ["8", "12 maybe"], ["higher: 9 to 15"]
    ids = r.prompt_ids(USER)
    for i, answer in enumerate(answers):
        ids += r.tokenizer(answer, add_special_tokens=False).input_ids + [close]
        if i < len(observations):
            ids += r.turn_ids(observations[i], closed=True)
    conv = USER + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": observations[0]},
                   {"role": "assistant", "content": answers[1]}]
    full, mask = r.conversation_ids(conv)
    closed_at = max(i for i, m in enumerate(mask) if m) + 1  # the template may write more after the last close
    assert ids == full[:closed_at]
    # a turn cut by the length limit has no closing token: the observation's ids close it
    cut = r.turn_ids("lower", closed=False)
    assert cut[0] == close and cut[1:] == r.turn_ids("lower", closed=True)


def test_observations_without_a_chat_template_are_their_own_tokens(foreign):
    plain = foreign[0]
    assert plain.turn_ids("higher") == plain.tokenizer("higher", add_special_tokens=False).input_ids
