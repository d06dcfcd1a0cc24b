"""LoRA on the policy: training changes only adapter weights, the adapter-disabled model is the reference (the base
model's log-probs, bit for bit), and the exported merged weights reproduce the adapted policy."""
import pytest
import torch

from actors.policy import PolicyTrainer
from algorithms.logprobs import token_logprobs
from rlhf.config import LoraConfig, TrainerConfig
from tests.actors.test_trainer_group import sft_batches


def base_logprobs(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])


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
    assert torch.equal(trainer.compute_ref_logprobs(probe), base_logprobs(base, probe))
    adapted = trainer.compute_logprobs(probe)
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
