"""`Critic`: per-token value estimates V(s_t) from a backbone with a scalar head (initialised from the policy
checkpoint; the head is new), trained with the clipped value loss. A plain class hosted by ActorGroup."""
from __future__ import annotations

from typing import Optional

import torch

from actors.dist import releases_gpu_cache
from actors.ds_model import DSModel
from algorithms.ppo import value_loss
from common.batch import Batch
from common.dtypes import weights_dtype
from common.schema import AlgorithmConfig, TrainerConfig, precision_of


def _values(mb: Batch, out) -> torch.Tensor:
    """V of the state before each target token: aligned with loss_mask, (B, L-1) fp32."""
    return out.logits[:, :-1, 0].float()


class Critic:
    def __init__(self, model_path: str, tr: TrainerConfig, dtype: str = "float32", rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                 seed: int = 0, trust_remote_code: bool = False):
        from transformers import AutoConfig, AutoModelForTokenClassification

        held = weights_dtype(precision_of(tr.precision, dtype))

        def build():
            config = AutoConfig.from_pretrained(model_path, num_labels=1, trust_remote_code=trust_remote_code)
            config.classifier_dropout = 0.0  # values computed for GAE (eval mode) and in training must agree
            return AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=held,
                                                                   attn_implementation=tr.attn_implementation,
                                                                   trust_remote_code=trust_remote_code)
        self.ds = DSModel(build, tr, dtype, rank, world_size, master_addr, master_port, seed, checkpoint=model_path)

    def save_checkpoint(self, path: str) -> None:
        self.ds.save_checkpoint(path, "critic")

    def load_checkpoint(self, path: str) -> None:
        self.ds.load_checkpoint(path, "critic")

    def offload(self) -> None:
        self.ds.offload()

    def memory_plan(self, tokens: int) -> Optional[str]:
        return self.ds.plan_preview(tokens)

    @releases_gpu_cache
    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.ds.inference(batch, _values)

    @releases_gpu_cache
    def train_step(self, batch: Batch, algo: AlgorithmConfig, extra: Optional[Batch] = None) -> dict[str, float]:
        """`extra`: more per-row tensors for the same rows (old values and returns beside the shipped rollout)."""
        return self.value_step({**batch, **extra} if extra else batch, algo)

    def value_step(self, batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
        """`algorithm.ppo_epochs` passes of the clipped value loss; rows hold old_values and returns (B, L-1)."""
        def loss_fn(mb: Batch, out, normalizer: float):
            return value_loss(_values(mb, out), mb["old_values"], mb["returns"], mb["loss_mask"],
                              clip=algo.value_clip, normalizer=normalizer)
        metrics = self.ds.train_epochs(batch, algo.ppo_epochs, loss_fn, "token-mean")
        metrics["critic/loss"] = metrics.pop("loss")
        metrics["critic/grad_norm"] = metrics.pop("train/grad_norm")
        metrics["critic/skipped_updates"] = metrics.pop("train/skipped_updates")
        metrics.pop("train/lr")
        return metrics
