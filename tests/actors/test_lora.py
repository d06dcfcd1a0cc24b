"""LoRA on the policy: training changes only adapter weights, the adapter-disabled model is the reference (the base
model's log-probs, to float rounding), and the exported merged weights reproduce the adapted policy, under ZeRO-3
too."""
import os
from dataclasses import replace

import pytest
import torch

from actors.policy import PolicyTrainer
from algorithms.logprobs import token_logprobs
from rlhf.config import LoraConfig, TrainerConfig
from tests.actors.test_trainer_group import sft_batches


def base_logprobs(model, batch):
    """On the completion tokens: per-token results are defined there (the trainer cuts padding away)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])[batch["loss_mask"]]


@pytest.mark.slow
def test_lora_trains_adapter_only_and_reference_is_the_base(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    batches = sft_batches(tiny_model_dir, steps=3)
    tr = TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=8, warmup_steps=0)
    trainer = PolicyTrainer(tiny_model_dir, tr, lora=LoraConfig(rank=4, alpha=8))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for b in batches:
        trainer.sft_step(b)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    probe = batches[0]
    mask = probe["loss_mask"]
    assert torch.allclose(trainer.compute_ref_logprobs(probe)[mask], base_logprobs(base, probe), atol=1e-6, rtol=0)
    adapted = trainer.compute_logprobs(probe)[mask]
    assert (adapted - base_logprobs(base, probe)).abs().max() > 1e-3

    # The export uses the base model's names (what vLLM expects) and carries base + delta.
    exported = dict(trainer.iter_weights())
    assert set(exported) == set(dict(base.named_parameters(remove_duplicate=False)))
    with torch.no_grad():
        for name, p in base.named_parameters(remove_duplicate=False):
            p.copy_(exported[name])
    assert torch.allclose(base_logprobs(base, probe), adapted, atol=1e-5)

    trainer.save_hf(str(tmp_path / "final"), tiny_model_dir)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert torch.allclose(base_logprobs(saved, probe), adapted, atol=1e-5)
    assert (tmp_path / "final_adapter" / "adapter_config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])  # bf16-true: fp32 masters in DeepSpeed's optimizer
def test_a_lora_checkpoint_holds_the_adapter_alone_and_resumes_into_a_fresh_trainer(tiny_model_dir, tmp_path,
                                                                                     precision):
    """The frozen base is model.path, so a checkpoint leaves it out (module state and Hugging Face copy); a new
    trainer built on the base and loaded from it trains the next step exactly as the one that wrote it; a checkpoint
    of another adapter (other target modules) does not load."""
    batches = sft_batches(tiny_model_dir, steps=3)
    tr = TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=8, warmup_steps=0, precision=precision)
    lora, ckpt = LoraConfig(rank=4, alpha=8), str(tmp_path / "ckpt")
    trainer = PolicyTrainer(tiny_model_dir, tr, lora=lora)
    for b in batches[:2]:
        trainer.sft_step(b)
    trainer.save_checkpoint(ckpt)
    trainer.save_hf(os.path.join(ckpt, "policy_hf"), tiny_model_dir, merged=False)
    assert sorted(os.listdir(ckpt)) == ["latest", "policy", "policy_hf_adapter"]
    module = torch.load(os.path.join(ckpt, "policy", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and trained <= set(module)
    assert set(module) == trained  # not one tensor of the base (nor a tied head's second name)
    trainer.sft_step(batches[2])

    fresh = PolicyTrainer(tiny_model_dir, tr, lora=lora)
    fresh.load_checkpoint(ckpt)
    fresh.sft_step(batches[2])
    want = dict(trainer.model.named_parameters())
    for name, p in fresh.model.named_parameters():
        assert torch.allclose(p, want[name], atol=1e-6, rtol=0), (name, (p - want[name]).abs().max())
    other = PolicyTrainer(tiny_model_dir, tr, lora=LoraConfig(rank=4, alpha=8, target_modules=["q_proj"]))
    with pytest.raises(RuntimeError, match=r"does not fit this model: missing \[\], unexpected \[.*k_proj.lora_A"):
        other.load_checkpoint(ckpt)


@pytest.mark.slow
def test_lora_under_two_rank_zero3_matches_a_single_process(ray_local, tiny_model_dir, tmp_path):
    """LoRA with ZeRO-3 over 2 ranks: adapter, merged export and saved folders equal a single-process run on the same
    batches (1e-5), the adapter-disabled reference is still the base model, and its checkpoint restores."""
    from peft import PeftModel
    from safetensors.torch import load as load_bytes
    from transformers import AutoModelForCausalLM

    from actors.group import ActorGroup

    batches = sft_batches(tiny_model_dir, steps=3)
    lora = LoraConfig(rank=4, alpha=8)
    tr = TrainerConfig(lr=1e-2, batch_size=16, micro_batch_size=4, warmup_steps=0)
    single = PolicyTrainer(tiny_model_dir, tr, lora=lora)
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir,
                       tr=replace(tr, zero_stage=3), lora=lora)
    try:
        for b in batches:
            single.sft_step(b)
            group.train_step(b)
        expected = dict(single.iter_weights())
        merged = dict(group.export_weights())
        assert set(merged) == set(expected)
        for name, w in expected.items():
            assert torch.allclose(merged[name], w, atol=1e-5, rtol=0), (name, (merged[name] - w).abs().max())

        adapter = load_bytes(group.export_adapter()["adapter_model.safetensors"])
        want = load_bytes(single.export_adapter()["adapter_model.safetensors"])
        assert set(adapter) == set(want) and any(".lora_B." in k for k in adapter)
        assert all(torch.allclose(adapter[k], want[k], atol=1e-5, rtol=0) for k in want)
        assert not all(torch.equal(v, torch.zeros_like(v)) for k, v in adapter.items() if ".lora_B." in k)

        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        probe = batches[0]
        mask = probe["loss_mask"]
        assert torch.allclose(group.compute_ref_logprobs(probe)[mask], base_logprobs(base, probe), atol=1e-6)

        group.save_hf(str(tmp_path / "final"), tiny_model_dir)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
        adapted = single.compute_logprobs(probe)[mask]
        assert torch.allclose(base_logprobs(saved, probe), adapted, atol=1e-4)
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "final_adapter"))
        assert torch.allclose(base_logprobs(reloaded, probe), adapted, atol=1e-4)

        # a checkpoint without the frozen base (its partitions stay in place) restores the adapter and its moments
        group.save_checkpoint(str(tmp_path / "ckpt"))
        group.train_step(batches[0])
        after = dict(group.export_weights())
        group.load_checkpoint(str(tmp_path / "ckpt"))
        assert any(not torch.equal(w, after[n]) for n, w in group.export_weights())
        group.train_step(batches[0])
        assert all(torch.allclose(w, after[n], atol=1e-6, rtol=0) for n, w in group.export_weights())
    finally:
        group.kill()
