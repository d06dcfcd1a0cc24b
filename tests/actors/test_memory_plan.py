"""trainer.plan_memory: a step estimates what its micro-batches' backward keeps and, where that would not fit in the
memory free now, takes fewer rows a micro-batch, then gradient checkpointing; the update is the same either way."""
import pytest

from actors.memory_plan import SAFETY, Plan, Shape, describe, plan_step
from actors.policy import PolicyTrainer
from rlhf.config import TrainerConfig
from tests.actors.test_trainer_group import sft_batches

GIB = 1 << 30
# SmolLM2-135M in bf16 on a CPU (sdpa keeps each layer's attention probabilities for the backward)
SMOLLM2 = Shape(layers=30, hidden=576, intermediate=1536, heads=9, act_bytes=2, quadratic=True)


def test_the_estimate_grows_with_length_and_checkpointing_bounds_it():
    short, long = SMOLLM2.row_bytes(320, False), SMOLLM2.row_bytes(1088, False)
    # the measured probes (benchmarks/results/long_sequences.md): 8 rows of 320 tokens keep about 1.5 GiB beyond the
    # model's states; 8 rows of 1088 pass 12 GiB without checkpointing and keep about 0.5 GiB with it
    assert 1.0 * GIB < 8 * short < 3.0 * GIB and 8 * long > 12 * GIB  # (it errs on the safe side)
    assert 0.3 * GIB < 8 * SMOLLM2.row_bytes(1088, True) < 1.0 * GIB
    flash = Shape(**{**SMOLLM2.__dict__, "quadratic": False})  # flash attention on a GPU: linear in the length
    assert flash.row_bytes(2048, False) == pytest.approx(2 * flash.row_bytes(1024, False))
    assert SMOLLM2.row_bytes(2048, False) > 3 * SMOLLM2.row_bytes(1024, False)


