"""`DSModel`: one model in a DeepSpeed engine (ZeRO 0-3, fp32/bf16, gradient accumulation, clipping, warm-up LR)
with the micro-batched optimizer step every trainable role shares. PolicyTrainer, Critic and RewardModel each hold
one (composition, not inheritance)."""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Callable, Optional

import torch

from actors.batching.microbatch import budget_grouped, length_grouped, map_grouped, map_pieces
from actors.batching.packing import micro_batches_needed, pack_rows, unpack_rows
from actors.batching.prefix_sharing import (PrefixPlan, forward_cost, gather_rows, group_unit, layer_masks,
                                            mask_align, plan_prefixes, share_prefixes)
from actors.dist import init_deepspeed_distributed
from actors.ds_config import deepspeed_config, make_optimizer, warmup_lambda
from actors.ds_guards import restricted_checkpoint_engine, stage0_grad_norm, suppressed_update, zero3_loading
from actors.logits import DeferredHead, HeadOutput, keep_kwargs, takes_logits_to_keep
from actors.memory_plan import MemoryPlanner, enable_checkpointing, return_freed_memory
from actors.moe import RouterTap
from actors.precision import fresh_adam, master_state_dict, start_masters
from actors.sequence_parallel import SequenceParallel, loss_scale, sequence_groups
from common import spans
from common.batch import Batch, attention_inputs, first_target, split_batch
from common.dtypes import autocast
from common.flops import ModelShape, backward_flops, forward_parts, model_shape
from common.schema import TrainerConfig, precision_of

LossFn = Callable[[Batch, object, float], tuple[torch.Tensor, dict]]  # (micro-batch, model output, normalizer)


def save_tokenizer(source: str, out_dir: str, trust_remote_code: bool) -> None:
    """`source`'s tokenizer into the model folder `out_dir`."""
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(out_dir)


