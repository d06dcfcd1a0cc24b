"""trainer.chunked_logprobs: log-probs from the final hidden states, the LM head applied a chunk of positions at a
time (actors.logits.DeferredHead, algorithms.logprobs.head_logprobs). Exact against the full logits (fp32), its
gradients too, in every layout; no head output ever holds more than a chunk's rows."""
from dataclasses import replace

import pytest
import torch

from actors.logits import defers_head
from actors.policy import PolicyTrainer
from actors.reference import ReferenceModel
from algorithms.logprobs import head_logprobs, logprobs_and_entropy
from rlhf.config import AlgorithmConfig, LoraConfig, TrainerConfig
from tests.actors.batching.test_prefix_sharing import grouped_batch

TR = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0)


def test_head_logprobs_equal_the_full_logits_path_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (37,), generator=g)
    weights = torch.randn(37, generator=g)

    full_logp, full_ent = logprobs_and_entropy(head(hidden), labels, temperature=0.6)
    (full_logp * weights).sum().backward()
    want = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    logp, ent = head_logprobs(hidden, head, labels, temperature=0.6, entropy=True, chunk_rows=5)  # 8 chunks
    (logp * weights).sum().backward()
    assert (logp - full_logp).abs().max() < 1e-5 and (ent - full_ent).abs().max() < 1e-5
    assert (hidden.grad - want[0]).abs().max() < 1e-5 and (head.weight.grad - want[1]).abs().max() < 1e-5
    assert not ent.requires_grad
    assert head_logprobs(hidden, head, labels)[1] is None  # no entropy pass unless asked


def policy_pair(model_dir, **changes):
    tr = replace(TR, **changes)
    return (PolicyTrainer(model_dir, replace(tr, chunked_logprobs=False)),
            PolicyTrainer(model_dir, replace(tr, chunked_logprobs=True)))


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix", "zero3"])
def test_an_update_from_chunked_logprobs_equals_the_full_logits_one(tiny_model_dir, layout):
    """GRPO-shaped rows in each layout (and under ZeRO-3, where the head's weight is gathered by DeepSpeed's hooks
    for every chunk, the backward's recomputation included): log-probs, the update's metrics and the gradients
    agree (fp32)."""
    full, chunked = policy_pair(tiny_model_dir, packing=layout == "packed", shared_prefix=layout == "shared_prefix",
                                zero_stage=3 if layout == "zero3" else 0)
    assert full.ds.head is None and chunked.ds.head is not None
    chunked.ds.head.chunk_rows = 7  # several chunks, one of them partial
    batch = grouped_batch(vocab=200)
    mask = batch["loss_mask"]
    old = full.compute_logprobs(batch)
    assert (chunked.compute_logprobs(batch) - old).abs().max() < 1e-5
    advantages = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) * mask
    old = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2)) * mask
    rows = dict(batch, old_logprobs=old, advantages=advantages, ref_logprobs=old.detach() * 0.9)
    algo = AlgorithmConfig(kl_coef=0.1, kl_in_reward=False)
    grads = [gradients(t) for t in (full, chunked)]
    a, b = full.rl_step(rows, algo), chunked.rl_step(rows, algo)
    for key in ("policy/loss", "train/grad_norm", "policy/entropy", "policy/kl", "policy/clip_frac"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert grads[0].keys() == grads[1].keys() and "model.embed_tokens.weight" in grads[1]  # the tied head's too
    for name, g in grads[0].items():
        assert (grads[1][name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, name


def gradients(trainer) -> dict:
    """Each trained parameter's gradient summed over the step's micro-batches, as the backward produces it (the
    weights after Adam would amplify rounding wherever a gradient is near zero)."""
    grads = {}

    def keep(g, name):
        grads[name] = grads.get(name, 0) + g.detach().clone()
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: keep(g, name))
    return grads


def test_sft_dpo_and_the_reference_agree_with_chunked_logprobs(tiny_model_dir):
    full, chunked = policy_pair(tiny_model_dir)
    batch = grouped_batch(vocab=200)
    a, b = full.sft_step(batch), chunked.sft_step(batch)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    pairs = dict(batch, ref_logps=torch.zeros(16))
    a, b = full.dpo_step(pairs, AlgorithmConfig(name="dpo")), chunked.dpo_step(pairs, AlgorithmConfig(name="dpo"))
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    refs = [ReferenceModel(tiny_model_dir, chunked_logprobs=c).compute_logprobs(batch) for c in (False, True)]
    assert (refs[1] - refs[0]).abs().max() < 1e-5


def test_lora_with_a_frozen_head_trains_the_same_from_chunked_logprobs(tiny_model_dir):
    """The adapter's gradient flows through the hidden states alone (the head is frozen); the adapter-disabled
    reference is chunked too."""
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    full, chunked = [PolicyTrainer(tiny_model_dir, replace(TR, chunked_logprobs=c), lora=lora) for c in (False, True)]
    assert not any(p.requires_grad for p in chunked.ds.head.parameters())
    batch = grouped_batch(vocab=200)
    assert (chunked.compute_ref_logprobs(batch) - full.compute_ref_logprobs(batch)).abs().max() < 1e-5
    advantages = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) * batch["loss_mask"]
    rows = dict(batch, advantages=advantages)
    for _ in range(2):  # the second step: the adapter's B is no longer zero
        a, b = full.rl_step(rows, AlgorithmConfig()), chunked.rl_step(rows, AlgorithmConfig())
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        assert b["policy/loss"] == pytest.approx(a["policy/loss"], rel=1e-5, abs=1e-7)


def test_the_head_never_outputs_more_than_one_chunk_of_rows(tiny_model_dir):
    """The memory claim, checked where it is made: every logits tensor the head produces in a training step
    (forward and the backward's recomputation) has at most chunk_rows rows; the full path's has them all."""
    full, chunked = policy_pair(tiny_model_dir)
    chunked.ds.head.chunk_rows = 6
    seen = {"full": [], "chunked": []}
    head = full.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, out: seen["full"].append((out.shape[-1], out.shape[:-1].numel())))
    forward = chunked.ds.head._forward  # the deferred head's chunks run inside one module call, through this

    def recorded(rows):
        out = forward(rows)
        seen["chunked"].append((out.shape[-1], out.shape[:-1].numel()))
        return out
    chunked.ds.head._forward = recorded
    for trainer in (full, chunked):
        batch = grouped_batch(vocab=200)
        trainer.rl_step(dict(batch, advantages=torch.ones(16, 1) * batch["loss_mask"]), AlgorithmConfig())
    handle.remove()
    vocab = chunked.model.config.vocab_size
    logits_rows = {name: [n for width, n in sizes if width == vocab] for name, sizes in seen.items()}
    assert max(logits_rows["full"]) > 6  # (the passes-through of the deferred forward have the hidden width)
    assert len(logits_rows["chunked"]) >= 2 * 3 and max(logits_rows["chunked"]) <= 6  # forward + recomputation


