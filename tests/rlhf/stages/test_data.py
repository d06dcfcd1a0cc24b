"""Data: synthetic tasks, loaders for JSONL / Parquet / datasets folders, their errors, and reward functions."""
import json

import pytest

from common.errors import UserError
from rlhf.config import DataConfig
from rlhf.stages.data import BatchIterator, load_records, preference_rows, prompt_rows
from rlhf.stages.tasks import make_preference_rows, make_rows
from rollout.rewards import add_reward, load_reward_fn, resolve_reward_fn, score, sort_reward


def test_sort_rows_are_seeded_and_correct():
    d = DataConfig(task="sort", num_train=200)
    rows = make_rows(d, "train", seed=1)
    assert rows == make_rows(d, "train", seed=1)
    assert rows != make_rows(d, "train", seed=2)
    assert rows != make_rows(d, "eval", seed=1)[:len(rows)]
    for r in rows:
        nums = [int(x) for x in r["prompt"].split()[1:-1]]
        assert r["prompt"].startswith("sort ") and r["prompt"].endswith(" =")
        assert d.min_items <= len(nums) <= d.max_items and all(0 <= n <= d.max_value for n in nums)
        assert r["answer"] == " " + " ".join(map(str, sorted(nums)))


def test_add_rows_are_correct():
    for r in make_rows(DataConfig(task="add", num_train=100, min_items=2, max_items=4), "train", seed=0):
        a, b = r["prompt"][4:-2].split(" + ")
        assert r["answer"] == f" {int(a) + int(b)}" and 2 <= len(a) <= 4


def test_sort_reward_exact_partial_and_garbage():
    prompts = ["sort 3 1 2 ="] * 5
    got = sort_reward(prompts, [" 1 2 3", "1 2 3 ", " 1 3 2", " 1 2", "hello"])
    assert got == [1.0, 1.0, pytest.approx(0.5 * 1 / 3), pytest.approx(0.5 * 2 / 3), 0.0]
    assert sort_reward(prompts[:1], [" 9"], answer=[" 9"]) == [1.0]


def test_add_reward_aligns_digits_from_the_right():
    got = add_reward(["add 15 + 7 ="] * 4, [" 22", " 12", " 122", "x"])
    assert got == [1.0, pytest.approx(0.5 * 1 / 2), pytest.approx(0.5 * 2 / 3), 0.0]


@pytest.mark.parametrize("task", ["sort", "add"])
def test_preference_pairs_reject_plausible_mistakes(task):
    reward = {"sort": sort_reward, "add": add_reward}[task]
    rows = make_preference_rows(DataConfig(task=task, num_train=300), "train", seed=0)
    prompts = [r["prompt"] for r in rows]
    assert all(r["chosen"] != r["rejected"] for r in rows)
    assert reward(prompts, [r["chosen"] for r in rows]) == [1.0] * len(rows)
    assert all(x < 1.0 for x in reward(prompts, [r["rejected"] for r in rows]))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_with_custom_field_names_keeps_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "sort 2 1 =", "a": " 1 2", "id": 7}])
    d = DataConfig(task=None, train_path=path, prompt_key="q", answer_key="a")
    assert prompt_rows(d, "train", 0) == [{"prompt": "sort 2 1 =", "answer": " 1 2", "id": 7}]


