"""`PolicyTrainer`: a causal LM inside a DeepSpeed engine (ZeRO 0-3, fp32/bf16, gradient accumulation, clipping,
warm-up LR schedule). A plain class: Ray hosts it (actors/group.py) or a driver uses it in-process."""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from actors.dist import free_port, init_deepspeed_distributed
from algorithms.common import aggregate_loss, masked_mean
from algorithms.kl import kl_estimate
from algorithms.logprobs import entropy_from_logits, token_logprobs
from algorithms.ppo import policy_loss
from algorithms.sft import sft_loss
from rlhf.batch import Batch, split_batch
from rlhf.config import AlgorithmConfig, TrainerConfig
from rollout.weight_sync import SyncGroup, TensorSpec, send_weights, spec_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def deepspeed_config(tr: TrainerConfig, dtype: str, world_size: int) -> dict:
    grad_accum = tr.batch_size // (tr.micro_batch_size * world_size)
    return {
        "train_batch_size": tr.micro_batch_size * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": tr.grad_clip,
        "zero_optimization": {"stage": tr.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,  # torch AdamW: no 140-170 s C++ optimizer build on CPU
        "steps_per_print": 10**9,
    }


def warmup_lambda(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


class PolicyTrainer:
    def __init__(self, model_path: str, tr: TrainerConfig, dtype: str = "float32", rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                 seed: int = 0, trust_remote_code: bool = False):
        import deepspeed
        from transformers import AutoModelForCausalLM

        init_deepspeed_distributed(rank, world_size, master_addr, master_port)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.cfg = rank, world_size, tr
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(tr.warmup_steps))
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(tr, dtype, world_size))

    @property
    def model(self):
        return self.engine.module

    def _forward_logprobs(self, mb: Batch) -> torch.Tensor:
        """Log-probs of input_ids[:, 1:] under the model: (B, L-1) fp32."""
        logits = self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        return token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of SFT on this rank's rows (input_ids, attention_mask, loss_mask)."""
        def loss_fn(mb: Batch, logits: torch.Tensor, normalizer: float):
            loss, _ = sft_loss(logits[:, :-1], mb["input_ids"][:, 1:], mb["loss_mask"], normalizer=normalizer)
            return loss, {}  # its per-micro-batch NLL would only repeat train/loss
        out = self._optimizer_step(batch, loss_fn, "token-mean")
        out["train/loss"] = out.pop("loss")
        return out

    def rl_step(self, batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
        """`algorithm.ppo_epochs` passes over this rank's rollout rows in mini-batches of trainer.batch_size (over all
        ranks), one optimizer step each. Rows hold input_ids, attention_mask, loss_mask, old_logprobs, advantages
        (B, L-1), and ref_logprobs / rollout_logprobs when the KL-in-loss / TIS options use them."""
        def loss_fn(mb: Batch, logits: torch.Tensor, normalizer: float):
            logp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
            loss, m = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], algo.clip_low,
                                  algo.clip_high, algo.dual_clip, mb.get("rollout_logprobs"), algo.tis_cap,
                                  algo.loss_agg, normalizer)
            if algo.kl_coef > 0 and not algo.kl_in_reward:
                kl = kl_estimate(logp, mb["ref_logprobs"], algo.kl_estimator)
                loss = loss + algo.kl_coef * aggregate_loss(kl, mb["loss_mask"], algo.loss_agg, normalizer)
                m["policy/kl"] = masked_mean(kl, mb["loss_mask"]).detach()
            m["policy/entropy"] = masked_mean(entropy_from_logits(logits[:, :-1].detach()), mb["loss_mask"])
            return loss, m

        rows = len(batch["input_ids"]) * self.world_size // self.cfg.batch_size
        history: dict[str, list[float]] = {}
        for _ in range(algo.ppo_epochs):
            for mini in split_batch(batch, rows):
                for k, v in self._optimizer_step(mini, loss_fn, algo.loss_agg).items():
                    history.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in history.items()}
        out["policy/loss"] = out.pop("loss")
        return out

    def _optimizer_step(self, mini: Batch, loss_fn, agg: str) -> dict[str, float]:
        """Forward/backward over micro-batches of `mini`, then one optimizer step.

        Each micro-batch loss is divided by the *global* count (tokens for token-mean, else sequences) times the
        world size, since DeepSpeed averages gradients over ranks: the update equals the loss over the whole
        mini-batch however it is split across micro-batches and ranks.
        """
        count = mini["loss_mask"].sum() if agg == "token-mean" else torch.tensor(len(mini["input_ids"]))
        normalizer = self._all_reduce_sum(count.float()).item() / self.world_size
        micro_batches = split_batch(mini, self.engine.gradient_accumulation_steps())
        loss_sum, grad_norm, metrics = 0.0, None, {}
        for i, mb in enumerate(micro_batches):
            logits = self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            loss, m = loss_fn(mb, logits, normalizer)
            self.engine.backward(loss, scale_wrt_gas=False)
            if i == len(micro_batches) - 1:
                grad_norm = self._stage0_grad_norm()
            self.engine.step()
            loss_sum += loss.item() / self.world_size
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(micro_batches)
        metrics["loss"] = self._all_reduce_sum(torch.tensor(loss_sum)).item()
        metrics["train/grad_norm"] = float(grad_norm if grad_norm is not None else self.engine.get_global_grad_norm())
        metrics["train/lr"] = self.engine.get_lr()[0]
        return metrics

    def _stage0_grad_norm(self) -> Optional[float]:
        """ZeRO 1-3 optimizers record the global grad norm; stage 0 in fp32 does not, so compute it (gradients are
        already averaged over ranks after the boundary backward)."""
        if self.cfg.zero_stage != 0:
            return None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs of input_ids[:, 1:] under the current weights, (B, L-1) fp32, in micro-batches."""
        self.engine.eval()
        mbs = split_batch(batch, max(1, len(batch["input_ids"]) // self.cfg.micro_batch_size))
        out = torch.cat([self._forward_logprobs(mb) for mb in mbs])
        self.engine.train()
        return out

    # ---- weight export for sync ----
    def weight_specs(self) -> list[TensorSpec]:
        """Name, full shape and dtype of every parameter, in export order. Tied weights are listed under each of
        their names (as in a state dict): vLLM keeps its own lm_head copy, which a reload must overwrite too."""
        return [spec_of(n, p, getattr(p, "ds_shape", None))
                for n, p in self.model.named_parameters(remove_duplicate=False)]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters in `weight_specs` order. Under ZeRO-3 each one is gathered (a collective: every rank must
        iterate) and copied out before it is re-partitioned."""
        import deepspeed
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if self.cfg.zero_stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    yield name, p.data.detach().clone()
            else:
                yield name, p.data.detach()

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """All full weights at once (every rank must call this under ZeRO-3; only rank 0 returns them)."""
        weights = [(n, t.clone()) for n, t in self.iter_weights()]
        return weights if self.rank == 0 else []

    def sync_address(self) -> tuple[str, int]:
        import ray
        return ray.util.get_node_ip_address(), free_port()

    def init_sync_group(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins the trainer->engines sync group as its rank 0; other ranks only take part in gathers."""
        if self.rank == 0:
            self._sync_group = SyncGroup(host, port, 0, world_size)

    def send_weights(self, plan: list[list[TensorSpec]]) -> int:
        weights = self.iter_weights()
        if self.rank == 0:
            return send_weights(self._sync_group, weights, plan)
        for _ in weights:  # still take part in every ZeRO-3 gather
            pass
        return 0

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None) -> None:
        """Save the full model as a Hugging Face folder (safetensors), plus the tokenizer from `tokenizer_path`.
        Rank 0 writes; under ZeRO-3 every rank must call this (the gather is collective)."""
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.cfg.zero_stage == 3 else None
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer_path is not None:
                from transformers import AutoTokenizer
                AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)