def test_a_plan_keeps_what_fits_then_takes_fewer_rows_then_checkpoints():
    lengths = [1088] * 8
    roomy = plan_step(SMOLLM2, lengths, 8, free=64 * GIB, checkpointing=False)
    assert roomy == Plan(None, False, roomy.need, roomy.free) and roomy.fits()  # as configured
    tight = plan_step(SMOLLM2, lengths, 8, free=10 * GIB, checkpointing=False)
    rows = int(10 * GIB * SAFETY // SMOLLM2.row_bytes(1088, False))  # as many rows of the longest as fit
    assert 1 <= rows < 8 and not tight.checkpointing and tight.max_tokens == 1088 * rows and tight.fits()
    tighter = plan_step(SMOLLM2, lengths, 8, free=3 * GIB, checkpointing=False)
    assert tighter.checkpointing and tighter.max_tokens >= 1088 and tighter.fits()  # one row would not fit without
    hopeless = plan_step(SMOLLM2, [30_000] * 2, 2, free=1 * GIB, checkpointing=False)
    assert hopeless.max_tokens == 30_000 and hopeless.checkpointing and not hopeless.fits()
    assert "still more than fits" in describe(hopeless, 2, 30_000)
    kept = plan_step(SMOLLM2, lengths, 8, free=64 * GIB, checkpointing=False, max_tokens=4352)
    assert kept.max_tokens == 4352  # an explicit budget that fits is the user's


def test_a_rank_short_of_memory_steps_in_smaller_micro_batches_with_checkpointing_and_the_same_update(
        tiny_model_dir, monkeypatch, capsys):
    """The tiny model's 16 rows in one micro-batch, with 'free memory' set where a micro-batch of them would not
    fit: the step takes fewer rows and then checkpointing, says so once, and updates as the unplanned step does."""
    import actors.memory_plan as memory_plan

    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    plain = PolicyTrainer(tiny_model_dir, TrainerConfig(**{**tr.__dict__, "plan_memory": False}))
    planned = PolicyTrainer(tiny_model_dir, tr)
    shape, longest = planned.ds.planner.shape, int(batch["attention_mask"].sum(1).max())
    one_row = shape.row_bytes(longest, False)
    monkeypatch.setattr(memory_plan, "free_bytes", lambda *_: 3 * one_row / memory_plan.SAFETY)
    a, b = plain.sft_step(batch), planned.sft_step(batch)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    assert b["train/planned_tokens"] == 3 * longest and b["train/checkpointing"] == 0.0  # for the driver's log
    assert "train/planned_tokens" not in a
    said = capsys.readouterr().out
    assert said.count("memory plan: micro-batches of") == 1 and "gradient checkpointing" not in said
    assert not planned.model.is_gradient_checkpointing
    # less than one row's worth: checkpointing goes on, and stays on
    monkeypatch.setattr(memory_plan, "free_bytes", lambda *_: 0.5 * one_row / memory_plan.SAFETY)
    planned.sft_step(batch)
    assert planned.model.is_gradient_checkpointing and "gradient checkpointing on" in capsys.readouterr().out


def test_a_limit_caps_what_a_step_may_use_at_the_limit_less_what_the_process_holds_and_the_step_adds():
    """trainer.memory_limit_gb: a step may use the limit less what the process holds now and what the step's own
    buffers will add (its gradients: step_overhead), never more than the node has available; unset, what is
    available less those buffers."""
    import psutil

    from actors.memory_plan import free_bytes
    held = psutil.Process().memory_info().rss
    assert free_bytes("cpu", 1, held / GIB + 1.0) == pytest.approx(GIB, abs=0.1 * GIB)
    assert free_bytes("cpu", 1, held / GIB + 1.0, pending=0.25 * GIB) == pytest.approx(0.75 * GIB, abs=0.1 * GIB)
    assert free_bytes("cpu", 1, held / GIB / 2) == 0.0
    available = psutil.virtual_memory().available
    assert free_bytes("cpu", 2) == pytest.approx(available / 2, rel=0.05)
    assert free_bytes("cpu", 1, 1e6) <= 1.05 * available


def test_the_step_overhead_counts_the_trained_gradients_and_the_deferred_head(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from actors.memory_plan import HEAD_WORKSET, step_overhead
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for p in model.parameters())
    assert step_overhead(model, "fp32", 0, 1, False) == 4 * n
    assert step_overhead(model, "bf16-true", 0, 1, True) == 6 * n + HEAD_WORKSET  # + the optimizer's fp32 copies
    assert step_overhead(model, "bf16-true", 2, 2, False) == 3 * n  # partitioned over 2 ranks
    for p in model.parameters():
        p.requires_grad_(False)  # (a LoRA base: frozen)
    assert step_overhead(model, "fp32", 0, 1, False) == 0


def test_a_trainer_over_its_memory_limit_steps_one_row_at_a_time_with_checkpointing_and_the_same_update(
        tiny_model_dir, capsys):
    """No stand-in for the memory: a limit below what the process holds leaves nothing for activations, so the
    step takes one row a micro-batch with checkpointing, says it cannot fit, and updates as the unplanned one."""
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    plain = PolicyTrainer(tiny_model_dir, TrainerConfig(**{**tr.__dict__, "plan_memory": False}))
    limited = PolicyTrainer(tiny_model_dir, TrainerConfig(**{**tr.__dict__, "memory_limit_gb": 0.01}))
    a, b = plain.sft_step(batch), limited.sft_step(batch)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/planned_tokens"] == batch["attention_mask"].shape[1] and b["train/checkpointing"] == 1.0
    said = capsys.readouterr().out
    assert "gradient checkpointing on" in said and "still more than fits" in said


def test_before_the_first_step_a_trainer_says_the_plan_for_the_longest_rows_and_changes_nothing(tiny_model_dir,
                                                                                               monkeypatch):
    import actors.memory_plan as memory_plan

    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    trainer = PolicyTrainer(tiny_model_dir, tr)
    one_row = trainer.ds.planner.shape.row_bytes(256, False)
    monkeypatch.setattr(memory_plan, "free_bytes", lambda *_: 4 * one_row / memory_plan.SAFETY)
    said = trainer.memory_plan(256)
    assert said.startswith("on cpu, rows of 256 tokens: micro-batches of 1024 padded tokens (4 row(s) of 256)")
    monkeypatch.setattr(memory_plan, "free_bytes", lambda *_: 0.5 * one_row / memory_plan.SAFETY)
    assert "gradient checkpointing on" in trainer.memory_plan(256)
    assert not trainer.model.is_gradient_checkpointing  # a preview: each step still plans from its own rows
    monkeypatch.setattr(memory_plan, "free_bytes", lambda *_: 64 * one_row / memory_plan.SAFETY)
    assert "micro-batches of 16 rows" in trainer.memory_plan(256)
    assert PolicyTrainer(tiny_model_dir, TrainerConfig(plan_memory=False)).memory_plan(256) is None


def test_the_run_says_when_the_trainers_plan_changes_and_not_every_step():
    """The trainers' own prints stay in Ray's logs: the controller says each change of the plan they report."""
    from rlhf.rl.controller import RLController

    class Console:
        lines = []

        def console(self, text):
            self.lines.append(text)
    controller = RLController.__new__(RLController)  # (only the method's state)
    controller.logger, controller.memory_plan = Console(), (0.0, 0.0)
    for planned, gc in [(0, 0), (2176, 0), (2176, 0), (1088, 1), (0, 1)]:
        controller._say_memory_plan({"train/planned_tokens": float(planned), "train/checkpointing": float(gc)})
    controller._say_memory_plan({"train/loss": 1.0})  # plan_memory off: nothing to say
    assert Console.lines == [
        "memory plan: the update's micro-batches take at most 2176 padded tokens (trainer.plan_memory)",
        "memory plan: the update's micro-batches take at most 1088 padded tokens, with gradient checkpointing "
        "(trainer.plan_memory)",
        "memory plan: the update's micro-batches take trainer.micro_batch_size rows, with gradient checkpointing "
        "(trainer.plan_memory)"]


FREED = """
import psutil, sys, torch
from actors.memory_plan import return_freed_memory
process = psutil.Process()
before = process.memory_info().rss
held = [torch.ones(1000, 1000) for _ in range(100)]  # 381 MiB
del held
kept = process.memory_info().rss
if sys.argv[1] == "trim":
    return_freed_memory()
print(kept - before, process.memory_info().rss - before)
"""
# glibc as a long step leaves it, made certain: 4 MB tensors on its heap (a raised mmap threshold), nothing given
# back by itself at the heap's top (a high trim threshold)
GLIBC_KEEPS = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def test_freed_memory_goes_back_to_the_system_between_micro_batches():
    """Freed activations that glibc keeps on its heap (as it does once a step has raised its mmap threshold) stay
    resident until return_freed_memory gives them back; then the next micro-batch reuses those pages. In a fresh
    interpreter with glibc's thresholds fixed, so the outcome does not depend on what the process did before."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT
    got = {}
    for how in ("keep", "trim"):
        out = subprocess.run([sys.executable, "-c", FREED, how], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, **GLIBC_KEEPS))
        assert out.returncode == 0, out.stderr[-2000:]
        got[how] = [int(v) for v in out.stdout.split()[-2:]]
    mib = 2**20
    assert got["keep"][1] > 300 * mib  # left alone, the freed 381 MiB stay resident
    assert got["trim"][0] > 300 * mib and got["trim"][1] < 100 * mib  # returned
