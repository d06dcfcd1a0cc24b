"""`PolicyTrainer`: a causal LM inside a DeepSpeed engine (ZeRO 0-3, fp32/bf16, gradient accumulation, clipping,
warm-up LR schedule). A plain class: Ray hosts it (actors/group.py) or a driver uses it in-process."""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from actors.dist import free_port, init_deepspeed_distributed
from algorithms.sft import sft_loss
from rlhf.batch import Batch, split_batch
from rlhf.config import TrainerConfig
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
                 world_size: int = 1, master_port: Optional[int] = None, seed: int = 0,
                 trust_remote_code: bool = False):
        import deepspeed
        from transformers import AutoModelForCausalLM

        init_deepspeed_distributed(rank, world_size, master_port)
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
        from algorithms.logprobs import token_logprobs
        logits = self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        return token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of SFT on this rank's rows (input_ids, attention_mask, loss_mask).

        Every micro-batch loss is divided by the *global* token count (times world size, since DeepSpeed averages
        gradients over ranks), so the update equals a token-mean over the whole batch however it is split.
        """
        global_tokens = self._all_reduce_sum(batch["loss_mask"].sum().float())
        nll_sum, grad_norm = 0.0, None
        micro_batches = split_batch(batch, self.engine.gradient_accumulation_steps())
        for i, mb in enumerate(micro_batches):
            logits = self.engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            loss, _ = sft_loss(logits[:, :-1], mb["input_ids"][:, 1:], mb["loss_mask"],
                               normalizer=global_tokens / self.world_size)
            self.engine.backward(loss, scale_wrt_gas=False)
            if i == len(micro_batches) - 1:
                grad_norm = self._stage0_grad_norm()
            self.engine.step()
            nll_sum += loss.item() / self.world_size
        return {"train/loss": self._all_reduce_sum(torch.tensor(nll_sum)).item(),
                "train/grad_norm": float(grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()),
                "train/lr": self.engine.get_lr()[0]}

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

    def save_hf(self, out_dir: str, tokenizer=None) -> None:
        """Save the full model as a Hugging Face folder (safetensors); rank 0 writes (ZeRO-3 gathers first)."""
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.cfg.zero_stage == 3 else None
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
