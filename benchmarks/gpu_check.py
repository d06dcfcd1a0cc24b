"""The GPU checks of the rollout and actors issues, as one command: DeepSpeed ZeRO-2 and ZeRO-3 SFT steps of a
0.5B-shaped model (tokens/s, MFU, peak memory, the cache left behind for vLLM's wake, trainer.offload's cost and
what it frees; ZeRO-3's offload goes through DeepSpeed's FusedAdam, built here), and the ipc channel (CUDA
IPC) between a trainer actor and an engine actor sharing one GPU (seconds, GB/s, bit-exact arrival, the largest
staging bucket and how many tensors were cut to fit it), the same for a hybrid rank (placement.mode=hybrid: the
engine in the trainer's process, weights by reference), then the GPU-review rules that need a CUDA runtime (an
actor asking no GPU sees none; the NCCL sync group builds with its timeout).

    python benchmarks/gpu_check.py [--size 0.5B] [--dtype bfloat16] [--seq 1024] [--steps 6] [--out DIR]

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab 151936, tied), randomly
initialised. The same script runs on CPU (`--size 1M --dtype float32 --seq 64`) to check itself. The engine is the
transformers one: vLLM's CUDA wheel cannot be carried to the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import SIZES, median_time, print_table  # noqa: E402
from common.remote import python_path  # noqa: E402
from rlhf.config import TinyModelConfig, TrainerConfig  # noqa: E402

SHAPES = {"0.5B": (TinyModelConfig(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                   intermediate_size=4864, max_position_embeddings=4096), 151936),
          "1M": (SIZES["1M"], None)}
H200_BF16_TFLOPS = 989.0  # dense


def build_shape(size: str, root: str) -> str:
    """Save the shaped model (random init) with the kit's tokenizer; token ids above its vocab are never produced."""
    from rlhf.weights.tiny import build_model, train_tokenizer
    path = os.path.join(root, f"shape-{size}")
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg, vocab = SHAPES[size]
        tok = train_tokenizer()
        model = build_model(cfg, vocab or len(tok), tok.eos_token_id, tok.pad_token_id)
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
    return path


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TrainBench:
    """One DeepSpeed rank on its own process (a Ray actor), so its peak memory is its own."""

    def __init__(self, path: str, stage: int, dtype: str, batch: int, micro: int):
        from actors.policy import PolicyTrainer
        import torch
        # ZeRO-3 offloads with DeepSpeed's FusedAdam only: built here by nvcc, its class checked at the first
        # offload (review 2, findings 1 and 2)
        tr = TrainerConfig(lr=1e-6, batch_size=batch, micro_batch_size=micro, warmup_steps=0, zero_stage=stage,
                           offload=torch.cuda.is_available())
        self.trainer, self.stage = PolicyTrainer(path, tr, dtype=dtype), stage

    def run(self, seq: int, steps: int, vocab: int) -> dict:
        import torch
        ds = self.trainer.ds
        n = sum(getattr(p, "ds_numel", p.numel()) for p in ds.module.parameters())
        rows = ds.cfg.batch_size
        batch = {"input_ids": torch.randint(0, vocab, (rows, seq)),
                 "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                 "loss_mask": torch.ones(rows, seq - 1, dtype=torch.bool)}
        times = []
        for _ in range(steps):
            _sync()
            start = time.perf_counter()
            self.trainer.train_step(batch)  # as the controller calls it (its cache released afterwards)
            _sync()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[1:])  # the first step pays for allocations
        out = {"zero": self.stage, "params_M": n / 1e6, "step_s": step_s, "tokens_per_s": rows * seq / step_s,
               "tflops": 6 * n * rows * seq / step_s / 1e12}
        if torch.cuda.is_available():
            out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            # what vLLM's wake would find taken but unused in this process (review 2, finding 4)
            out["cached_free_GiB"] = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**30
            out.update(self._offload_cost())
        return out

    def _offload_cost(self) -> dict:
        import torch
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        self.trainer.offload()
        _sync()
        off_s, after = time.perf_counter() - start, torch.cuda.memory_allocated()
        start = time.perf_counter()
        self.trainer.ds.resident()
        _sync()
        return {"offload_s": off_s, "reload_s": time.perf_counter() - start, "freed_GiB": (before - after) / 2**30}


