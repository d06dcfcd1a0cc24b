"""A corpus of malformed configs and data files, each fed to the CLI's main() in-process: every one must end with
exit code 2 and a message naming the key or the file, never an exception. A few go through a real `python -m
rlhf.run` subprocess too (the exit code and stderr a shell sees)."""
import json

import pytest

from tests.helpers import cli_in_process, run_cli

RL = "stage: rl\n"
# (id, YAML text or None for "use examples/sort_sft.yaml", extra overrides, text the message must contain)
CONFIGS = [
    ("empty-file", "", [], "the file is empty"),
    ("whitespace-file", "  \n\n", [], "the file is empty"),
    ("yaml-unclosed-list", "trainer:\n  lr: [1, 2\n", [], ":3: YAML syntax error"),
    ("yaml-tab-indent", "trainer:\n\tlr: 1\n", [], ":2: YAML syntax error"),
    ("yaml-bad-mapping", "trainer:\n  lr: 1\n  - x\n", [], "YAML syntax error"),
    ("top-level-list", "- 1\n- 2\n", [], "top level must be a mapping"),
    ("top-level-scalar", "42\n", [], "top level must be a mapping"),
    ("section-is-scalar", "trainer: 5\n", [], ":1: trainer must be a section"),
    ("nested-section-is-list", "model:\n  tiny: [1, 2]\n", [], "model.tiny must be a section"),
    ("unknown-top-key", "traner:\n  lr: 1\n", [], "unknown key 'traner'; did you mean 'trainer'"),
    ("interpolation-typo", "output_dir: ${nosuch}\n", [], "output_dir in "),
    ("unknown-nested-key", "trainer:\n  lrr: 1\n", [], "unknown key 'trainer.lrr'; did you mean 'trainer.lr'"),
    ("wrong-type-int", "trainer:\n  batch_size: many\n", [], "trainer.batch_size = 'many'"),
    ("wrong-type-float", "trainer:\n  lr: fast\n", [], "trainer.lr = 'fast'"),
    ("wrong-type-bool", "rollout:\n  multiprocess: maybe\n", [], "rollout.multiprocess = 'maybe'"),
    ("list-for-float", "trainer:\n  lr: [1, 2]\n", [], "trainer.lr = [1, 2]"),
    ("str-for-list", "model:\n  lora:\n    target_modules: q_proj\n", [], "model.lora.target_modules"),
    ("negative-lr", "trainer:\n  lr: -1.0\n", [], "trainer.lr = -1.0: must be > 0"),
    ("zero-batch", "trainer:\n  batch_size: 0\n", [], "trainer.batch_size = 0"),
    ("batch-not-multiple", "trainer:\n  batch_size: 10\n  micro_batch_size: 4\n", [], "trainer.batch_size = 10"),
    ("zero-stage-7", "trainer:\n  zero_stage: 7\n", [], "trainer.zero_stage = 7"),
    ("unknown-stage", "stage: ppo\n", [], "stage = 'ppo': must be one of"),
    ("unknown-algorithm", RL + "algorithm:\n  name: trpo\n", [], "algorithm.name = 'trpo'"),
    ("unknown-kl", RL + "algorithm:\n  kl_estimator: k9\n", [], "algorithm.kl_estimator = 'k9'"),
    ("unknown-agg", RL + "algorithm:\n  loss_agg: mean\n", [], "algorithm.loss_agg = 'mean'"),
    ("grpo-one-sample", RL + "rollout:\n  n_samples: 1\n", [], "rollout.n_samples = 1"),
    ("dual-clip-below-1", RL + "algorithm:\n  dual_clip: 0.5\n", [], "algorithm.dual_clip = 0.5"),
    ("negative-temperature", RL + "rollout:\n  temperature: -1.0\n", [], "rollout.temperature/top_p"),
    ("unknown-policy-loss", RL + "algorithm:\n  policy_loss: ppo2\n", [], "algorithm.policy_loss = 'ppo2'"),
    ("dual-clip-gspo", RL + "algorithm:\n  policy_loss: gspo\n  dual_clip: 3.0\n", [],
     "with algorithm.policy_loss=gspo"),
    ("overlong-whole-budget", RL + "algorithm:\n  overlong_buffer: 16\n", [], "algorithm.overlong_buffer = 16"),
    ("opd-no-teacher", RL + "algorithm:\n  name: opd\n", [], "teacher.path = None: algorithm.name=opd"),
    ("teacher-without-opd", RL + "teacher:\n  path: /tmp\n", [], "teacher.path = '/tmp'"),
    ("reward-fn-format", "reward:\n  fn: mymodule.fn\n", [], "reward.fn = 'mymodule.fn'"),
    ("heads-not-dividing", "model:\n  tiny:\n    hidden_size: 130\n", [], "model.tiny.hidden_size = 130"),
    ("head-size-16", "model:\n  tiny:\n    hidden_size: 64\n", [], "gives head size 16"),
    ("unknown-task", "data:\n  task: sorting\n", [], "data.task = 'sorting'"),
    ("no-task-no-path", "data:\n  task: null\n", [], "data.train_path = None"),
    ("min-above-max", "data:\n  min_items: 6\n  max_items: 3\n", [], "data.max_items = 3"),
    ("bad-placement", RL + "placement:\n  mode: spread\n", [], "placement.mode = 'spread'"),
    ("offload-zero-0", RL + "trainer:\n  offload: true\n", [], "trainer.offload = True"),
    ("offload-zero-3-cpu", RL + "trainer:\n  offload: true\n  zero_stage: 3\n", [], "only with DeepSpeed's FusedAdam"),
    ("overlap-replaced", RL + "rollout:\n  overlap: true\n", [], "'rollout.overlap' was replaced: set "
     "rollout.max_staleness: 1"),
    ("overlap-replaced-override", RL, ["rollout.overlap=true"], "set rollout.max_staleness: 1 instead"),
    ("async-negative", RL + "rollout:\n  max_staleness: -1\n", [], "rollout.max_staleness = -1: must be >= 0"),
    ("agreement-warn-above-1", RL + "rollout:\n  router_agreement_warn: 1.5\n", [],
     "rollout.router_agreement_warn = 1.5: must be in [0, 1]"),
    ("negative-price", "run:\n  price_per_device_hour: -3\n", [], "run.price_per_device_hour = -3.0: must be >= 0"),
    ("replay-unknown", RL + "algorithm:\n  routing_replay: old\n", [], "algorithm.routing_replay = 'old'"),
    ("replay-agent", RL + "algorithm:\n  routing_replay: rollout\n", ["agent.fn=rollout.guess:GuessNumber"],
     "agent.fn = 'rollout.guess:GuessNumber': algorithm.routing_replay=rollout: agent trajectories"),
    ("replay-packing", RL + "algorithm:\n  routing_replay: measure\n", ["trainer.packing=true"],
     "trainer.packing = True: algorithm.routing_replay=measure: a packed forward"),
    ("replay-hf-engine", RL + "algorithm:\n  routing_replay: rollout\n", ["rollout.engine=hf"],
     "rollout.engine = 'hf': algorithm.routing_replay=rollout: the transformers engine records no routes"),
    ("async-chunk-zero", RL + "rollout:\n  chunk_tokens: 0\n", [], "rollout.chunk_tokens = 0"),
    ("oversample-below-1", RL + "algorithm:\n  oversample: 0.5\n", [], "algorithm.oversample = 0.5: must be >= 1"),
    ("async-colocated-gpu", RL + "rollout:\n  max_staleness: 1\nplacement:\n  num_gpus: 1\n", [],
     "colocated roles take turns"),
    ("tis-mask-one-bound", RL + "algorithm:\n  tis_mask_low: 0.5\n", [], "set both (0 < low <= 1 <= high"),
    ("env-no-colon", RL + "env:\n  name: tests.fixtures.envs\n", [], "env.name = 'tests.fixtures.envs': write it as"),
    ("env-missing-module", RL + "env:\n  name: nowhere.envs:Game\n", [], "cannot import 'nowhere.envs'"),
    ("env-missing-class", RL + "env:\n  name: tests.fixtures.envs:Nope\n", [], "has no 'Nope'"),
    ("env-zero-turns", RL + "env:\n  name: tests.fixtures.envs:Echo\n  max_turns: 0\n", [], "env.max_turns = 0"),
    ("env-unknown-kwarg", RL + "env:\n  name: tests.fixtures.envs:Echo\n  kwargs: {speed: 2}\n", [],
     "env.kwargs = {'speed': 2}: tests.fixtures.envs:Echo cannot be built with them: TypeError"),
    ("guess-bad-prompt", RL + "env:\n  name: rollout.guess:GuessNumber\n  kwargs: {prompt: 'from {low}'}\n", [],
     "must be text with at most the placeholder {high}"),
    ("token-budget-zero", "trainer:\n  max_tokens_per_micro_batch: 0\n", [], "trainer.max_tokens_per_micro_batch = 0"),
    ("packed-reward-model", "stage: rm\ntrainer:\n  packing: true\n", [], "its rows stay padded"),
    ("shared-prefix-flash", "trainer:\n  shared_prefix: true\n  attn_implementation: flash_attention_2\n", [],
     "trainer.shared_prefix = True: needs trainer.packing: false"),
    ("unknown-attention", "trainer:\n  attn_implementation: flash\n", [], "trainer.attn_implementation = 'flash'"),
    ("tp-hf", RL + "rollout:\n  engine: hf\n  tensor_parallel_size: 2\n", [], "the hf engine holds whole models"),
    ("tp-colocated-gpus", RL + "rollout:\n  tensor_parallel_size: 2\nplacement:\n  num_gpus: 2\n", [],
     "set placement.mode=split (rollout.num_engines x tensor_parallel_size GPUs"),
    ("tp-heads", RL + "rollout:\n  tensor_parallel_size: 3\n", [],
     "its 4 heads (2 key/value) do not split over 3"),
    ("split-sft", "trainer:\n  sequence_parallel_size: 2\n", [], "sequences are split over the ranks of stage rl"),
    ("split-not-dividing", RL + "trainer:\n  world_size: 3\n  sequence_parallel_size: 2\n", [],
     "must divide trainer.world_size = 3"),
    ("split-packing", RL + "trainer:\n  world_size: 2\n  sequence_parallel_size: 2\n  packing: true\n", [],
     "trainer.packing = True: needs restarting position ids"),
    ("split-heads", RL + "trainer:\n  world_size: 3\n  sequence_parallel_size: 3\n", [],
     "the tiny model: its 4 attention heads do not split over 3 ranks"),
    ("unknown-sync-channel", RL + "rollout:\n  sync_channel: nccl\n", [], "rollout.sync_channel = 'nccl'"),
    ("cuda-ipc-split", RL + "rollout:\n  sync_channel: ipc\nplacement:\n  mode: split\n  num_gpus: 4\n", [],
     "CUDA IPC needs every engine on a trainer rank's GPU"),
    ("hybrid-engines-not-ranks", RL + "placement:\n  mode: hybrid\nrollout:\n  num_engines: 2\n", [],
     "set rollout.num_engines=1 (trainer.world_size)"),
    ("hybrid-async", RL + "placement:\n  mode: hybrid\nrollout:\n  max_staleness: 1\n",
     [], "generates and trains in one process"),
    ("hybrid-broadcast", RL + "placement:\n  mode: hybrid\nrollout:\n  sync_channel: broadcast\n", [],
     "hands the weights to the engine in the same process"),
    ("keep-zero-checkpoints", "checkpoint:\n  keep_last: 0\n", [], "checkpoint.keep_last = 0"),
    ("lora-negative", "model:\n  lora:\n    rank: -1\n", [], "model.lora"),
    ("dpo-odd-micro", "stage: dpo\ntrainer:\n  micro_batch_size: 3\n  batch_size: 9\n", [],
     "trainer.micro_batch_size = 3"),
    ("non-utf8-file", b"\xff\xfe\x00stage: sft\n", [], "not UTF-8"),
    ("huge-file", "".join(f"key_{i}: {i}\n" for i in range(200_000)), [], "YAML node expansion exceeds"),
    ("override-without-equals", None, ["trainer.lr"], "not of the form dotted.key=value"),
    ("override-unknown-key", None, ["trainer.lrr=1"], "did you mean 'trainer.lr'"),
    ("override-wrong-type", None, ["trainer.max_steps=ten"], "trainer.max_steps = 'ten'"),
    ("missing-config-file", None, ["--config", "/no/such/file.yaml"], "config file not found"),
]


