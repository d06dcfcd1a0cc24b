"""On paper, past this machine: the layout this project would use for Qwen2.5-7B, 32B and 72B and the mixtures of
experts Qwen3-30B-A3B and Qwen3-235B-A22B on 8, 16 and 64 H100s
at 8k and 32k-token completions, and the per-GPU memory and weight-sync time that implies. A cost model, not a
measurement: every constant is below, and docs/gpus.md says where it could be wrong.

    python benchmarks/gpu_plan.py [--gpu-gib 80] [--lengths 8192,32768] [--gpus 8,16,64]

The rules are the ones the run itself applies: an engine's tensor-parallel size N is the smallest power of two whose
share of the bf16 weights leaves most of the engine's memory share to the KV cache (N divides the heads); with N = 1
the roles share every GPU (placement.mode=colocate, the sync by CUDA IPC), with N > 1 the engines take half the GPUs
(split, the sync by an NCCL broadcast). The trainers use ZeRO-3 over their GPUs with bf16 weights and fp32 masters
and moments (16 bytes a parameter), optimizer offload where that does not fit, and the smallest sequence-parallel
size P whose activations fit, from actors/memory_plan.py's estimate (flash attention: linear in the length; one row
of the completion's length a micro-batch, gradient checkpointing on). A mixture of experts is held whole on every
side, as this project holds it (tensor parallelism cuts each expert; no expert parallelism): its memory and sync
count every expert, its activations the top_k experts a token goes through.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.memory_plan import Shape  # noqa: E402
from benchmarks.helpers import print_table  # noqa: E402

GIB = 2**30
ENGINE_SHARE = 0.5  # colocated engines' gpu_memory_utilization (rollout.gpu_memory_utilization's default beside a
SPLIT_SHARE = 0.9   # trainer), and under split
WEIGHTS_AT_MOST = 0.5  # of an engine's share: the rest is KV cache
NVLINK_GBS, IB_GBS, IPC_GBS = 150.0, 40.0, 600.0  # NCCL broadcast in a node, across nodes; a device-to-device copy
HEAD_WORKSET = 0.75 * GIB  # the deferred head's chunks: fp32 logits, their softmax and gradient (256 MiB budget)
CONTEXT = 2.0 * GIB  # CUDA context, NCCL buffers, vLLM's graphs while asleep


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden / heads (Qwen3 sets its own)
    experts: int = 0  # a mixture of experts: experts a layer, each `intermediate` wide, `top_k` a token
    top_k: int = 0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_params(self) -> float:
        attention = 2 * self.hidden * self.heads * self.dim + 2 * self.hidden * self.kv_heads * self.dim
        return attention + 3 * self.hidden * self.intermediate * max(1, self.experts)

    def active_width(self) -> int:
        """The MLP width one token's activations see: the dense width, or top_k experts' widths."""
        return self.intermediate * (self.top_k or 1)

    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.dim * 2  # K and V, bf16


# the published config.json of each checkpoint
MODELS = [Model("Qwen2.5-7B", 7.62e9, 28, 3584, 18944, 28, 4, 152064),
          Model("Qwen2.5-32B", 32.8e9, 64, 5120, 27648, 40, 8, 152064),
          Model("Qwen2.5-72B", 72.7e9, 80, 8192, 29568, 64, 8, 152064),
          Model("Qwen3-30B-A3B", 30.5e9, 48, 2048, 768, 32, 4, 151936, head_dim=128, experts=128, top_k=8),
          Model("Qwen3-235B-A22B", 235e9, 94, 4096, 1536, 64, 4, 151936, head_dim=128, experts=128, top_k=8)]


def engine_split(m: Model, gpu: float) -> int:
    """The smallest tensor-parallel size whose weight share fits WEIGHTS_AT_MOST of an engine's share."""
    n = 1
    while 2 * m.params / n > WEIGHTS_AT_MOST * (ENGINE_SHARE if n == 1 else SPLIT_SHARE) * gpu or m.heads % n:
        n *= 2
    return n


def trainer_gib(m: Model, ranks: int, tokens: int, split: int, offload: bool) -> float:
    """One trainer GPU's peak in the update: states (16 bytes a parameter over the ranks; offloaded: the bf16 weights
    and gradients, 4), two gathered layers, the head's working set and the activations of one row."""
    states = m.params * (4 if offload else 16) / ranks
    gathered = 2 * m.layer_params() * 2
    shape = Shape(m.layers, m.hidden, m.active_width(), m.heads, act_bytes=2, quadratic=False, split=split)
    return (states + gathered + HEAD_WORKSET + CONTEXT + shape.row_bytes(tokens, checkpointing=True)) / GIB


def plan(m: Model, gpus: int, tokens: int, gpu: float) -> list:
    n = engine_split(m, gpu)
    trainers = gpus if n == 1 else gpus // 2
    engines = gpus // n if n == 1 else (gpus // 2) // n
    for offload in (False, True):
        split = 1
        while split <= trainers and (m.heads % split or trainer_gib(m, trainers, tokens, split, offload) > 0.9 *
                                     gpu / GIB):
            split *= 2
        if split <= trainers:
            break
    fits = split <= trainers
    train = trainer_gib(m, trainers, tokens, min(split, trainers), offload)
    share = (ENGINE_SHARE if n == 1 else SPLIT_SHARE) * gpu
    kv_tokens = (share * n - 2 * m.params) / m.kv_bytes_per_token()
    sync_bw = IPC_GBS if n == 1 else (NVLINK_GBS if gpus <= 8 else IB_GBS)  # the send
    gather_bw = NVLINK_GBS if trainers <= 8 else IB_GBS  # ZeRO-3's gather of each tensor before it is sent
    sync_s = 2 * m.params / (sync_bw * 1e9) + 2 * m.params / (gather_bw * 1e9)
    layout = "colocate" if n == 1 else f"split {trainers}+{gpus - trainers}"
    return [m.name, gpus, tokens, layout, n, engines or "none fits", split if fits else "none fits",
            "yes" if offload else "no", f"{train:.1f}", f"{(2 * m.params / n + CONTEXT) / GIB:.1f}", f"{kv_tokens / tokens:.1f}", f"{sync_s:.2f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-gib", type=float, default=80.0)
    p.add_argument("--gpus", default="8,16,64")
    p.add_argument("--lengths", default="8192,32768")
    a = p.parse_args()
    gpu = a.gpu_gib * GIB
    rows = [plan(m, g, t, gpu) for m in MODELS for g in map(int, a.gpus.split(","))
            for t in map(int, a.lengths.split(","))]
    print_table(["model", "GPUs", "completion tokens", "placement", "engine TP", "engines", "trainer SP",
                 "optimizer offload", "trainer GPU peak GiB", "engine weights+context GiB",
                 "KV cache: sequences of that length an engine holds", "weight sync s"], rows)


if __name__ == "__main__":
    main()