def train_rows(path: str, args, vocab: int, gpu: dict) -> list[dict]:
    import ray

    from common.remote import make_actor, ray_get
    rows = []
    for stage in (2, 3):
        bench = make_actor(TrainBench, f"zero-{stage}", gpu, path, stage, args.dtype, args.batch, args.micro)
        try:
            rows.append(ray_get([bench.run.remote(args.seq, args.steps, vocab)], 1800, [f"zero-{stage}"])[0])
        except Exception as e:  # noqa: BLE001 - a crash on this path is the finding the row reports
            rows.append({"zero": stage, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
        ray.kill(bench)
    return rows


def _param_sum(engine_self) -> float:
    return float(sum(p.double().sum().item() for _, p in engine_self.model.named_parameters(remove_duplicate=False)))


def time_sync_then_compare(trainers, group, specs, micro: int, engine_actor, engine_sum) -> tuple[int, float, bool]:
    """Over a channel already set up: payload bytes, the median seconds of 5 syncs, and whether the engine holds
    exactly the trainer's weights after one more update and sync (`engine_sum` runs in `engine_actor`)."""
    import torch

    from common.remote import ray_get
    from rollout.sync import sync_weights

    sync_weights(trainers.actors, group)
    seconds = median_time(lambda: sync_weights(trainers.actors, group), 5)
    ids = torch.randint(0, 100, (micro, 32))
    trainers.train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                         "loss_mask": torch.ones(micro, 31, dtype=torch.bool)})
    sync_weights(trainers.actors, group)
    want = float(sum(t.double().sum().item() for _, t in trainers.export_weights()))
    got = ray_get([engine_actor.__ray_call__.remote(engine_sum)], 600, ["the engine's host"])[0]
    return sum(s.nbytes for s in specs), seconds, got == want


def ipc_row(path: str, args) -> dict:
    """Trainer rank and engine colocated on one GPU bundle (Ray fractional GPUs), weights over CUDA IPC."""
    import torch

    from actors.group import ActorGroup
    from actors.policy import PolicyTrainer
    from rlhf.rl.placement import Placement
    from rollout.engines.hf import HFEngine
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync
    from rollout.sync.buckets import bucket_nbytes, plan_buckets

    placement = Placement("colocate", 1 if torch.cuda.is_available() else 0, {"policy": 1, "rollout": 1})
    tr = TrainerConfig(lr=1e-3, batch_size=args.micro, micro_batch_size=args.micro, warmup_steps=0, zero_stage=2)
    trainers = ActorGroup(PolicyTrainer, "policy trainer", 1, placement.options["policy"], model_path=path, tr=tr,
                          dtype=args.dtype)
    group = RolloutGroup.create(1, dict(model_path=path, dtype=args.dtype), placement.options["rollout"],
                                engine_cls=HFEngine)
    try:
        specs = trainers.weight_specs()
        plan = plan_buckets(specs, args.bucket_mb << 20)
        setup_sync("ipc", trainers.actors, group, plan)
        sent, seconds, equal = time_sync_then_compare(trainers, group, specs, args.micro, group.engines[0], _param_sum)
        return {"channel": "ipc", "MiB": sent / 2**20, "buckets": len(plan),
                "max_bucket_MiB": max(bucket_nbytes(b) for b in plan) / 2**20,
                "cut_tensors": len({s.name for b in plan for s in b if s.part}), "sync_s": seconds,
                "GB_per_s": sent / seconds / 1e9, "engine_weights_equal": equal}
    finally:
        group.shutdown()
        trainers.kill()
        placement.remove()


def _hybrid_param_sum(worker_self) -> float:
    return _param_sum(worker_self.engine)


