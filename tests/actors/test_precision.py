"""trainer.precision on the real DeepSpeed engine: a bf16-true trainer's fp32 masters start from the checkpoint's
own fp32 values and are what it saves; Adam's first real step is a whole one; bf16-mixed trains fp32 weights
under autocast and sends the engines their dtype; fp32 is the float32 path bit for bit."""
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from actors.logits import HeadOutput
from actors.policy import PolicyTrainer
from actors.precision import master_state_dict
from actors.reference import ReferenceModel
from rlhf.config import TrainerConfig
from tests.actors.test_trainer_group import sft_batches

LR = 1e-4
TR = TrainerConfig(lr=LR, batch_size=16, micro_batch_size=8, warmup_steps=0, grad_clip=1e9)


def file_weights(folder: str) -> dict[str, torch.Tensor]:
    import glob
    out = {}
    for path in glob.glob(f"{folder}/*.safetensors"):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("zero_stage", [0, 2])  # DeepSpeed keeps masters per list (0), per flat partition (1-3)
def test_bf16_true_masters_start_from_the_checkpoint_and_are_saved(tiny_model_dir, tmp_path, zero_stage):
    trainer = PolicyTrainer(tiny_model_dir, replace(TR, precision="bf16-true", zero_stage=zero_stage),
                            dtype="bfloat16")
    stored = file_weights(tiny_model_dir)
    masters = master_state_dict(trainer.ds.engine.optimizer, trainer.model)
    off_grid = 0
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert masters[name].dtype == torch.float32 and torch.equal(masters[name], stored[name]), name
        assert torch.equal(p.data, stored[name].to(torch.bfloat16)), name  # the forward copy: its rounding
        off_grid += int(not torch.equal(masters[name], p.data.float()))
    assert off_grid > 0  # a random-init fp32 file lies off the bf16 grid: the masters hold more than the copy

    trainer.sft_step(sft_batches(tiny_model_dir, steps=1)[0])
    trainer.save_hf(str(tmp_path / "final"))
    saved, after = file_weights(str(tmp_path / "final")), master_state_dict(trainer.ds.engine.optimizer,
                                                                            trainer.model)
    for name, _ in trainer.model.named_parameters():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], after[name]), name


@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("bf16-true", "bfloat16"),
                                             ("bf16-mixed", "bfloat16")])
def test_adams_first_step_moves_each_weight_a_whole_learning_rate(tiny_model_dir, precision, dtype):
    """Adam's first update is lr * g / (|g| + eps) = ±lr wherever |g| >> eps. DeepSpeed's start-up step on zero
    gradients left bf16-true's at 0.74 lr (bias correction one step late)."""
    trainer = PolicyTrainer(tiny_model_dir, replace(TR, precision=precision), dtype=dtype)
    before = {n: w.clone() for n, w in master_state_dict(trainer.ds.engine.optimizer, trainer.model).items()}
    trainer.sft_step(sft_batches(tiny_model_dir, steps=1)[0])
    after = master_state_dict(trainer.ds.engine.optimizer, trainer.model)
    steps = torch.cat([(after[n] - before[n]).abs().flatten() for n, _ in trainer.model.named_parameters()])
    moved = steps[steps > 0]
    assert len(moved) > 0.5 * len(steps)
    assert moved.median().item() == pytest.approx(LR, rel=1e-2)


def test_bf16_mixed_trains_fp32_weights_under_autocast_and_sends_the_engine_dtype(tiny_model_dir):
    mixed = PolicyTrainer(tiny_model_dir, replace(TR, precision="bf16-mixed", lr=1e-6), dtype="bfloat16")
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    out = mixed.ds(mixed.ds.on_device(batch))
    logits = out.head(out.hidden) if isinstance(out, HeadOutput) else out.logits  # chunked_logprobs: head deferred
    assert logits.dtype == torch.bfloat16  # matmuls ran in bf16
    start = {n: p.detach().clone() for n, p in mixed.model.named_parameters()}
    mixed.sft_step(batch)
    # a 1e-6 step is far below a bf16 step at these magnitudes, yet every weight the gradient reached moved
    changed = [(p.detach() != start[n]).float().mean().item() for n, p in mixed.model.named_parameters()]
    assert min(changed) > 0.5
    specs = mixed.weight_specs()
    assert {s.dtype for s in specs} == {"torch.bfloat16"}
    weights = mixed.export_weights()
    assert [n for n, _ in weights] == [s.name for s in specs]
    assert all(w.dtype == torch.bfloat16 for _, w in weights)
    # its reference computes what its first forward did (micro-batches of the same rows): fp32 under autocast
    ref = ReferenceModel(tiny_model_dir, "bfloat16", micro_batch_size=TR.micro_batch_size,
                         precision="bf16-mixed").compute_logprobs(batch)
    fresh = PolicyTrainer(tiny_model_dir, replace(TR, precision="bf16-mixed"), dtype="bfloat16")
    assert torch.equal(ref, fresh.compute_logprobs(batch))


def test_fp32_precision_is_the_float32_path_bit_for_bit(tiny_model_dir):
    batches = sft_batches(tiny_model_dir, steps=2)
    named, default = PolicyTrainer(tiny_model_dir, replace(TR, precision="fp32")), PolicyTrainer(tiny_model_dir, TR)
    for batch in batches:
        assert named.sft_step(batch)["train/loss"] == default.sft_step(batch)["train/loss"]
    for (name, p), q in zip(named.model.named_parameters(), default.model.parameters()):
        assert torch.equal(p, q), name
