"""A mixture-of-experts policy (the tiny kit's Qwen3-MoE): transformers 5 holds each layer's experts fused in one 3D
parameter, the checkpoint (and vLLM's loader) per expert. What the trainer exports for a sync is the checkpoint's
tensors, and a receiver holding the fused parameters writes each expert where it belongs."""
import numpy as np
import pytest
import torch

from actors.policy import PolicyTrainer
from common.checkpoint_format import checkpoint_slots, write
from rlhf.config import TinyModelConfig, TrainerConfig
from tests.actors.test_trainer_group import sft_batches


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rlhf.weights.tiny import save_tiny_model
    return save_tiny_model(TinyModelConfig(arch="qwen3_moe", num_experts=4, experts_per_token=2),
                           str(tmp_path_factory.mktemp("moe") / "model"))


def test_the_tiny_kit_builds_a_qwen3_moe_with_the_configured_experts(moe_dir):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(moe_dir)
    assert config.model_type == "qwen3_moe" and config.num_experts == 4 and config.num_experts_per_tok == 2


def test_a_sync_exports_the_checkpoints_per_expert_tensors_and_a_fused_receiver_takes_them(moe_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    trainer = PolicyTrainer(moe_dir, TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=8, warmup_steps=0))
    assert any(p.dim() == 3 for p in trainer.model.parameters())  # fused in memory
    with safe_open(f"{moe_dir}/model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    specs = trainer.weight_specs()
    sent = dict(trainer.iter_weights())
    assert [s.name for s in specs] == list(sent)  # the plan's order is the stream's
    assert {s.name: s.shape for s in specs if s.name != "lm_head.weight"} == {k: tuple(v.shape)
                                                                            for k, v in stored.items()}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sent
    assert all(torch.equal(sent[k], v) for k, v in stored.items())  # an untrained trainer sends the checkpoint

    trainer.sft_step(sft_batches(moe_dir, steps=1)[0])  # an update changes every expert an input reached
    sent = dict(trainer.iter_weights())
    engine = AutoModelForCausalLM.from_pretrained(moe_dir)
    slots = checkpoint_slots(engine)
    with torch.no_grad():
        for name, value in sent.items():
            write(slots[name], value)
    fused = dict(engine.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    trained = dict(trainer.model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(fused, trained) and not torch.equal(fused, stored_fused(stored))


def stored_fused(stored: dict) -> torch.Tensor:
    """Layer 0's experts' gate and up projections fused as transformers holds them: (experts, 2 x width, hidden)."""
    experts = range(4)
    return torch.stack([torch.cat([stored[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                                   stored[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in experts])


def test_the_routers_load_balancing_loss_is_added_at_its_key_and_logged_with_the_expert_load(moe_dir):
    """trainer.router_aux_loss_coef adds coef x the Switch loss to the update (transformers' forward adds it only
    with labels, which the RL losses never pass); recorded in the training forward only, so a checkpointed
    backward that recomputes each layer does not count its routers twice."""
    batch = sft_batches(moe_dir, steps=1)[0]
    base = dict(lr=1e-2, batch_size=16, micro_batch_size=16, warmup_steps=0)  # (one micro-batch: one aux value)
    runs = {}
    for name, extra in {"off": dict(router_aux_loss_coef=0.0), "on": dict(router_aux_loss_coef=10.0),
                        "on+gc": dict(router_aux_loss_coef=10.0, gradient_checkpointing=True)}.items():
        trainer = PolicyTrainer(moe_dir, TrainerConfig(**base, **extra))
        metrics = trainer.sft_step(batch)
        router = dict(trainer.model.named_parameters())["model.layers.0.mlp.gate.weight"].detach().clone()
        runs[name] = metrics, router
    (off, r_off), (on, r_on), (gc, r_gc) = runs["off"], runs["on"], runs["on+gc"]
    aux = off["train/router_aux_loss"]
    assert 2.0 <= aux < 4.0 and off["moe/expert_load"] >= 1.0  # top_k=2 when even, more when not
    assert on["train/loss"] == pytest.approx(off["train/loss"] + 10.0 * aux, rel=1e-4)
    assert not torch.allclose(r_on, r_off)  # the loss reached the routers
    assert gc["train/router_aux_loss"] == pytest.approx(aux, rel=1e-5) and torch.allclose(r_gc, r_on, atol=1e-6)


def test_a_lora_policy_on_a_mixture_of_experts_exports_the_merged_checkpoint_tensors(moe_dir):
    """LoRA's default targets (the attention projections) on an MoE: the adapter trains, the experts stay frozen,
    and the merged weights a full sync sends are still the checkpoint's per-expert tensors."""
    from safetensors import safe_open

    from rlhf.config import LoraConfig
    trainer = PolicyTrainer(moe_dir, TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=16, warmup_steps=0),
                            lora=LoraConfig(rank=4))
    trainer.sft_step(sft_batches(moe_dir, steps=1)[0])
    sent = dict(trainer.iter_weights())
    with safe_open(f"{moe_dir}/model.safetensors", "pt") as f:
        assert set(f.keys()) <= set(sent)
        assert torch.equal(sent["model.layers.0.mlp.experts.2.down_proj.weight"],
                           f.get_tensor("model.layers.0.mlp.experts.2.down_proj.weight"))  # frozen
        assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                               f.get_tensor("model.layers.0.self_attn.q_proj.weight"))  # base + the trained delta


@pytest.mark.parametrize("stage", [2, 3])
def test_an_moe_update_under_zero_2_and_3_equals_zero_0s_and_exports_the_same_experts(moe_dir, stage):
    """ZeRO-3 partitions the fused 3D expert parameters (their full shape is `ds_shape`); the update, the router
    loss and the exported per-expert tensors are the unpartitioned trainer's."""
    batch = sft_batches(moe_dir, steps=1)[0]
    base = dict(lr=1e-2, batch_size=16, micro_batch_size=8, warmup_steps=0, router_aux_loss_coef=0.1)
    plain = PolicyTrainer(moe_dir, TrainerConfig(**base))
    sharded = PolicyTrainer(moe_dir, TrainerConfig(**base, zero_stage=stage))
    a, b = plain.sft_step(batch), sharded.sft_step(batch)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/router_aux_loss"] == pytest.approx(a["train/router_aux_loss"], rel=1e-5)
    assert [s.shape for s in sharded.weight_specs()] == [s.shape for s in plain.weight_specs()]
    expected = dict(plain.iter_weights())
    for name, w in sharded.iter_weights():  # 1% of the first Adam step (lr x sign): an expert few tokens reached
        assert torch.allclose(w, expected[name], atol=1e-4), name  # has gradients near Adam's eps, rounding-sensitive


def test_a_single_expert_layer_is_still_exported_under_its_checkpoint_name(tmp_path):
    """One expert: transformers' reverse conversion gives one part, under another name and shape than the fused
    parameter (a (1, H, I) down_proj is experts.0.down_proj.weight (H, I)); it is not a rename to skip."""
    from safetensors import safe_open

    from rlhf.weights.tiny import save_tiny_model
    folder = save_tiny_model(TinyModelConfig(arch="qwen3_moe", num_experts=1, experts_per_token=1),
                             str(tmp_path / "one"))
    trainer = PolicyTrainer(folder, TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=16, warmup_steps=0))
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {s.name: s.shape for s in trainer.weight_specs() if s.name != "lm_head.weight"} == stored


@pytest.mark.slow
def test_two_zero3_ranks_on_an_moe_one_with_nothing_to_train_finish_with_the_router_loss_on(ray_local, moe_dir):
    """Two ranks whose rows differ, the first training nothing (empty loss mask), under ZeRO-3 with the router loss
    on: the router tap adds no collective, so both ranks finish the step, agree on the grad norm, and log the
    router metrics; with the router loss off the update equals one process's."""
    from dataclasses import replace

    from actors.group import ActorGroup
    from common.batch import shards
    batch = sft_batches(moe_dir, steps=1)[0]
    parts = shards(batch, 2)
    parts[0]["loss_mask"][:] = False
    tr = TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=4, warmup_steps=0, zero_stage=3, world_size=2)
    for coef in (0.1, 0.0):
        group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=moe_dir,
                           tr=replace(tr, router_aux_loss_coef=coef))
        try:
            got = ray_local.get([a.sft_step.remote(p) for a, p in zip(group.actors, parts)], timeout=300)
        finally:
            group.kill()
        assert got[0]["train/grad_norm"] == pytest.approx(got[1]["train/grad_norm"]) and got[0]["train/grad_norm"] > 0
        assert all("moe/expert_load" in m and m["train/router_aux_loss"] >= 2.0 for m in got)
    single = PolicyTrainer(moe_dir, replace(tr, zero_stage=0, world_size=1))
    whole = {**batch, "loss_mask": torch.cat([parts[0]["loss_mask"], parts[1]["loss_mask"]])}
    assert got[0]["train/grad_norm"] == pytest.approx(single.sft_step(whole)["train/grad_norm"], rel=1e-4)


def _routed(trainer, batch, routes=None):
    """The experts every router of `trainer` used in a no-grad forward of `batch` (with `routes` as the rollout's),
    (layers, B*T, k), and the log-probs that forward gave."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
             for n, m in trainer.model.named_modules() if n.endswith("mlp.gate")]
    try:
        logp = trainer.compute_logprobs(batch if routes is None else {**batch, "routes": routes})
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen), logp


@pytest.mark.parametrize("gc", [False, True])
def test_routing_replay_routes_each_token_to_the_engines_experts_and_its_router_still_learns(moe_dir, gc):
    """algorithm.routing_replay=rollout: where the rollout recorded a token's experts the routers use them (255:
    none recorded, the router's own choice); the gate weights are the router's own probabilities at those experts,
    so an update still moves the router, the same with gradient checkpointing recomputing the layers; `measure`
    leaves the routing alone and counts how often the trainer agrees with the rollout."""
    B, T = 4, 12  # (rows of one length: one micro-batch, as the rollout laid it out)
    ids = torch.from_numpy(np.random.default_rng(2).integers(3, 60, (B, T)))
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long),
             "loss_mask": torch.ones(B, T - 1, dtype=torch.bool)}
    cfg = TrainerConfig(lr=1e-2, batch_size=4, micro_batch_size=4, warmup_steps=0, gradient_checkpointing=gc)
    plain = PolicyTrainer(moe_dir, cfg)
    own, logp_own = _routed(plain, batch)
    routes = torch.from_numpy(np.random.default_rng(0).integers(0, 4, (B, T, 2, 2))).to(torch.uint8)
    routes[..., 1] = (routes[..., 0] + 1 + torch.from_numpy(np.random.default_rng(1).integers(0, 3, (B, T, 2)))) % 4
    routes[:, -3:] = 255  # (no route recorded: the router's own choice)
    given = routes.reshape(B * T, 2, 2).transpose(0, 1).long()
    replay = PolicyTrainer(moe_dir, cfg, routing_replay="rollout")
    used, logp_replay = _routed(replay, batch, routes)
    recorded = (given != 255).all(-1)
    assert torch.equal(used[recorded], given[recorded])
    assert torch.equal(used[0][~recorded[0]], own[0][~recorded[0]])  # (layer 0: its input is the same either way)
    assert not torch.allclose(logp_replay, logp_own)
    before = dict(replay.model.named_parameters())["model.layers.1.mlp.gate.weight"].detach().clone()
    metrics = replay.sft_step({**batch, "routes": routes})
    assert not torch.allclose(dict(replay.model.named_parameters())["model.layers.1.mlp.gate.weight"], before)
    agree = (own.sort(-1).values == given.sort(-1).values).all(-1)[recorded].float().mean().item()
    assert metrics["moe/router_agreement"] == pytest.approx(agree, abs=0.05)  # (counted before the replay)
    measure = PolicyTrainer(moe_dir, cfg, routing_replay="measure")
    unchanged, logp_measure = _routed(measure, batch, routes)
    assert torch.equal(unchanged, own) and torch.allclose(logp_measure, logp_own)
    assert measure.sft_step({**batch, "routes": routes})["moe/router_agreement"] == pytest.approx(agree, abs=0.05)


def test_the_lora_reference_routes_for_itself_under_routing_replay(moe_dir):
    """With LoRA the reference is the policy with its adapter off: the rollout's routes are the policy's, so the
    reference's forward ignores them (and does not count in moe/router_agreement)."""
    from rlhf.config import LoraConfig
    B, T = 2, 10
    ids = torch.from_numpy(np.random.default_rng(3).integers(3, 60, (B, T)))
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long),
             "loss_mask": torch.ones(B, T - 1, dtype=torch.bool)}
    trainer = PolicyTrainer(moe_dir, TrainerConfig(lr=1e-2, batch_size=2, micro_batch_size=2, warmup_steps=0),
                            lora=LoraConfig(rank=4), routing_replay="rollout")
    routes = torch.zeros(B, T, 2, 2, dtype=torch.uint8)
    routes[..., 1] = 1  # (every token to experts 0 and 1: surely not the router's own choice everywhere)
    plain = trainer.compute_ref_logprobs(batch)
    assert torch.equal(trainer.compute_ref_logprobs({**batch, "routes": routes}), plain)
    assert trainer.ds.routers.agree == [0, 0]
    assert not torch.allclose(trainer.compute_logprobs({**batch, "routes": routes}), plain)  # (the policy replays)