def test_parquet_and_datasets_folder(tmp_path):
    import datasets

    rows = [{"prompt": "p1", "chosen": "c1", "rejected": "r1"}, {"prompt": "p2", "chosen": "c2", "rejected": "r2"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for path in (tmp_path / "d.parquet", tmp_path / "folder"):
        assert preference_rows(DataConfig(task=None, train_path=str(path)), "train", 0) == rows


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer"\n', r"d.jsonl:2: invalid JSON"),
    (b'{"prompt": "a", "answer": "b"}\n\n{"answer": "b"}\n', r"d.jsonl:3: missing field 'prompt'.*data.prompt_key"),
    (b'{"prompt": 5, "answer": "b"}\n', r"d.jsonl:1: field 'prompt' must be a string"),
    (b'[1, 2]\n', r"d.jsonl:1: expected a JSON object"),
    (b'{"prompt": "a", "answer": "\xff\xfe"}\n', r"d.jsonl:1: not valid UTF-8"),
    (b'', r"d.jsonl: the dataset is empty"),
    (b'\n\n', r"d.jsonl: the dataset is empty"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, content, needle):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=needle):
        load_records(str(path), {"prompt": "prompt", "answer": "answer"})


def test_missing_file_names_the_keys(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl: no such file.*data.train_path"):
        load_records(str(tmp_path / "nope.jsonl"), {"prompt": "prompt"})


def test_unknown_format_and_bad_parquet(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown data format"):
        load_records(str(tmp_path / "d.csv"), {"prompt": "prompt"})
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="d.parquet: cannot read as Parquet"):
        load_records(str(tmp_path / "d.parquet"), {"prompt": "prompt"})


def test_batch_iterator_covers_an_epoch_and_restores_position():
    rows = list(range(10))
    it = BatchIterator(rows, 3, seed=0)
    epoch = it.next() + it.next() + it.next()
    assert sorted(epoch) == sorted(set(epoch)) and len(epoch) == 9
    state = it.state()
    ahead = [it.next() for _ in range(4)]
    again = BatchIterator(rows, 3, seed=0)
    again.load_state(state)
    assert [again.next() for _ in range(4)] == ahead
    with pytest.raises(UserError, match="fewer than one batch"):
        BatchIterator(rows, 11, seed=0)


def user_reward(prompts, completions, **metadata):
    return [float(len(c)) for c in completions]


def bad_count_reward(prompts, completions, **metadata):
    return [1.0]


def stuck_reward(prompts, completions, **metadata):
    import time
    if completions[0] == "stuck":
        time.sleep(3600)
    if completions[0] == "boom":
        raise KeyError("no such answer")
    return [1.0] * len(completions)


def test_a_user_reward_runs_under_reward_timeout_s():
    from rollout.rewards import resolve_reward_fn, score
    fn = resolve_reward_fn("tests.rlhf.stages.test_data:stuck_reward", None, timeout_s=0.5)
    assert score(fn, ["p", "q"], ["fine", "ok"], {}) == [1.0, 1.0]
    with pytest.raises(UserError, match="raised KeyError: 'no such answer'"):  # its own errors, as without one
        score(fn, ["p"], ["boom"], {})
    with pytest.raises(UserError, match=r"stuck_reward did not return within reward.timeout_s = 0.5 s for 1 "
                                        r"completions.*raise reward.timeout_s"):
        score(fn, ["p"], ["stuck"], {})


def raising_reward(prompts, completions, **metadata):
    raise KeyError("boom")


def test_user_reward_fn_from_dotted_path():
    fn = load_reward_fn("tests.rlhf.stages.test_data:user_reward")
    assert score(fn, ["a", "b"], ["xy", "z"], {}) == [2.0, 1.0]
    assert resolve_reward_fn(None, "sort") is sort_reward


@pytest.mark.parametrize("spec, needle", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("tests.rlhf.stages.test_data:missing", "has no function 'missing'"),
])
def test_reward_fn_load_errors(spec, needle):
    with pytest.raises(UserError, match=needle):
        load_reward_fn(spec)


def test_a_user_module_named_like_a_project_package_is_named_in_the_error(tmp_path, monkeypatch):
    """A user's reward module importing its own common.py (tried as a user would) meets this project's `common`,
    imported first: the error says so and how to fix it, instead of only "cannot import name"."""
    import common  # noqa: F401 - as a run has it by the time the reward loads
    (tmp_path / "common.py").write_text("def helper():\n    return 1.0\n")
    (tmp_path / "my_reward_mod.py").write_text("from common import helper\n\ndef fn(prompts, completions, **_):\n"
                                               "    return [helper() for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"this project's package 'common'.*rename your own common.py"):
        load_reward_fn("my_reward_mod:fn")
    with pytest.raises(UserError, match=r"cannot import module 'rollout.no_such'.*PYTHONPATH$"):
        load_reward_fn("rollout.no_such:fn")  # a module of the project itself that does not exist: no such hint


def test_reward_fn_wrong_count_or_raising_is_reported_by_name():
    with pytest.raises(UserError, match="bad_count_reward returned 1 rewards for 2 completions"):
        score(bad_count_reward, ["a", "b"], ["x", "y"], {})
    with pytest.raises(UserError, match="raising_reward raised KeyError.*prompt='a'"):
        score(raising_reward, ["a"], ["x"], {})


def test_rl_prompts_need_no_answer_column_and_reach_nested_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "sort 2 1 =", "extra_info": {"split": "train"}},
        {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "4"}}])
    rows = prompt_rows(DataConfig(task=None, train_path=path), "train", 0)
    assert rows[0] == {"prompt": "sort 2 1 =", "extra_info": {"split": "train"}}  # no answer: none invented
    d = DataConfig(task=None, train_path=path, answer_key="reward_model.ground_truth")
    assert prompt_rows(d, "train", 0)[1]["answer"] == "4"
    with pytest.raises(UserError, match=r"d.jsonl:1: missing field 'reward_model.ground_truth', which SFT"):
        prompt_rows(d, "train", 0, need_answer=True)