@pytest.mark.parametrize("name, text, overrides, needle", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_malformed_config_exits_2_with_a_message(tmp_path, name, text, overrides, needle):
    if text is None:
        args = ["--config", "examples/sort_sft.yaml", *overrides] if "--config" not in overrides else overrides
    else:
        path = tmp_path / "bad.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        args = ["--config", str(path), *overrides]
    code, out, err = cli_in_process(*args, "--print-config")
    assert code == 2, (out[-500:], err[-2000:])
    assert needle in err, err[-2000:]


SUBPROCESS = ["yaml-tab-indent", "override-unknown-key", "missing-config-file"]


@pytest.mark.parametrize("name", SUBPROCESS)
def test_the_real_cli_exits_2_without_a_traceback(tmp_path, name):
    _, text, overrides, needle = next(c for c in CONFIGS if c[0] == name)
    args = ["--config", "examples/sort_sft.yaml", *overrides] if text is None and "--config" not in overrides \
        else overrides
    if text is not None:
        (tmp_path / "bad.yaml").write_text(text)
        args = ["--config", str(tmp_path / "bad.yaml"), *overrides]
    res = run_cli(*args, "--print-config", timeout=120)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def jsonl(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


GOOD = {"prompt": "sort 2 1 =", "answer": " 1 2"}
# (id, file suffix, content (bytes) or "dir"/"missing", text the message must contain besides the file name)
DATA = [
    ("empty", ".jsonl", b"", "the dataset is empty"),
    ("blank-lines", ".jsonl", b"\n \n\n", "the dataset is empty"),
    ("invalid-json", ".jsonl", jsonl(GOOD, GOOD, '{"prompt": "x", "answer"'), ":3: invalid JSON"),
    ("truncated-last-line", ".jsonl", jsonl(GOOD)[:-1] + b'\n{"prompt": "sort 3 ', ":2: invalid JSON"),
    ("trailing-garbage", ".jsonl", jsonl(GOOD, json.dumps(GOOD) + " xyz"), ":2: invalid JSON"),
    ("array-row", ".jsonl", jsonl([1, 2]), ":1: expected a JSON object"),
    ("scalar-row", ".jsonl", jsonl(GOOD, "7"), ":2: expected a JSON object"),
    ("missing-prompt", ".jsonl", jsonl(GOOD, {"answer": " 1"}), ":2: missing field 'prompt'"),
    ("missing-answer", ".jsonl", jsonl({"prompt": "sort 1 ="}), ":1: missing field 'answer'"),
    ("prompt-is-int", ".jsonl", jsonl({"prompt": 5, "answer": "x"}), "field 'prompt' must be a string"),
    ("prompt-is-null", ".jsonl", jsonl({"prompt": None, "answer": "x"}), "field 'prompt' must be a string"),
    ("prompt-is-object", ".jsonl", jsonl({"prompt": {"a": 1}, "answer": "x"}), "field 'prompt' must be a string"),
    ("non-utf8", ".jsonl", b'{"prompt": "\xff\xfe", "answer": "x"}\n', ":1: not valid UTF-8"),
    ("utf16-bom", ".jsonl", json.dumps(GOOD).encode("utf-16"), ":1: not valid UTF-8"),
    ("huge-row-missing-field", ".jsonl", jsonl({"prompt": "x" * 5_000_000}), ":1: missing field 'answer'"),
    ("csv", ".csv", b"prompt,answer\na,b\n", "unknown data format"),
    ("txt", ".txt", b"sort 2 1 =\n", "unknown data format"),
    ("garbage-parquet", ".parquet", b"not a parquet file", "cannot read as Parquet"),
    ("truncated-parquet", ".parquet", b"PAR1" + b"\x00" * 64 + b"PAR1", "cannot read as Parquet"),
    ("parquet-wrong-columns", ".parquet", "parquet:question,reply", "missing field 'prompt'"),
    ("not-a-datasets-folder", "", "dir", "not a folder written by datasets' save_to_disk"),
    ("missing-file", ".jsonl", "missing", "no such file"),
]


def make_data(tmp_path, suffix, content):
    path = tmp_path / f"data{suffix}"
    if content == "dir":
        path.mkdir()
        (path / "junk.txt").write_text("x")
    elif isinstance(content, str) and content.startswith("parquet:"):
        import datasets
        cols = content.split(":")[1].split(",")
        datasets.Dataset.from_list([{c: "x" for c in cols}]).to_parquet(str(path))
    elif content != "missing":
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("name, suffix, content, needle", DATA, ids=[d[0] for d in DATA])
def test_malformed_data_exits_2_naming_the_file(tmp_path, name, suffix, content, needle):
    path = make_data(tmp_path, suffix, content)
    code, out, err = cli_in_process("--config", "examples/sort_sft.yaml", "data.task=null", f"data.train_path={path}",
                                    f"data.eval_path={path}", "reward.fn=tests.rlhf.stages.test_data:user_reward",
                                    f"output_dir={tmp_path / 'run'}", "trainer.max_steps=1")
    assert code == 2, (out[-500:], err[-2000:])
    assert str(path) in err and needle in err, err[-2000:]
    assert not (tmp_path / "run" / "init_model").exists()  # failed before building any model


def test_a_prompt_longer_than_the_engines_context_exits_2_before_any_worker_starts(tmp_path, tiny_model_dir):
    """vLLM refuses such a prompt on every call, so every rerun would fail the same way: caught as the data loads."""
    rows = [GOOD] * 40 + [{"prompt": "sort " + "7 " * 200 + "=", "answer": " 7"}]
    path = make_data(tmp_path, ".jsonl", jsonl(*rows))
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={tiny_model_dir}", "data.task=null",
                  f"data.train_path={path}", f"data.eval_path={path}",
                  "reward.fn=tests.rlhf.stages.test_data:user_reward",
                  f"output_dir={tmp_path / 'run'}", "trainer.max_steps=1", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"{path}, train row 41: its prompt is" in res.stderr and "rollout.max_model_len = 256" in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _broken_copy(src, dst, how: str):
    import shutil
    shutil.copytree(src, dst)
    if how == "config-not-json":
        (dst / "config.json").write_text('{"model_type": "qwen2",')
    elif how == "no-weights":
        for p in dst.glob("*.safetensors"):
            p.unlink()
    elif how == "truncated-weights":
        p = next(dst.glob("*.safetensors"))
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif how == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
            if (dst / name).exists():
                (dst / name).unlink()
    return dst


@pytest.mark.parametrize("how, needle", [
    ("config-not-json", "config.json is not readable JSON"), ("no-weights", "it holds no weights"),
    ("truncated-weights", "model.safetensors cannot be read (Error while deserializing header"),
    ("no-tokenizer", "it has no tokenizer")])
def test_a_broken_model_folder_exits_2_before_any_worker_starts(tmp_path, tiny_model_dir, how, needle):
    import pathlib
    model = _broken_copy(pathlib.Path(tiny_model_dir), tmp_path / "model", how)
    code, out, err = cli_in_process("--config", "examples/sort_sft.yaml", f"model.path={model}",
                                    f"output_dir={tmp_path / 'run'}", "trainer.max_steps=1")
    assert code == 2, (out[-500:], err[-2000:])
    assert f"model.path = '{model}': {needle}" in err, err[-2000:]
