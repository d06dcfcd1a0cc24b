"""`HFEngine`: batched transformers `generate` behind the `RolloutEngine` protocol, for hosts without vLLM."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from rollout.engine import Advanced, Request, Sample, SamplingConfig
from rollout.engines.inflight import Counts, RegeneratedRequests
from rollout.render import PromptRenderer, render_prompts


class _TokenLogprobs:
    """A logits processor that records the sampled tokens' log-probs, what the trainer recomputes: placed first it
    sees each step's raw logits (vLLM's `raw_logprobs`), placed right after the temperature the tempered ones
    (rollout.tempered_logprobs; nucleus truncation comes after it). It keeps their log-softmax only until the next
    step's input shows which token was drawn, so one step's (B, V) is held at a time, never every step's
    (transformers' output_logits)."""

    def __init__(self):
        self.pending: torch.Tensor | None = None
        self.picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = scores.float().log_softmax(-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.picked.append(self.pending.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        self.pending = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """new_tokens (B, T) the generated ids -> (B, T) fp32 log-probs (pad positions after a row's end included)."""
        if self.pending is not None:
            self._take(new_tokens[:, len(self.picked)])
        return torch.stack(self.picked, dim=1)


class HFEngine:
    def __init__(self, model_path: str, dtype: str = "float32", trust_remote_code: bool = False,
                 batch_size: int = 64, tempered_logprobs: bool = False, max_model_len: Optional[int] = None,
                 **_ignored_vllm_options):
        """`tempered_logprobs`: report log-probs of softmax(logits / temperature), else of the raw logits."""
        from transformers import AutoModelForCausalLM

        from common.dtypes import DTYPES
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        renderer = PromptRenderer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._setup(model.eval().to(device), renderer.eos_id, renderer.pad_id, batch_size, tempered_logprobs)
        self.model_path, self.trust_remote_code, self._renderer = model_path, trust_remote_code, renderer
        self.kept.max_model_len = max_model_len

    @classmethod
    def from_model(cls, model, eos_id: int, pad_id: int, batch_size: int = 64) -> "HFEngine":
        """Wrap a model that lives elsewhere in this process (e.g. the trainer's, for evaluation)."""
        engine = cls.__new__(cls)
        engine._setup(model, eos_id, pad_id, batch_size)
        return engine

    def _setup(self, model, eos_id: int, pad_id: int, batch_size: int, tempered_logprobs: bool = False) -> None:
        self.model, self.eos_id, self.pad_id, self.batch_size = model, eos_id, pad_id, batch_size
        self._sync_group, self.model_path, self.trust_remote_code, self._renderer = None, None, False, None
        self.tempered_logprobs = tempered_logprobs
        self.counts = Counts()
        self.kept = RegeneratedRequests(self, self.counts)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | str | list[dict]], sampling: SamplingConfig) -> list[Sample]:
        """`prompts`: token-id lists, or text / message-list prompts rendered by the project's PromptRenderer (not
        with `from_model`, which has no tokenizer)."""
        prompts, stops = render_prompts(self, prompts, sampling)
        sampling = replace(sampling, stop_token_ids=stops)
        was_training = self.model.training
        self.model.eval()
        gen = torch.Generator()
        if sampling.seed is None:
            gen.seed()  # nondeterministic
        else:
            gen.manual_seed(sampling.seed)
        expanded = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        out = []
        for start in range(0, len(expanded), self.batch_size):
            out += self._generate_batch(expanded[start:start + self.batch_size], sampling, gen)
        self.model.train(was_training)
        self.counts.prefill += sum(len(p) for _, p in expanded)
        self.counts.generated += sum(len(x.completion_ids) for x in out)
        return out

    def _generate_batch(self, items, sampling: SamplingConfig, gen: torch.Generator) -> list[Sample]:
        width = max(len(p) for _, p in items)
        # Left-pad so every row's next token sits in the last column.
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for _, p in items], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p in items], device=self.model.device)
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        greedy = sampling.temperature == 0
        processors = [TemperatureLogitsWarper(sampling.temperature)] if not greedy else []
        record = _TokenLogprobs()
        processors.insert(len(processors) if self.tempered_logprobs else 0, record)
        if not greedy and sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        # Neutral settings stated outright, as vLLM's explicit sampling params are: otherwise transformers fills
        # them from the checkpoint's generation_config (a top_k of 50, a repetition penalty).
        res = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(sampling.budget(i) for i, _ in items),
            do_sample=not greedy,
            temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, logits_processor=LogitsProcessorList(
                processors), eos_token_id=[self.eos_id, *sampling.stop_token_ids], pad_token_id=self.pad_id,
            return_dict_in_generate=True)
        new = res.sequences[:, width:]
        logps = record.finish(new).cpu()
        new = new.cpu()
        samples, stops = [], {self.eos_id, *sampling.stop_token_ids}
        for row, (index, prompt) in enumerate(items):
            toks = new[row].tolist()[:sampling.budget(index)]  # rows with a smaller budget are cut to it
            ends = [j for j, t in enumerate(toks) if t in stops]
            stop = bool(ends)
            length = ends[0] + 1 if stop else len(toks)
            samples.append(Sample(index, prompt, toks[:length], logps[row, :length].numpy().copy(),
                                  "stop" if stop else "length"))
        return samples

    def counters(self) -> tuple[int, int]:
        """(prompt tokens computed, tokens generated) since the engine started: every context in full (no cache)."""
        return self.counts.prefill, self.counts.generated

    def weights_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def advance(self, new: list[Request], sampling: SamplingConfig, steps: int) -> Advanced:
        """In-flight generation (rollout.engines.inflight): the kept requests' contexts are recomputed each call."""
        return self.kept.advance(new, sampling, steps)

    def abort(self, keys: list[int]) -> None:
        self.kept.abort(keys)

    def update_weights(self, named_tensors) -> int:
        """Copy each (name, tensor) into the model as it arrives (an iterator is never held whole). Returns #tensors."""
        from common.checkpoint_format import checkpoint_slots, write
        count = 0
        with torch.no_grad():
            slots = checkpoint_slots(self.model)  # (a mixture of experts' fused parameters: each expert's part)
            for name, tensor in named_tensors:
                write(slots[name], tensor)
                count += 1
        return count

    def open_receiver(self, endpoint: dict) -> None:
        """Join the trainer -> engines channel (rollout.sync.setup_sync)."""
        from rollout.sync import WeightReceiver
        self._receiver = WeightReceiver(endpoint)

    def receive_weights(self, fingerprint: bool = True) -> int:
        """One sync over that channel, copied in as it arrives. Returns #tensors."""
        return self.update_weights(self._receiver.receive(fingerprint))

    def sync_fingerprints(self) -> dict:
        """What reached the model in the last sync, fingerprinted (with verification on; rollout.sync.check)."""
        return self._receiver.fingerprints

    def sleep(self) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def shutdown(self) -> None:
        pass
