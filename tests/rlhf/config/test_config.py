"""Config loading: defaults, overrides, and every kind of bad input ending in a clear UserError / exit code 2."""
import os

import pytest

from common.errors import UserError
from rlhf.config import RunConfig, load_config, read_config, validate
from tests.helpers import ROOT, run_cli


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_file_and_overrides_merge_in_order(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0.5\n  batch_size: 16\n")
    cfg = read_config(path, ["trainer.lr=0.25", "data.task=add"])
    assert cfg.trainer.lr == 0.25 and cfg.trainer.batch_size == 16 and cfg.data.task == "add"
    assert cfg.trainer.micro_batch_size == RunConfig().trainer.micro_batch_size
    assert cfg.rollout == RunConfig().rollout  # sections neither the file nor the overrides name keep the defaults


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 1\n  batch_size: [1, 2\nseed: 3\n")
    with pytest.raises(UserError, match=r"c.yaml:\d+: YAML syntax error"):
        load_config(path)


def test_unknown_key_suggests_the_close_one_with_line(tmp_path):
    path = write(tmp_path, "seed: 1\ntrainer:\n  lrr: 1.0e-3\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert "c.yaml:3" in str(e.value) and "trainer.lrr" in str(e.value) and "did you mean 'trainer.lr'" in str(e.value)


def test_unknown_top_level_key_in_override():
    with pytest.raises(UserError, match="unknown key 'traner'.*did you mean 'trainer'"):
        load_config(None, ["traner.lr=1"])


def test_wrong_type_names_key_and_value(tmp_path):
    path = write(tmp_path, "trainer:\n  batch_size: lots\n")
    with pytest.raises(UserError, match=r"c.yaml:2: trainer.batch_size = 'lots'"):
        load_config(path)


def test_malformed_override():
    with pytest.raises(UserError, match="not of the form dotted.key=value"):
        load_config(None, ["trainer.lr"])


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_validate_reports_every_problem_at_once():
    cfg = RunConfig()
    cfg.trainer.lr = -1.0
    cfg.trainer.batch_size, cfg.trainer.micro_batch_size = 10, 4
    cfg.trainer.zero_stage = 5
    cfg.data.task = "sorting"
    cfg.model.tiny.hidden_size = 66
    cfg.model.tiny.num_layers = 0
    problems = validate(cfg)
    text = "\n".join(problems)
    for key in ("trainer.lr = -1.0", "trainer.batch_size = 10", "trainer.zero_stage = 5", "data.task = 'sorting'",
                "model.tiny.hidden_size = 66", "model.tiny.num_layers = 0"):
        assert key in text
    assert len(problems) == 6


def test_head_size_vllm_cannot_run_is_rejected():
    with pytest.raises(UserError, match=r"model.tiny.hidden_size = 64: gives head size 16"):
        load_config(None, ["model.tiny.hidden_size=64", "model.tiny.num_heads=4"])


def test_impossible_values_raise_with_count(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0\n  max_steps: -3\n")
    with pytest.raises(UserError, match=r"2 problem\(s\)"):
        load_config(path)


def test_model_path_must_be_a_model_folder(tmp_path):
    from rlhf.weights.tiny import ensure_model
    cfg = load_config(None, [f"model.path={tmp_path}"])  # may not exist yet when validated: an earlier stage writes it
    with pytest.raises(UserError, match="model.path = .*no config.json"):
        ensure_model(cfg.model.path, cfg.model.tiny, str(tmp_path), 0)


def test_reward_fn_format_checked():
    with pytest.raises(UserError, match="reward.fn = 'mymodule.fn'.*package.module:function"):
        load_config(None, ["reward.fn=mymodule.fn"])


def test_default_config_is_valid():
    assert validate(RunConfig()) == []


# The CLI: exit code 2 and a short message, never a traceback.

@pytest.mark.parametrize("args, needle", [
    (["--config", "/no/such.yaml"], "config file not found"),
    (["--config", "examples/sort_sft.yaml", "trainer.lrr=1"], "did you mean 'trainer.lr'"),
    (["--config", "examples/sort_sft.yaml", "trainer.batch_size=abc"], "trainer.batch_size = 'abc'"),
    (["--config", "examples/sort_sft.yaml", "trainer.zero_stage=7"], "trainer.zero_stage = 7"),
    (["--config", "examples/sort_sft.yaml", "trainer.precision=bf16"], "must be one of bf16-true, bf16-mixed"),
])
def test_cli_bad_input_exits_2_without_traceback(args, needle):
    res = run_cli(*args, timeout=120)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_print_config_resolves_overrides():
    res = run_cli("--config", "examples/sort_sft.yaml", "trainer.lr=0.125", "--print-config", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "lr: 0.125" in res.stdout and "stage: sft" in res.stdout


def test_logprob_diff_warning_follows_the_dtype_unless_set():
    def logprob_diff_warn(cfg):
        return cfg.rollout.logprob_diff_warn
    assert logprob_diff_warn(load_config(None, ["stage=rl"])) == 1e-3
    assert logprob_diff_warn(load_config(None, ["stage=rl", "model.dtype=bfloat16"])) == 5e-2
    assert logprob_diff_warn(load_config(None, ["stage=rl", "model.dtype=bfloat16",
                                                "rollout.logprob_diff_warn=0.2"])) == 0.2


def test_multiprocess_engine_core_by_default_on_gpus_only():
    from rlhf.config.resolve import multiprocess_engine
    assert multiprocess_engine(None, 0) is False and multiprocess_engine(None, 8) is True
    assert multiprocess_engine(True, 0) is True and multiprocess_engine(False, 8) is False


@pytest.mark.parametrize("overrides, ok", [
    (["rollout.num_engines=2", "trainer.world_size=2"], True),  # auto -> CUDA IPC, engine i on rank i's GPU
    (["rollout.num_engines=2", "trainer.world_size=1"], False),  # auto would broadcast with two ranks on GPU 0
    (["rollout.sync_channel=broadcast"], False),
    (["rollout.sync_channel=broadcast", "placement.mode=split", "placement.num_gpus=2"], True),
    (["rollout.sync_channel=broadcast", "model.lora.rank=8"], True),  # adapter sync: no NCCL broadcast at all
])
def test_gpu_colocation_never_broadcasts_between_ranks_on_one_gpu(overrides, ok):
    args = ["stage=rl", "placement.num_gpus=2", "placement.mode=colocate", *overrides]
    if ok:
        assert validate(load_config(None, args)) == []
    else:
        with pytest.raises(UserError, match="refuses two ranks on one GPU"):
            load_config(None, args)


@pytest.mark.parametrize("args, needle", [
    (["stage=dpo", "algorithm.dpo_loss=ipo", "algorithm.label_smoothing=0.1"], "applies to dpo_loss=sigmoid only"),
    (["stage=dpo", "algorithm.dpo_loss=hinge", "algorithm.label_smoothing=0.1"], "applies to dpo_loss=sigmoid only"),
    (["stage=rl", "algorithm.name=grpo", "rollout.n_samples=1"], "compares samples of the same prompt"),
    (["stage=rl", "algorithm.loss_norm_len=0"], "algorithm.loss_norm_len = 0"),
    # a bf16 copy of every gathered weight per rank until the forward ends
    (["stage=rl", "trainer.zero_stage=3", "trainer.precision=bf16-mixed"], "set trainer.precision=bf16-true"),
])
def test_settings_that_would_be_silently_ignored_or_zero_are_rejected(args, needle):
    with pytest.raises(UserError, match=needle):
        load_config(None, args)


def test_bf16_mixed_under_zero3_is_kept_for_lora_whose_frozen_base_autocast_does_not_cache():
    cfg = load_config(None, ["stage=rl", "trainer.zero_stage=3", "trainer.precision=bf16-mixed", "model.lora.rank=8"])
    assert cfg.trainer.precision == "bf16-mixed"


def test_every_key_is_documented_and_the_reference_page_is_current():
    from rlhf.config.doc import entries, markdown
    keys = entries()
    assert len(keys) > 100 and not [e.key for e in keys if not e.help]
    path = os.path.join(ROOT, "docs", "config-reference.md")
    with open(path, encoding="utf-8") as f:
        assert f.read() == markdown(), "docs/config-reference.md is stale: run python -m rlhf.config.doc"


def test_help_config_prints_a_section_with_types_defaults_and_choices(capsys):
    from rlhf.run import main
    assert main(["--help-config", "rollout"]) == 0
    out = capsys.readouterr().out
    assert "rollout.sync_channel  (str, default 'auto'; one of auto, broadcast, ipc)" in out
    assert "rollout.timeout_s  (float or null, default null)" in out and "trainer.lr" not in out
    assert main(["--help-config", "rollot"]) == 2
    assert "no such section" in capsys.readouterr().err


def test_the_run_records_what_its_machine_dependent_defaults_became(monkeypatch):
    from rlhf.config.resolve import resolved
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    keys = ("algorithm.loss_norm_len", "rollout.logprob_diff_warn", "rollout.seed_per_prompt", "rollout.multiprocess",
            "placement.reference_ranks", "placement.cpu_threads", "trainer.precision")

    def value(cfg, key):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)
    cpu = read_config(None, ["stage=rl", "rollout.max_new_tokens=24", "model.dtype=bfloat16"])
    assert all(value(cpu, k) is None for k in keys)
    assert resolved(cpu) == load_config(None, ["stage=rl", "rollout.max_new_tokens=24", "model.dtype=bfloat16"])
    assert resolved(resolved(cpu)) == resolved(cpu)  # what is set stays set
    got = {k: value(resolved(cpu), k) for k in keys}
    assert got == {"algorithm.loss_norm_len": 24, "rollout.logprob_diff_warn": 5e-2, "rollout.seed_per_prompt": True,
                   "rollout.multiprocess": False, "placement.reference_ranks": 1, "placement.cpu_threads": 3,
                   "trainer.precision": "bf16-true"}
    gpu = resolved(load_config(None, ["stage=rl", "placement.num_gpus=2", "trainer.world_size=2",
                                      "rollout.num_engines=2", "algorithm.kl_coef=0.1", "rollout.engine=hf"]))
    assert (gpu.rollout.seed_per_prompt, gpu.rollout.multiprocess, gpu.placement.reference_ranks) == (False, True, 2)
    kept = resolved(load_config(None, ["stage=rl", "rollout.seed_per_prompt=false", "algorithm.loss_norm_len=7"]))
    assert kept.rollout.seed_per_prompt is False and kept.algorithm.loss_norm_len == 7  # set values stay
    assert kept.trainer.precision == "fp32"  # model.dtype float32


def test_names_the_config_declares_are_the_ones_the_code_has():
    from rlhf.config import REWARD_NAMES, TASK_NAMES
    from rlhf.stages.tasks import TASKS
    from rollout.rewards import BUILTIN
    assert tuple(TASKS) == TASK_NAMES and tuple(BUILTIN) == REWARD_NAMES


def test_every_fixed_set_is_checked_from_its_one_declaration():
    """`one_of` declares a key's allowed values once; the check, CHOICES and --help-config all read it."""
    from rlhf.config import CHOICES
    assert {"stage", "model.dtype", "data.task", "trainer.precision", "trainer.zero_stage", "algorithm.name",
            "algorithm.policy_loss", "algorithm.dpo_loss", "rollout.engine", "rollout.inflight_kv",
            "placement.mode", "env.observation_role"} <= set(CHOICES)
    for key, allowed in CHOICES.items():
        wrong = 7 if isinstance(allowed[0], int) else "nope"
        with pytest.raises(UserError, match=f"{key} = {wrong!r}: must be one of {allowed[0]}"):
            read_config(None, [f"{key}={wrong}"])


def test_the_kl_mode_is_one_value_read_from_kl_coef_and_kl_in_reward():
    from common.schema import AlgorithmConfig
    assert AlgorithmConfig(kl_coef=0.0, kl_in_reward=True).kl_mode() == "off"
    assert AlgorithmConfig(kl_coef=0.1).kl_mode() == "loss"
    assert AlgorithmConfig(kl_coef=0.1, kl_in_reward=True).kl_mode() == "reward"