def test_conversations_become_prompt_and_answer(tmp_path):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "\\boxed{4}"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}, {"messages": conv[:2]}])
    with pytest.raises(UserError, match=r"d.jsonl:2: the conversation in 'messages' needs an assistant turn"):
        prompt_rows(DataConfig(task=None, train_path=path), "train", 0)
    write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}])
    row = prompt_rows(DataConfig(task=None, train_path=path), "train", 0)[0]
    assert row["prompt"] == conv[:2] and row["answer"] == conv[2:] and row["messages"] == conv


def test_malformed_messages_name_the_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(UserError, match=r"d.jsonl:1: field 'prompt' must be a string or a list of \{role"):
        prompt_rows(DataConfig(task=None, train_path=path), "train", 0)


def test_preference_pairs_as_messages_and_with_an_implicit_prompt(tmp_path):
    user = [{"role": "user", "content": "q"}]
    good, bad = [{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"chosen": user + good, "rejected": user + bad},
                                              {"prompt": user, "chosen": good, "rejected": "b"}])
    rows = preference_rows(DataConfig(task=None, train_path=path), "train", 0)
    assert rows == [{"prompt": user, "chosen": good, "rejected": bad},
                    {"prompt": user, "chosen": good, "rejected": "b"}]
    write_jsonl(tmp_path / "d.jsonl", [{"chosen": "a", "rejected": "b"}])
    with pytest.raises(UserError, match="d.jsonl:1: missing field 'prompt'; set data.prompt_key"):
        preference_rows(DataConfig(task=None, train_path=path), "train", 0)


def test_final_answer_reads_gsm8k_solutions():
    from rollout.rewards import final_answer
    assert final_answer("She has 40 + 2 = 42.\n#### 1,042") == "1042"
    assert final_answer(" 17 ") == "17" and final_answer(42) == "42"
    assert final_answer([{"role": "assistant", "content": "x = \\boxed{3}"}]) == "x = \\boxed{3}"


def test_math_reward_verifies_the_final_answer():
    from rollout.rewards import math_reward, resolve_reward_fn
    assert resolve_reward_fn("math", None) is math_reward
    completions = ["so 12 + 30 = \\boxed{42}", "the answer is 42", "I think 41", "\\boxed{\\frac{1}{2}}", "none"]
    answers = ["#### 42", "42", "42", "0.5", "1"]
    assert math_reward([""] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0]
    with pytest.raises(UserError, match="data.answer_key"):
        math_reward(["p"], ["1"])
    # a number is answered with a number: a sum left undone scored 1.0 under math-verify alone (a policy learned it)
    undone = ["so there are 12 - 8 apples left.", "\\boxed{12-4}", "3 * 4", "12 - 8 = 4 apples", "x = 1/2",
              "-3/4", "\\boxed{x^2+1}"]
    assert math_reward([""] * 7, undone, answer=["4", "8", "12", "4", "0.5", "-0.75", "x^2+1"]) == [
        0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