def test_models_whose_logits_are_not_their_heads_output_keep_the_full_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert defers_head(model) is None
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in defers_head(model)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_recomputes_the_layers_and_changes_no_gradient(tiny_model_dir, lora):
    adapter = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    plain, recomputed = [PolicyTrainer(tiny_model_dir, replace(TR, gradient_checkpointing=c), lora=adapter)
                         for c in (False, True)]
    layers = recomputed.model.get_base_model().model.layers if lora else recomputed.model.model.layers
    assert recomputed.model.is_gradient_checkpointing and layers[0].gradient_checkpointing
    calls, mlp = [], layers[0].mlp.forward
    layers[0].mlp.forward = lambda x: calls.append(1) or mlp(x)  # (module hooks do not fire in the recomputation)
    batch = grouped_batch(vocab=200)
    rows = dict(batch, advantages=torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) * batch["loss_mask"])
    grads = [gradients(t) for t in (plain, recomputed)]
    a, b = plain.rl_step(rows, AlgorithmConfig()), recomputed.rl_step(rows, AlgorithmConfig())
    assert len(calls) == 2 * 2  # two micro-batches, each layer run again in the backward
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    for name, g in grads[0].items():
        assert (grads[1][name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, name


def test_the_deferred_head_runs_under_the_trainers_autocast(tiny_model_dir):
    """Applied after the forward, outside its autocast: the head brings its own (bf16-mixed matmuls in bf16)."""
    mixed = PolicyTrainer(tiny_model_dir, replace(TR, precision="bf16-mixed", chunked_logprobs=True), dtype="bfloat16")
    out = mixed.ds(mixed.ds.on_device(grouped_batch(vocab=200)))
    assert out.hidden.dtype == torch.float32 and out.head(out.hidden[0]).dtype == torch.bfloat16
