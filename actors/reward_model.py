"""`RewardModel`: a sequence classifier that scores prompt+completion (the score of the last non-pad token).
Trained with the Bradley-Terry loss in the `rm` stage; used frozen to score rollouts in RL."""
from __future__ import annotations

from typing import Optional

import torch

from actors.batching.microbatch import map_grouped
from actors.dist import releases_gpu_cache
from actors.ds_model import DSModel
from algorithms.reward import bradley_terry_loss
from common.batch import Batch
from common.dtypes import DTYPES, weights_dtype
from common.schema import TrainerConfig, precision_of


def _load(model_path: str, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path, num_labels=1, trust_remote_code=trust_remote_code)
    if config.pad_token_id is None:  # needed to find each row's last real token
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return AutoModelForSequenceClassification.from_pretrained(model_path, config=config, dtype=dtype,
                                                              trust_remote_code=trust_remote_code)


class RewardModel:
    def __init__(self, model_path: str, tr: Optional[TrainerConfig] = None, dtype: str = "float32", rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                 seed: int = 0, trust_remote_code: bool = False, micro_batch_size: int = 32,
                 max_tokens_per_micro_batch: Optional[int] = None):
        """With `tr` the model trains in a DeepSpeed engine; without it, it only scores (frozen, no optimizer).
        Scoring runs `micro_batch_size` rows at a time, or as many as fit `max_tokens_per_micro_batch` padded
        tokens."""
        self.ds, self.micro_batch_size, self.max_tokens = None, micro_batch_size, max_tokens_per_micro_batch
        self.trust_remote_code = trust_remote_code
        if tr is not None:
            held = weights_dtype(precision_of(tr.precision, dtype))
            self.ds = DSModel(lambda: _load(model_path, held, trust_remote_code), tr, dtype, rank, world_size,
                              master_addr, master_port, seed, per_token=False,  # one score a row: never packed
                              checkpoint=model_path)
            self.model = self.ds.module
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = _load(model_path, DTYPES[dtype], trust_remote_code).eval().requires_grad_(False).to(device)

    @releases_gpu_cache
    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        """One scalar per row: (B,) fp32."""
        was_training = self.model.training
        self.model.eval()
        dev = self.model.device

        def run(mb: Batch) -> torch.Tensor:
            out = self.model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev))
            return out.logits[:, 0].float().cpu()
        scores = map_grouped({k: batch[k] for k in ("input_ids", "attention_mask")}, self.micro_batch_size, run,
                             max_tokens=self.max_tokens)
        self.model.train(was_training)
        return scores

    def rm_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the Bradley-Terry loss on interleaved pairs (common.batch.pack_pairs)."""
        def loss_fn(mb: Batch, out, normalizer: float):
            scores = out.logits[:, 0].float()
            loss, m = bradley_terry_loss(scores[0::2], scores[1::2])
            return loss * len(scores) / normalizer, m  # mean over the mini-batch's pairs
        metrics = self.ds.optimizer_step(batch, loss_fn, "seq-mean", unit=2)  # pairs stay in one micro-batch
        metrics["train/loss"] = metrics.pop("loss")
        return metrics

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None, merged: bool = True) -> None:
        """The full model (`merged` is the policy's LoRA switch: a reward model has no adapter)."""
        self.ds.save_hf(out_dir, tokenizer_path, self.trust_remote_code)

    def save_checkpoint(self, path: str) -> None:
        self.ds.save_checkpoint(path, "reward_model")

    def load_checkpoint(self, path: str) -> None:
        self.ds.load_checkpoint(path, "reward_model")
