"""ZeRO-3 over two ranks whose rows differ: every module call is a collective there (the weights are gathered before
it and again in the backward), so each rank must call each module equally often whatever its rows hold. The
deferred LM head is the one whose calls followed the data (one per chunk of trained positions): ranks with
different chunk counts, or a rank with nothing to train, hung both ranks."""
from dataclasses import replace

import pytest
import torch

from actors.policy import PolicyTrainer
from common import spans
from common.batch import pack_sequences
from rlhf.config import AlgorithmConfig, TrainerConfig

TR = TrainerConfig(lr=1e-3, batch_size=4, micro_batch_size=2, warmup_steps=0, chunked_logprobs=True)


def rows(first_rank_trains: int) -> dict:
    """4 rows, 2 per rank: rank 0's completions have `first_rank_trains` tokens (0: prompts only, as an agent that
    failed before its first call leaves them), rank 1's 24 each (48 positions: 3 head chunks of 16 against 1)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (8,), generator=g).tolist() for _ in range(4)]
    lengths = [max(first_rank_trains, 1)] * 2 + [24] * 2
    completions = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    batch = pack_sequences(prompts, completions, pad_id=0)
    if first_rank_trains == 0:
        batch["loss_mask"][:2] = False
    batch["advantages"] = torch.where(batch["loss_mask"], torch.linspace(-1, 1, 4)[:, None], 0.0)
    return batch


@pytest.mark.slow
def test_zero3_ranks_with_different_head_chunks_or_nothing_to_train_finish_and_match_one_process(ray_local,
                                                                                                 tiny_model_dir):
    from actors.group import ActorGroup
    from common.batch import shards

    algo = AlgorithmConfig()
    single = PolicyTrainer(tiny_model_dir, TR)
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir, tr=replace(TR, zero_stage=3))
    try:
        def small_chunks(trainer):
            trainer.ds.head.chunk_rows = 16  # what a 152k vocabulary's 256 MiB gives is 441
        ray_local.get([a.__ray_call__.remote(small_chunks) for a in group.actors], timeout=60)
        ray_local.get([a.__ray_call__.remote(spans.start) for a in group.actors], timeout=60)  # (logging.trace)
        single.ds.head.chunk_rows = 16
        for first_rank_trains in (3, 0):  # 1 chunk against 3; none against 3
            batch = rows(first_rank_trains)
            parts = shards(batch, 2)
            assert [int(p["loss_mask"].sum()) for p in parts] == [2 * first_rank_trains, 48]
            got = ray_local.get([a.compute_logprobs.remote(p) for a, p in zip(group.actors, parts)], timeout=120)
            assert (torch.cat(got) - single.compute_logprobs(batch)).abs().max() < 1e-5
            metrics = ray_local.get([a.train_step.remote(p, algo) for a, p in zip(group.actors, parts)], timeout=120)
            expected = single.train_step(batch, algo)
            assert metrics[0]["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
            weights = dict(ray_local.get([a.export_weights.remote() for a in group.actors], timeout=120)[0])
            for name, w in single.iter_weights():
                off = (weights[name] - w).abs()
                # Adam moves a weight by about lr whatever the size of its gradient, so an element whose gradient is
                # near the rounding of the reductions (two ranks sum in another order than one process; the order
                # also differs between CPUs) can land anywhere within lr: one such element of 8192 was seen on an
                # AMD EPYC. A gradient lost or doubled would move many.
                assert off.max() <= TR.lr and int((off > 1e-5).sum()) <= off.numel() // 4096, (name, off.max())
            # each rank recorded its own update, the one with nothing to train too (common.spans: no collective)
            taken = ray_local.get([a.__ray_call__.remote(spans.take) for a in group.actors], timeout=120)
            assert all({"update", "forward", "backward", "optimizer"} <= {s[0] for s in t["spans"]} for t in taken)
    finally:
        group.kill()


def _recording_masters(trainer):
    """In a rank's process: keep what each save's master_state_dict returned there."""
    import actors.ds_model as ds_model
    original, trainer.kept = ds_model.master_state_dict, []

    def recorded(*args, **kwargs):
        out = original(*args, **kwargs)
        trainer.kept.append(None if out is None else sorted({str(t.dtype) for t in out.values()}))
        return out
    ds_model.master_state_dict = recorded


@pytest.mark.slow
def test_a_bf16_true_save_under_zero2_keeps_the_fp32_model_on_the_writing_rank_only(ray_local, tiny_model_dir,
                                                                                   tmp_path):
    """Every rank takes part in assembling the masters (an all-reduce each); only rank 0 writes, so only rank 0
    keeps them: the others held a full fp32 copy each (8 x 28 GiB of host memory at a 7B's save)."""
    from safetensors.torch import load_file

    from actors.group import ActorGroup
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir, dtype="bfloat16",
                       tr=replace(TR, zero_stage=2, precision="bf16-true", chunked_logprobs=False))
    try:
        ray_local.get([a.__ray_call__.remote(_recording_masters) for a in group.actors], timeout=60)
        group.train_step(rows(3), AlgorithmConfig())
        group.save_hf(str(tmp_path / "saved"))
        kept = ray_local.get([a.__ray_call__.remote(lambda t: t.kept) for a in group.actors], timeout=60)
        assert kept == [[["torch.float32"]], [None]]
        saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
        assert saved["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    finally:
        group.kill()


@pytest.mark.slow
def test_zero3_ranks_whose_memory_plans_differ_agree_on_one(ray_local, tiny_model_dir):
    """trainer.plan_memory under ZeRO-3: rank 0 (nothing to train) has room, rank 1 (long rows) has less than one
    row's worth; both take rank 1's plan, token budget and checkpointing (a rank recomputing alone would gather
    the weights more often than its peer and hang it), and the update equals one process's unplanned one."""
    from actors.group import ActorGroup
    from common.batch import shards

    algo = AlgorithmConfig()
    single = PolicyTrainer(tiny_model_dir, replace(TR, plan_memory=False))
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir, tr=replace(TR, zero_stage=3))
    try:
        def squeeze(trainer, rank):
            import actors.memory_plan as memory_plan
            one_row = trainer.ds.planner.shape.row_bytes(32, False)
            free = 1e6 * one_row if rank == 0 else 0.5 * one_row / memory_plan.SAFETY
            memory_plan.free_bytes = lambda *_: free
        ray_local.get([a.__ray_call__.remote(squeeze, i) for i, a in enumerate(group.actors)], timeout=60)
        batch = rows(0)
        metrics = ray_local.get([a.train_step.remote(p, algo) for a, p in zip(group.actors, shards(batch, 2))],
                                timeout=120)
        expected = single.train_step(batch, algo)
        assert metrics[0]["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
        on = ray_local.get([a.__ray_call__.remote(lambda t: t.model.is_gradient_checkpointing) for a in group.actors],
                           timeout=60)
        assert on == [True, True]
        weights = dict(ray_local.get([a.export_weights.remote() for a in group.actors], timeout=120)[0])
        for name, w in single.iter_weights():
            assert torch.allclose(weights[name], w, atol=1e-5, rtol=0), (name, (weights[name] - w).abs().max())
    finally:
        group.kill()