class PackedOutput:
    """A packed forward's output as the losses read it: `.logits` (B, W, ...) in the padded layout."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class DSModel:
    def __init__(self, build: Callable[[], torch.nn.Module], tr: TrainerConfig, dtype: str, rank: int,
                 world_size: int, master_addr: str, master_port: Optional[int], seed: int, per_token: bool = True,
                 checkpoint: Optional[str] = None, defer_head: bool = False):
        """`build()` makes the model after the process group exists and the seed is set (heads init the same), its
        weights in `weights_dtype(self.precision)`. `per_token`: the model's output has one entry per token (a
        causal LM, a value head), so trainer.packing applies; a sequence classifier's does not. `checkpoint`: the
        folder `build` loaded, whose fp32 values the fp32 masters of a 16-bit "true" precision start from.
        `defer_head`: the causal LM's log-probs come from its hidden states, a chunk at a time (actors.logits)."""
        import deepspeed

        init_deepspeed_distributed(rank, world_size, master_addr, master_port)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.cfg = rank, world_size, tr
        self.data_parallel = world_size // tr.sequence_parallel_size  # the ranks with rows of their own
        self.precision = precision_of(tr.precision, dtype)
        self.packing = tr.packing and per_token
        self.shared_prefix = tr.shared_prefix and per_token
        config = deepspeed_config(tr, dtype, world_size)
        # trainer.sequence_parallel_size: DeepSpeed's sequence and data groups, before the model (ZeRO-3 partitions
        # it over both) and the engine (which reduces gradients over both)
        mpu = sequence_groups(tr.sequence_parallel_size)
        with zero3_loading(config):
            model = build()
        if tr.gradient_checkpointing:
            enable_checkpointing(model)
        self.trims_logits = takes_logits_to_keep(model)  # logits only from a micro-batch's first trained token
        # the shared-prefix mask: additive, in the dtype attention computes in (one tensor every layer uses as it
        # is; a bool mask would be converted, and kept for the backward, by every layer)
        self.mask_dtype = {"bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16,
                           "fp16-true": torch.float16}.get(self.precision, torch.float32)
        self.cost = forward_cost(model, self.mask_dtype) if self.shared_prefix else None
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only
        optimizer = make_optimizer(trainable, tr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(tr.warmup_steps))
        self._optimizer, self._scheduler = optimizer, scheduler  # the torch objects DeepSpeed wraps
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=config, mpu=mpu)
        self.engine.checkpoint_engine = restricted_checkpoint_engine(self.engine._config)
        # LoRA: the frozen base is the model folder, built again at every start, so checkpoints leave it out
        # (a full copy of a 7B base in each one, for an adapter of a few MB)
        self.frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        if self.frozen:
            self.engine.module_state_dict = self._trained_state
        self.device, self.offloaded = self.engine.device, False
        self.engine.train()  # from_pretrained leaves eval mode, in which gradient checkpointing is off
        fresh_adam(optimizer)
        self.head = DeferredHead.attach(self.module, defer_head, self.precision, self.device)
        self.split = SequenceParallel.attach(self.module, tr.sequence_parallel_size, per_token)
        self.loss_scale = loss_scale(tr.zero_stage, tr.sequence_parallel_size)
        self.trims_logits = self.trims_logits and self.split is None  # (a split forward returns every position)
        self.planner = MemoryPlanner.attach(self.module, tr, self.precision, self.device, world_size, rank)
        self.routers = RouterTap.attach(self.module, tr.router_aux_loss_coef)  # (a mixture of experts)
        self.has_masters = self.precision in ("bf16-true", "fp16-true")
        self.shape: Optional[ModelShape] | bool = False  # (common.flops: made when spans are first recorded)
        self.trainable = 1.0  # (the share of weights that train: a LoRA backward computes only theirs)
        spans.matmul_dtype = str(self.mask_dtype).removeprefix("torch.")  # (the CPU's peak is probed in it)
        if self.has_masters and checkpoint is not None:
            start_masters(self.engine.optimizer, self.module, checkpoint)

    def plan_preview(self, tokens: int) -> Optional[str]:
        """trainer.plan_memory's choice for micro-batches of rows `tokens` long (None: planning is off)."""
        cfg = self.cfg
        return None if self.planner is None else \
            self.planner.preview(tokens, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def offload(self) -> None:
        """Free this rank's accelerator memory while other roles run (trainer.offload, GPU colocation): parameters,
        fp32 master weights, gradients and optimizer states move to CPU (DeepSpeed's offload_states, ZeRO 1-3).
        Whatever touches the model next brings them back first (`resident`)."""
        if not self.offloaded:
            self.engine.offload_states(pin_memory=torch.cuda.is_available())
            self.offloaded = True

    def resident(self) -> None:
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False

    def __call__(self, mb: Batch):
        """The model's output on a micro-batch; packed (trainer.packing), its logits come back in the padded
        layout, so every loss reads them the same way. Padded, a causal LM returns the logits from the micro-batch's
        first trained position on (actors.logits: the losses align them by their width). With a deferred head
        (trainer.chunked_logprobs) a `HeadOutput`: the hidden states in that layout, the log-prob functions apply
        the head."""
        self.resident()
        routing = nullcontext()
        if self.routers is not None:
            self.routers.use_routes(mb.get("routes"))  # (algorithm.routing_replay)
            routing = self.routers.recording()
        with autocast(self.precision, self.device), routing:
            if self.head is None:
                return self._forward(mb)
            with self.head.deferring():
                return HeadOutput(self._forward(mb).logits, self.head)

    def _forward(self, mb: Batch):
        if self.split is not None:  # trainer.sequence_parallel_size: this rank's tokens, the output gathered
            ids, positions = self.split.shard(mb)
            with self._split_attention():
                out = self.engine(input_ids=ids, position_ids=positions, use_cache=False)
            return PackedOutput(self.split.gather(out.logits, mb["input_ids"].shape[1]))
        if self.shared_prefix and "loss_mask" in mb and "position_ids" not in mb:  # (rows of several sequences)
            plan = plan_prefixes(*(mb[k].cpu() for k in ("input_ids", "attention_mask", "loss_mask")),
                                 align=mask_align(self.device))
            if self.cost.sharing_pays(plan):
                return self._shared_forward(mb, plan)  # else (long continuations, a group of one) the padded one
        if not self.packing:
            return self.engine(input_ids=mb["input_ids"], **attention_inputs(mb), **keep_kwargs(mb, self.trims_logits))
        ids, positions, where = pack_rows(mb["input_ids"], mb["attention_mask"], mb.get("position_ids"))
        out = self.engine(input_ids=ids, position_ids=positions, use_cache=False)  # a cache turns off the restarts
        return PackedOutput(unpack_rows(out.logits, where, *mb["input_ids"].shape))

    def flops(self, mb: Batch) -> tuple[float, float]:
        """(forward, backward) FLOPs of this micro-batch on this rank (common.flops; 0 while nothing records); the
        head at trained positions where the model skips the others (deferred, or trimmed and unpacked)."""
        if not spans.recording():
            return 0.0, 0.0
        if self.shape is False:
            sizes = [(n, getattr(p, "ds_numel", p.numel()), p.requires_grad) for n, p in self.module.named_parameters()]
            self.shape = model_shape(getattr(self.module, "config", None), [(n, k) for n, k, _ in sizes], 0.0, 0)
            self.trainable = sum(k for _, k, t in sizes if t) / max(sum(k for _, k, _ in sizes), 1)
        trims = (self.head is not None or (self.trims_logits and not self.packing)) and "loss_mask" in mb
        matmul, attention = forward_parts(self.shape, mb["attention_mask"].sum(1).tolist(),
                                          logits=mb["loss_mask"].sum(1).tolist() if trims else None)
        share = self.cfg.sequence_parallel_size  # (each rank of a sequence-parallel group computes its share)
        return (matmul + attention) / share, backward_flops(matmul, attention, self.trainable) / share

    def _split_attention(self):
        return self.split.active() if self.split is not None else nullcontext()

    def _shared_forward(self, mb: Batch, plan: PrefixPlan) -> PackedOutput:
        """trainer.shared_prefix: rows with the same prompt as one row, the prompt computed once
        (actors/batching/prefix_sharing.py); the output comes back in the padded layout from the first trained position
        on."""
        layout = share_prefixes(mb["input_ids"].cpu(), plan)
        start = first_target(mb["loss_mask"]) if self.trims_logits else 0
        mask = layer_masks(layout, getattr(self.module, "config", None), self.mask_dtype, self.device)
        keep = {"logits_to_keep": layout.width - start} if self.trims_logits else {}
        out = self.engine(input_ids=layout.input_ids.to(self.device), position_ids=layout.position_ids.to(self.device),
                          attention_mask=mask, use_cache=False, **keep)
        return PackedOutput(gather_rows(out.logits, layout, start))

    def _unit(self, batch: Batch, unit: int, size: Optional[int]) -> int:
        """Rows a micro-batch keeps together: `unit`, or under shared_prefix a whole group of rows sharing a prompt
        (where micro-batches of `size` rows, if fixed, hold whole groups), so each prompt is computed once."""
        if not self.shared_prefix or unit != 1 or "loss_mask" not in batch:
            return unit
        g = group_unit(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        return g if (size is None or size % g == 0) and len(batch["input_ids"]) % g == 0 else 1

    def on_device(self, mb: Batch) -> Batch:
        """Batches travel on CPU (Ray, the driver); each micro-batch moves to the model's device to be used."""
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    @torch.no_grad()
    def inference(self, batch: Batch, fn: Callable[[Batch, object], torch.Tensor]) -> torch.Tensor:
        """fn(micro-batch, model output) without gradients over length-grouped micro-batches; per-row results come
        back in the batch's row order, on CPU, padded to the batch's width ((b, w-1) -> (B, L-1))."""
        self.engine.eval()

        def run(mb: Batch) -> torch.Tensor:
            with spans.span("forward", self.device, flops=self.flops(mb)[0], grad=False):
                mb = self.on_device(mb)
                return fn(mb, self(mb)).cpu()
        size = self.cfg.micro_batch_size
        if self.cfg.max_tokens_per_micro_batch is None:
            out = map_grouped(batch, size, run, self._unit(batch, 1, size))
        else:  # by the same token budget as the update's micro-batches
            out = map_pieces(batch, self._budget_groups(batch, self._unit(batch, 1, None),
                                                        self.cfg.max_tokens_per_micro_batch), run)
        self.engine.train()
        return out

    def train_epochs(self, batch: Batch, epochs: int, loss_fn: LossFn, agg: str) -> dict[str, float]:
        """`epochs` passes over this rank's rows in mini-batches of trainer.batch_size (over all ranks), one
        optimizer step each. The first epoch keeps the rollout's order (a prompt's samples stay in one mini-batch,
        so its group-relative advantages meet in one update); every later epoch reshuffles the rows into new
        mini-batches (global torch RNG: restored by a checkpoint), so no epoch repeats the previous one's steps.
        Returns metrics averaged over steps (`train/skipped_updates`: summed)."""
        n_mini = len(batch["input_ids"]) * self.data_parallel // self.cfg.batch_size
        history: dict[str, list[float]] = {}
        for epoch in range(epochs):
            order = torch.randperm(len(batch["input_ids"])) if epoch > 0 and n_mini > 1 else None
            for mini in split_batch(batch if order is None else {k: v[order] for k, v in batch.items()}, n_mini):
                for k, v in self.optimizer_step(mini, loss_fn, agg).items():
                    history.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in history.items()}
        out["train/skipped_updates"] = float(sum(history["train/skipped_updates"]))
        return out

    def optimizer_step(self, mini: Batch, loss_fn: LossFn, agg: str, unit: int = 1) -> dict[str, float]:
        """One update (`_optimizer_step`), a span in the worker's timeline (common.spans)."""
        with spans.span("update", self.device):
            return self._optimizer_step(mini, loss_fn, agg, unit)

    def _optimizer_step(self, mini: Batch, loss_fn: LossFn, agg: str, unit: int = 1) -> dict[str, float]:
        """Forward/backward over length-grouped micro-batches of `mini` (common.batch.length_grouped: rows in
        `unit`s), then one optimizer step.

        Each micro-batch loss is divided by the *global* count (tokens for token-mean, else sequences) times the
        world size, since DeepSpeed averages gradients over ranks: the update equals the loss over the whole
        mini-batch however it is split across micro-batches and ranks.

        A NaN/Inf loss on any micro-batch of any rank, or a NaN/Inf gradient norm, skips the update on every rank
        (weights, optimizer moments and LR schedule unchanged) and reports `train/skipped_updates` = 1.
        """
        count = mini["loss_mask"].sum() if agg == "token-mean" else torch.tensor(len(mini["input_ids"]))
        normalizer = self.all_reduce_sum(count.float()).item() / self.world_size
        micro_batches, rows = [mb for _, mb in self._micro_batches(mini, unit)], len(mini["input_ids"])
        loss_sum, grad_norm, sums, weight, bad = 0.0, None, {}, 0.0, torch.zeros(())
        skipped_before = self.engine.skipped_steps
        for i, mb in enumerate(micro_batches):
            # the last micro-batch is the boundary, however many there are (token budgets vary the count)
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            flops, back = self.flops(mb)  # (common.spans: what the trace and perf/train_mfu count)
            mb = self.on_device(mb)
            with spans.span("forward", self.device, flops=flops):
                loss, m = loss_fn(mb, self(mb), normalizer)
            if self.routers is not None:
                loss, routed = self.routers.add_aux_loss(loss, mb.get("attention_mask"), len(mb["input_ids"]) / rows)
                m = {**m, **routed}
            bad += float(not torch.isfinite(loss.detach()).all())
            with self._split_attention(), spans.span("backward", self.device, flops=back):
                self.engine.backward(loss * self.loss_scale, scale_wrt_gas=False)
            if self.device.type == "cpu" and i < len(micro_batches) - 1:
                return_freed_memory()  # the next micro-batch's activations then reuse these pages, not new ones
            skip = False
            if i == len(micro_batches) - 1:  # the boundary: decide together, before any rank steps
                grad_norm = stage0_grad_norm(self.module) if self.cfg.zero_stage == 0 else None
                bad += float(grad_norm is not None and not math.isfinite(grad_norm))
                skip = self.all_reduce_sum(bad).item() > 0
            with suppressed_update(self._optimizer, self._scheduler, skip), \
                    spans.span("optimizer", self.device) if i == len(micro_batches) - 1 else nullcontext():
                self.engine.step()
            loss_sum += loss.item() / self.world_size
            # RL metrics are token means (clip fraction, entropy); preference metrics ("seq-mean") are pair means
            w = float(len(mb["input_ids"])) if agg == "seq-mean" else float(mb["loss_mask"].sum())
            weight += w
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
        metrics = self._global_means(sums, weight)
        skipped = skip or self.engine.skipped_steps > skipped_before  # ZeRO 1-3 also skip inf/NaN grads
        metrics["loss"] = self.all_reduce_sum(torch.tensor(loss_sum)).item()
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        metrics["train/grad_norm"] = float(grad_norm if grad_norm is not None else "nan")
        metrics["train/lr"] = self.engine.get_lr()[0]
        metrics["train/skipped_updates"] = float(skipped)
        if self.routers is not None:
            metrics.update(self._global_agreement())
        return {**metrics, **(self.planner.metrics() if self.planner is not None else {})}

    def _global_agreement(self) -> dict:
        """moe/router_agreement over every rank's tokens (each rank reduces, with or without routes)."""
        same, seen = self.routers.agree
        self.routers.agree = [0, 0]
        total = self.all_reduce_sum(torch.tensor([float(same), float(seen)]))  # (one host read of the device sums)
        return {"moe/router_agreement": float(total[0] / total[1])} if total[1] > 0 else {}

    def _micro_batches(self, mini: Batch, unit: int) -> list[tuple[torch.Tensor, Batch]]:
        """`mini` in micro-batches of trainer.micro_batch_size rows, or under trainer.max_tokens_per_micro_batch as
        many as the padded-token budget needs: the most any rank needs (ZeRO's collectives run once per micro-batch,
        so every rank runs as many), at most as many as the fewest rows any rank has."""
        rows, gas = len(mini["input_ids"]), self.engine.gradient_accumulation_steps()
        budget = self.cfg.max_tokens_per_micro_batch
        if self.planner is not None:  # trainer.plan_memory: fewer rows a micro-batch where they would not fit
            budget = self.planner.budget(mini["attention_mask"].sum(1).tolist(), max(1, rows // gas), budget,
                                         self.all_reduce_max)
        if budget is None:
            if rows % gas:
                raise ValueError(f"cannot split {rows} rows into {gas} equal micro-batches")
            return length_grouped(mini, rows // gas, self._unit(mini, unit, rows // gas))
        return self._budget_groups(mini, self._unit(mini, unit, None), budget)

    def _budget_groups(self, rows: Batch, unit: int, budget: int) -> list[tuple[torch.Tensor, Batch]]:
        """Micro-batches under a padded-token budget, as many on this rank as on the rank that needs most (ZeRO's
        collectives run once per forward), at most as many as the fewest units any rank has."""
        lengths = rows["attention_mask"].sum(1).view(-1, unit).max(1).values.tolist()  # per unit (a DPO pair)
        need = torch.tensor([micro_batches_needed(lengths, budget // unit), -len(lengths)], dtype=torch.float64)
        need = self.all_reduce_max(need)
        return budget_grouped(rows, budget, unit, count=int(min(need[0].item(), -need[1].item())))

    def _global_means(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """Each micro-batch metric (a mean over its tokens, or pairs) as one mean over every rank's micro-batches,
        weighted by what it averaged: the value the whole mini-batch would give, on every rank."""
        keys = sorted(sums)
        total = self.all_reduce_sum(torch.tensor([sums[k] for k in keys] + [weight], dtype=torch.float64))
        return {k: (total[i] / total[-1].clamp(min=1e-12)).item() for i, k in enumerate(keys)}

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, returned on CPU (NCCL reduces device tensors only)."""
        return self._all_reduce(x, "SUM")

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, "MAX")

    def _all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size == 1:
            return x.cpu()
        x = x.to(self.device)
        torch.distributed.all_reduce(x, op=getattr(torch.distributed.ReduceOp, op))
        return x.cpu()

    def save_checkpoint(self, path: str, tag: str) -> None:
        """Model, optimizer, scheduler and this rank's RNG (collective: every rank calls it)."""
        self.resident()
        self.engine.save_checkpoint(path, tag=tag, client_state={"torch_rng": torch.get_rng_state()},
                                    exclude_frozen_parameters=bool(self.frozen))

    def load_checkpoint(self, path: str, tag: str) -> None:
        self.resident()
        _, client = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True,
                                                custom_load_fn=self._load_trained if self.frozen else None)
        if client and "torch_rng" in client:
            torch.set_rng_state(client["torch_rng"])

    def _trained_state(self, *args, exclude_frozen_parameters: bool = False, **kwargs) -> dict:
        """DeepSpeed's module state, less every frozen tensor when asked: DeepSpeed's own exclusion misses a tied
        head's second name, an embedding-sized copy in every LoRA checkpoint of a tied model."""
        state = type(self.engine).module_state_dict(self.engine, *args, **kwargs)
        for name in self.frozen if exclude_frozen_parameters else ():
            state.pop(name, None)
        return state

    def _load_trained(self, src: dict, dst: torch.nn.Module) -> None:
        """A checkpoint's module state without the frozen base into `dst`: strict about everything else, so a
        checkpoint of another model still fails to load."""
        result = dst.load_state_dict(src, strict=False)
        missing = sorted(set(result.missing_keys) - self.frozen)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"the checkpoint's module state does not fit this model: missing {missing[:4]}, "
                               f"unexpected {sorted(result.unexpected_keys)[:4]}")

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None, trust_remote_code: bool = False) -> None:
        """Save the full model as a Hugging Face folder (safetensors), plus the tokenizer from `tokenizer_path`
        (one with its own code loads only under `trust_remote_code`, model.trust_remote_code). Rank 0 writes; under
        ZeRO-3 every rank must call this (the gather is collective)."""
        self.resident()
        if self.cfg.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:  # a 16-bit "true" precision saves its fp32 masters: what training accumulated below 16-bit steps
            state = (master_state_dict(self.engine.optimizer, self.module, keep=self.rank == 0)
                     if self.has_masters else None)
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            self.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer_path is not None:
                save_tokenizer(tokenizer_path, out_dir, trust_remote_code)