def hybrid_row(path: str, args) -> dict:
    """placement.mode=hybrid: the engine inside the trainer rank's process, weights handed over by reference."""
    import torch

    from actors.group import ActorGroup
    from actors.hybrid import HybridWorker
    from rlhf.rl.placement import Placement
    from rollout.engines.hf import HFEngine
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync
    from rollout.sync.buckets import plan_buckets

    placement = Placement("hybrid", 1 if torch.cuda.is_available() else 0, {"policy": 1})
    tr = TrainerConfig(lr=1e-3, batch_size=args.micro, micro_batch_size=args.micro, warmup_steps=0, zero_stage=2)
    ranks = ActorGroup(HybridWorker, "policy trainer", 1, placement.options["policy"], model_path=path, tr=tr,
                       dtype=args.dtype, engine_cls=HFEngine, engine_kwargs={"dtype": args.dtype})
    group = RolloutGroup(ranks.actors, in_trainers=True)
    try:
        specs = ranks.weight_specs()
        setup_sync("local", ranks.actors, group, plan_buckets(specs, args.bucket_mb << 20))
        sent, seconds, equal = time_sync_then_compare(ranks, group, specs, args.micro, ranks.actors[0],
                                                      _hybrid_param_sum)
        return {"channel": "local (hybrid)", "MiB": sent / 2**20, "sync_s": seconds, "GB_per_s": sent / seconds / 1e9,
                "engine_weights_equal": equal}
    finally:
        ranks.kill()
        placement.remove()


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count()


def _nccl_sync_group(timeout_s: float) -> bool:
    """A one-rank NCCL sync group built with its timeout (review finding 14) broadcasts a bucket."""
    import torch

    from common.net import free_port
    from rollout.sync.broadcast import SyncGroup
    group = SyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=timeout_s)
    buf = torch.arange(8, dtype=torch.uint8, device=group.device or "cpu")
    group.broadcast(buf)
    return group.device is not None and buf.sum().item() == 28


def rule_rows(gpu: dict) -> list[dict]:
    """Review findings whose rule needs a real CUDA runtime: each row is one check and what it found."""
    import ray

    from common.remote import make_actor, ray_get
    rows = []
    hidden = make_actor(_Probe, "no-GPU probe", {})
    rows.append({"finding": "3: an actor asking no GPU sees none",
                 "ok": ray_get([hidden.visible_gpus.remote()], 300, ["no-GPU probe"])[0] == 0})
    from rlhf.rl.preflight import fused_adam_problem
    problem = fused_adam_problem()
    rows.append({"finding": f"review 2, 2: FusedAdam buildable ({problem or 'nvcc and ninja found'})",
                 "ok": problem is None})
    with_gpu = make_actor(_Probe, "GPU probe", gpu)
    rows.append({"finding": "14: NCCL sync group with timeout_s",
                 "ok": ray_get([with_gpu.nccl_sync_group.remote(60.0)], 300, ["GPU probe"])[0]})
    for actor in (hidden, with_gpu):
        ray.kill(actor)
    return rows


