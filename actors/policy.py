"""`PolicyTrainer`: the causal LM being trained (SFT and on-policy RL losses), its log-probs, and the export of its
full weights for syncing into rollout engines. A plain class: Ray hosts it (actors/group.py) or a driver uses it
in-process."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import torch

from actors.dist import releases_gpu_cache
from actors.ds_model import DSModel, save_tokenizer
from actors.logits import shifted_logprobs, shifted_logprobs_entropy
from algorithms.dpo import dpo_objective
from algorithms.objective import rl_objective
from algorithms.sft import nll_loss
from common import spans
from common.batch import Batch, sequence_logprobs
from common.checkpoint_format import as_checkpoint, fuses_tensors
from common.dtypes import DTYPES, weights_dtype
from common.net import node_address
from common.schema import AlgorithmConfig, LoraConfig, TrainerConfig, precision_of
from rollout.sync import WeightSender, drain
from rollout.sync.buckets import TensorSpec, spec_of


def add_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    import peft
    return peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                      target_modules=list(lora.target_modules),
                                                      task_type="CAUSAL_LM"))


class PolicyTrainer:
    def __init__(self, model_path: str, tr: TrainerConfig, dtype: str = "float32", rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                 seed: int = 0, trust_remote_code: bool = False, lora: Optional[LoraConfig] = None,
                 logprob_temperature: float = 1.0, routing_replay: str = "off"):
        """`logprob_temperature`: the RL log-probs (old, trained, LoRA reference) are of softmax(logits / it), the
        distribution the rollouts were sampled from (rollout.tempered_logprobs); DPO's stay raw. `routing_replay`
        (algorithm.routing_replay, a mixture of experts): what the forwards do with the rollout's `routes`."""
        from transformers import AutoModelForCausalLM

        self.lora = lora if lora is not None and lora.rank > 0 else None
        held = weights_dtype(precision_of(tr.precision, dtype))

        def build():
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=held,
                                                         attn_implementation=tr.attn_implementation,
                                                         trust_remote_code=trust_remote_code)
            return add_lora(model, self.lora) if self.lora else model
        self.ds = DSModel(build, tr, dtype, rank, world_size, master_addr, master_port, seed, checkpoint=model_path,
                          defer_head=tr.chunked_logprobs)
        self.rank, self.cfg, self.temperature = rank, tr, logprob_temperature
        self.trust_remote_code = trust_remote_code
        self.export_dtype = DTYPES[dtype]  # the engines' (model.dtype), whatever the trainer's weights are in
        self.fused = fuses_tensors(self.model)  # (mixture-of-experts layers: exported as the checkpoint's experts)
        if self.ds.routers is not None:
            self.ds.routers.mode = routing_replay

    @property
    def model(self) -> torch.nn.Module:
        return self.ds.module

    @releases_gpu_cache
    def train_step(self, batch: Batch, algo: Optional[AlgorithmConfig] = None,
                   extra: Optional[Batch] = None) -> dict[str, float]:
        """One update on this rank's rows: the on-policy RL loss with `algo` (rl_step), else SFT (sft_step).
        `extra`: more per-row tensors for the same rows (the step's advantages beside its shipped rollout).
        `time/train_worker` is its own duration: the driver's `time/train` less this is transport and waiting."""
        start = time.perf_counter()
        batch = {**batch, **extra} if extra else batch
        metrics = self.rl_step(batch, algo) if algo is not None else self.sft_step(batch)
        return {**metrics, "time/train_worker": time.perf_counter() - start}

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of SFT on this rank's rows (input_ids, attention_mask, loss_mask)."""
        def loss_fn(mb: Batch, out, normalizer: float):
            loss, _ = nll_loss(shifted_logprobs(mb, out), mb["loss_mask"], normalizer=normalizer)
            return loss, {}  # its per-micro-batch NLL would only repeat train/loss
        metrics = self.ds.optimizer_step(batch, loss_fn, "token-mean")
        metrics["train/loss"] = metrics.pop("loss")
        return metrics

    def rl_step(self, batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
        """`algorithm.ppo_epochs` passes of the clipped policy loss over this rank's rollout rows. Rows hold
        input_ids, attention_mask, loss_mask, advantages (B, L-1), rollout_logprobs (the engine's) and ref_logprobs
        when KL is a loss term. The metrics include the rollout's `rollout/logprob_diff` (mean |old - engine|
        log-prob) and, with ref_logprobs, `rollout/kl` (old vs reference), computed here where the old log-probs
        are: token means over each mini-batch, averaged over the update's optimizer steps. The loss and its metrics
        are algorithms/objective.py's rl_objective.

        Rows hold old_logprobs too, unless the update is a single on-policy step (one epoch, one mini-batch): then
        the weights are still those that generated the rollout, the old log-probs are this forward's own (detached;
        ratio 1, the same gradient), and a separate forward pass is saved."""
        fused = "old_logprobs" not in batch
        if fused and (algo.ppo_epochs != 1 or len(batch["input_ids"]) * self.ds.data_parallel != self.cfg.batch_size):
            raise ValueError("rl_step without old_logprobs needs ppo_epochs == 1 and one mini-batch per rollout")

        kl_coef = algo.kl_coef if algo.kl_mode() == "loss" else 0.0
        surrogate = dict(surrogate=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
                         dual_clip=algo.dual_clip, tis_cap=algo.tis_cap, tis_mask=algo.tis_bounds(),
                         tis_level=algo.rollout_correction)

        def loss_fn(mb: Batch, out, normalizer: float):
            logp, entropy = shifted_logprobs_entropy(mb, out, self.temperature)
            return rl_objective(logp, logp.detach() if fused else mb["old_logprobs"], mb["advantages"],
                                mb["loss_mask"], entropy, ref_logprobs=mb.get("ref_logprobs"),
                                rollout_logprobs=mb.get("rollout_logprobs"), kl_coef=kl_coef,
                                kl_estimator=algo.kl_estimator, agg=algo.loss_agg, normalizer=normalizer,
                                max_len=algo.loss_norm_len, **surrogate)

        metrics = self.ds.train_epochs(batch, algo.ppo_epochs, loss_fn, algo.loss_agg)
        metrics["policy/loss"] = metrics.pop("loss")
        return metrics

    def dpo_step(self, batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
        """One optimizer step of DPO on interleaved pairs (see common.batch.pack_pairs); rows also hold ref_logps (B,),
        the reference model's summed completion log-probs."""
        def loss_fn(mb: Batch, out, normalizer: float):  # the mean over the mini-batch's pairs
            logps = sequence_logprobs(shifted_logprobs(mb, out), mb["loss_mask"])
            return dpo_objective(logps, mb["ref_logps"], mb["loss_mask"].sum(-1), beta=algo.beta,
                                 loss_type=algo.dpo_loss, label_smoothing=algo.label_smoothing,
                                 nll_coef=algo.dpo_nll_coef, normalizer=normalizer)
        metrics = self.ds.optimizer_step(batch, loss_fn, "seq-mean", unit=2)  # pairs stay in one micro-batch
        metrics["train/loss"] = metrics.pop("loss")
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.ds.save_checkpoint(path, "policy")

    def load_checkpoint(self, path: str) -> None:
        self.ds.load_checkpoint(path, "policy")

    def _tempered_logprobs(self, mb: Batch, out) -> torch.Tensor:
        return shifted_logprobs(mb, out, self.temperature)

    @releases_gpu_cache
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs of input_ids[:, 1:] under the current weights at the logprob temperature, (B, L-1) fp32."""
        return self.ds.inference(batch, self._tempered_logprobs)

    def offload(self) -> None:
        self.ds.offload()

    def memory_plan(self, tokens: int) -> Optional[str]:
        return self.ds.plan_preview(tokens)

    def matmul_dtype(self) -> str:
        """The dtype this rank's matmuls run in: its weights', or bf16 under bf16-mixed's autocast."""
        dtype = torch.bfloat16 if self.ds.precision == "bf16-mixed" else next(self.model.parameters()).dtype
        return str(dtype).removeprefix("torch.")

    @releases_gpu_cache
    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """LoRA only: the reference policy is this model with its adapter disabled (routing for itself: a mixture
        of experts' replayed routes are the policy's)."""
        batch = {k: v for k, v in batch.items() if k != "routes"}
        with self.model.disable_adapter():
            return self.ds.inference(batch, self._tempered_logprobs)

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None, merged: bool = True) -> None:
        """Full weights as a Hugging Face folder; with LoRA the merged model there, and the adapter in PEFT format
        in `<out_dir>_adapter`; `merged=False` (a checkpoint's copy) writes the adapter alone. Every rank calls it
        (ZeRO-3 gathers are collective); rank 0 writes."""
        if self.lora is None:
            return self.ds.save_hf(out_dir, tokenizer_path, self.trust_remote_code)
        adapter = self._adapter_state()
        if self.rank != 0:
            if merged:
                drain(self.iter_weights())
            return
        self.model.save_pretrained(out_dir.rstrip("/") + "_adapter", state_dict=adapter)
        if not merged:
            return
        self.model.get_base_model().save_pretrained(out_dir, state_dict=dict(self.iter_weights()),
                                                    safe_serialization=True)
        if tokenizer_path is not None:
            save_tokenizer(tokenizer_path, out_dir, self.trust_remote_code)

    # ---- weight export for sync ----
    def export_adapter(self) -> dict[str, bytes]:
        """LoRA only: the adapter as a PEFT folder's files (config + safetensors), for engines that apply LoRA
        themselves; a few MB instead of the full model. Every rank calls it (ZeRO-3 gathers); rank 0 returns it."""
        import tempfile
        adapter = self._adapter_state()
        if self.rank != 0:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.model.save_pretrained(tmp, state_dict=adapter)
            return {name: Path(tmp, name).read_bytes() for name in os.listdir(tmp)}

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights under PEFT's names, whole (gathered under ZeRO-3)."""
        self.ds.resident()
        named = [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n]
        with self._gathered([p for _, p in named]):
            return {n: p.data.detach().clone() for n, p in named}

    def _gathered(self, params: list):
        """Under ZeRO-3, `params` whole on every rank inside the block (a collective); otherwise nothing to do."""
        import contextlib

        import deepspeed
        if self.cfg.zero_stage != 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def weight_specs(self) -> list[TensorSpec]:
        """Name, full shape and dtype of every exported parameter, in export order. Tied weights are listed under
        each of their names (as in a state dict): vLLM keeps its own lm_head copy, which a reload must overwrite."""
        specs = []
        for n, p, _ in self._export_params():
            shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # (ZeRO-3 holds a shard: the full shape)
            whole = torch.empty(shape, dtype=self.export_dtype, device="meta")
            parts = as_checkpoint(self.model, n, whole) if self.fused else [(n, whole)]
            specs += [replace(spec_of(name, part, None), dtype=str(self.export_dtype)) for name, part in parts]
        return specs

    def _export_params(self) -> Iterator[tuple[str, torch.nn.Parameter, Optional[torch.nn.Module]]]:
        """(checkpoint name, parameter, LoRA layer whose delta must be added or None). With LoRA, adapter weights
        are skipped and PEFT's names are mapped back to the base model's."""
        if self.lora is None:
            for name, p in self.model.named_parameters(remove_duplicate=False):
                yield name, p, None
            return
        layers = {f"{n}.base_layer.weight": m for n, m in self.model.named_modules() if hasattr(m, "get_delta_weight")}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if ".lora_" not in name:
                yield (name.removeprefix("base_model.model.").replace(".base_layer.", "."), p,
                       layers.get(name))

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters in `weight_specs` order (LoRA: base + delta, computed without touching the model, so
        repeated syncs never accumulate merge/unmerge rounding). Under ZeRO-3 each one (with its LoRA factors) is
        gathered (a collective: every rank must iterate) and copied out before it is re-partitioned."""
        self.ds.resident()
        for name, p, lora_layer in self._export_params():
            factors = [] if lora_layer is None else [m.weight for d in (lora_layer.lora_A, lora_layer.lora_B)
                                                     for m in d.values()]
            with self._gathered([p] + factors), torch.no_grad():
                if lora_layer is not None:
                    full = p.data + lora_layer.get_delta_weight(lora_layer.active_adapters[0])
                else:
                    full = p.data.detach().clone() if self.cfg.zero_stage == 3 else p.data.detach()
                full = full.to(self.export_dtype)  # bf16-mixed, fp32 trainers: cast to the engines' dtype
                yield from as_checkpoint(self.model, name, full) if self.fused else [(name, full)]

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """All full weights at once (every rank must call this under ZeRO-3; only rank 0 returns them)."""
        if self.rank != 0:
            drain(self.iter_weights())
            return []
        return [(n, t.to("cpu", copy=True)) for n, t in self.iter_weights()]

    def sync_address(self) -> tuple[str, int]:
        return node_address()

    def open_sender(self, channel: str, host: str, port: int, plan: list[list[TensorSpec]], world_size: int = 0,
                    engines: Optional[list[int]] = None, verify: bool = False, local_engine=None,
                    workers: int = 1) -> dict:
        """Join the trainer -> engines channel (rollout.sync.setup_sync) with the bucket plan every later sync
        uses. ipc: returns the staging-buffer handles of the engines this rank feeds. `local_engine`: the engine in
        this process that the `local` channel hands the tensors to (actors.hybrid). `workers`: each engine's
        tensor-parallel workers, each a receiver."""
        self._sender = WeightSender(channel, self.rank, host, port, plan, world_size, engines or [],
                                    local_engine=local_engine, verify=verify, workers=workers)
        return self._sender.handles()

    def sync_fingerprints(self) -> dict:
        """What the last sync sent from this rank, fingerprinted (with verification on; rollout.sync.check)."""
        return self._sender.fingerprints

    def sender_opened(self) -> None:
        """The engines have mapped the staging files (or set-up failed somewhere): their names can go. Also called
        on a rank whose open_sender failed, which has nothing to remove."""
        if getattr(self, "_sender", None) is not None:
            self._sender.opened()

    @releases_gpu_cache
    def send_weights(self, fingerprint: bool = True) -> int:
        """This rank's part of one sync: export every weight (collective under ZeRO-3) and send it (fingerprinted
        if the channel verifies and `fingerprint`)."""
        with spans.span("send"):
            return self._sender.send(self.iter_weights(), fingerprint)
