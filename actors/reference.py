"""`ReferenceModel`: a frozen copy of the initial policy that scores sequences (for the KL penalty and DPO)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from actors.batching.microbatch import map_grouped
from actors.dist import releases_gpu_cache
from actors.logits import DeferredHead, HeadOutput, keep_kwargs, shifted_logprobs, takes_logits_to_keep
from common.batch import Batch, attention_inputs
from common.dtypes import autocast, weights_dtype
from common.schema import precision_of


class ReferenceModel:
    def __init__(self, model_path: str, dtype: str = "float32", micro_batch_size: int = 16,
                 trust_remote_code: bool = False, logprob_temperature: float = 1.0, precision: Optional[str] = None,
                 chunked_logprobs: bool = False, max_tokens_per_micro_batch: Optional[int] = None):
        """`logprob_temperature`: log-probs of softmax(logits / it), as the policy's (rollout.tempered_logprobs).
        `precision`: the policy's trainer.precision, so the reference computes what the policy's first forward does
        (a bf16-mixed policy's reference is fp32 under autocast too); null = by `dtype`. `chunked_logprobs`: from
        the hidden states, the head applied a chunk at a time (trainer.chunked_logprobs, actors.logits).
        `max_tokens_per_micro_batch`: micro-batches of as many rows as fit that many padded tokens, instead of
        `micro_batch_size` rows (the trainer's setting: long completions would not fit 16 rows)."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.precision = precision_of(precision, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=weights_dtype(self.precision),
                                                          trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval().requires_grad_(False)
        self.micro_batch_size, self.temperature = micro_batch_size, logprob_temperature
        self.max_tokens = max_tokens_per_micro_batch
        self.trims_logits = takes_logits_to_keep(self.model)
        self.head = DeferredHead.attach(self.model, chunked_logprobs, self.precision, self.device)

    @releases_gpu_cache
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs of input_ids[:, 1:], (B, L-1) fp32 on CPU; with a loss_mask, zero where it is false (logits
        only from each micro-batch's first trained position: actors.logits)."""
        def run(mb: Batch) -> torch.Tensor:
            mb = {k: v.to(self.device) for k, v in mb.items()}
            with autocast(self.precision, self.device), self._deferring():
                out = self.model(input_ids=mb["input_ids"], **attention_inputs(mb),
                                 **keep_kwargs(mb, self.trims_logits))
            out = out if self.head is None else HeadOutput(out.logits, self.head)
            return shifted_logprobs(mb, out, self.temperature).cpu()
        keys = [k for k in ("input_ids", "attention_mask", "loss_mask", "position_ids") if k in batch]
        return map_grouped({k: batch[k] for k in keys}, self.micro_batch_size, run, max_tokens=self.max_tokens)

    def _deferring(self):
        return self.head.deferring() if self.head is not None else contextlib.nullcontext()