def reap_row(path: str) -> dict:
    """Issue 41: a multiprocess vLLM engine killed with -9 leaves its engine core holding GPU memory; Ray restarts
    the actor, whose start ends the orphan (rollout.engines.reap) and must then allocate its own share."""
    import signal

    import psutil
    import ray

    from common.remote import make_actor
    from rollout.engines.vllm import VLLMEngine
    row = {"finding": "41: a killed engine's core reaped, the restart allocates"}
    engine = make_actor(VLLMEngine, "rollout engine 0", {"num_gpus": 1, "max_restarts": 1, "max_task_retries": -1},
                        path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.6, multiprocess=True)
    try:
        host, *cores = ray.get(engine.process_ids.remote(), timeout=300)
        os.kill(host, signal.SIGKILL)
        start = time.monotonic()
        while True:
            try:
                again = ray.get(engine.process_ids.remote(), timeout=300)
                break
            except Exception:  # noqa: BLE001 - unavailable while Ray restarts it
                if time.monotonic() - start > 300:
                    raise
                time.sleep(1)
        left = [p for p in cores if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        row.update(ok=not left and again[0] != host, restart_s=round(time.monotonic() - start, 1),
                   orphans_left=len(left))
    except Exception as e:  # noqa: BLE001 - the row reports it; the other rows stand
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    finally:
        ray.kill(engine)
    return row


class _Probe:
    def visible_gpus(self) -> int:
        return _visible_gpus()

    def nccl_sync_group(self, timeout_s: float) -> bool:
        try:
            return _nccl_sync_group(timeout_s)
        except Exception as e:  # noqa: BLE001 - the row reports it
            print(f"nccl sync group: {type(e).__name__}: {e}", flush=True)
            return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5B", choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bucket-mb", type=int, default=64)  # rollout.sync_bucket_mb's default
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    import ray
    import torch

    gpus = torch.cuda.device_count()
    # workers see the driver's PYTHONPATH too (packages installed with pip --target), and their logs reach ours: a
    # worker that cannot start says why instead of leaving the check waiting
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False,
             log_to_driver=True, runtime_env={"env_vars": {"PYTHONPATH": python_path(os.getcwd())}})
    report = Report(args, gpus)
    path = build_shape(args.size, os.path.join(args.out, "models"))
    vocab = SHAPES[args.size][1] or 100
    report.train(train_rows(path, args, vocab, {"num_gpus": 1} if gpus else {}))
    report.table("sync", guarded(ipc_row, path, args))
    report.table("hybrid", guarded(hybrid_row, path, args))
    report.rules(rule_rows({"num_gpus": 1} if gpus else {}))
    if gpus:  # last: a vLLM restart is the slowest check, and the device may have no vLLM at all
        report.rules([reap_row(path) if _has_vllm() else {"finding": "41: a killed engine's core reaped",
                                                          "ok": "skipped", "detail": "vLLM is not installed here"}])
    ray.shutdown()


def guarded(row, *args) -> dict:
    """A row, or what stopped it: one failure does not cost the others."""
    try:
        return row(*args)
    except Exception as e:  # noqa: BLE001 - the row reports it
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _has_vllm() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


class Report:
    """Each part's table printed, and gpu_check.json rewritten, as soon as the part is done: a check cut short by
    its time limit still leaves every row it finished."""

    def __init__(self, args, gpus: int):
        import torch
        self.args, self.gpus = args, gpus
        self.data = {"args": vars(args), "device": torch.cuda.get_device_name() if gpus else "cpu", "rules": []}

    def train(self, rows: list[dict]) -> None:
        a = self.args
        for r in rows:
            r["MFU"] = r["tflops"] / a.peak_tflops if self.gpus and "tflops" in r else float("nan")
        keys = ["zero", "params_M", "step_s", "tokens_per_s", "tflops", "MFU", "peak_GiB", "cached_free_GiB",
                "offload_s", "reload_s", "freed_GiB", "error"]
        print(f"{a.size}-shaped, {a.dtype}, batch {a.batch} x {a.seq} tokens, micro-batch {a.micro}, "
              f"median of {a.steps - 1} steps:")
        print_table(keys, [[r.get(k, "-") for k in keys] for r in rows])
        self._save("train", rows)

    def table(self, name: str, row: dict) -> None:
        print_table(list(row), [list(row.values())])
        self._save(name, row)

    def rules(self, rows: list[dict]) -> None:
        detail = [r.get("detail") or {k: v for k, v in r.items() if k not in ("finding", "ok")} or "-" for r in rows]
        print_table(["finding", "ok", "detail"], [[r["finding"], r["ok"], d] for r, d in zip(rows, detail)])
        self._save("rules", self.data["rules"] + rows)

    def _save(self, key: str, value) -> None:
        self.data[key] = value
        with open(os.path.join(self.args.out, "gpu_check.json"), "w") as f:
            json.dump(self.data, f, indent=1)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
