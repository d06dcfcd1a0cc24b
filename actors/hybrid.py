"""`HybridWorker`: a policy trainer rank and its rollout engine in one process (`placement.mode: hybrid`, verl's
"hybrid engine"). Each rank starts one process instead of two, so torch, transformers and the model load once per
rank, and a weight sync hands the trainer's tensors to the engine by reference (`rollout.sync`'s `local` channel):
no staging buffer, no copy besides the engine's own load.

The engine class is an argument, so this module knows no engine: `rlhf.rl.startup` passes `VLLMEngine` (in-process
engine core) or `HFEngine`. Two ranks' vLLM engines each see the trainers' two-rank process group and take it as
two independent replicas (vLLM's external data parallelism); they start together, as the ranks do."""
from __future__ import annotations

from typing import Optional

from actors.policy import PolicyTrainer
from rollout.sync.buckets import TensorSpec


class HybridWorker(PolicyTrainer):
    """A policy rank (a `PolicyTrainer`, whose calls it answers as its own) with its rollout engine in the same
    actor, which answers the engine calls a `RolloutGroup` makes too (generate, counters, load_adapter, sleep,
    wake_up, process_ids, shutdown). Ray runs one call at a time per actor: the phases take turns, as they do when
    they share a GPU."""

    def __init__(self, model_path: str, tr, engine_cls: type, engine_kwargs: dict, **trainer_kwargs):
        super().__init__(model_path, tr, **trainer_kwargs)
        self.engine = engine_cls(model_path, **engine_kwargs)

    # ---- the engine's side ----
    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)

    def counters(self) -> tuple[int, int]:
        return self.engine.counters()

    def load_adapter(self, files: dict[str, bytes]) -> None:
        self.engine.load_adapter(files)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.engine.wake_up(tags)

    def process_ids(self) -> list[int]:
        return self.engine.process_ids()

    def weights_dtype(self) -> str:
        return self.engine.weights_dtype()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- the sync: this rank's engine is in this process ----
    def open_sender(self, channel: str, host: str, port: int, plan: list[list[TensorSpec]], world_size: int = 0,
                    engines: Optional[list[int]] = None, verify: bool = False, local_engine=None) -> dict:
        if channel != "local":
            raise ValueError(f"a hybrid worker syncs its own engine in-process (channel 'local'), not {channel!r}")
        return super().open_sender("local", host, port, plan, verify=verify, local_engine=self.engine)

