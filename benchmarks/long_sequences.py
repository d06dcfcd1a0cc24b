"""Long completions: memory and seconds of one GRPO train step and one reference pass as completions grow, with
the log-probs from full logits against trainer.chunked_logprobs (actors.logits.DeferredHead), in one run.

    python benchmarks/long_sequences.py [--models tiny-152k,smollm2] [--lengths 256,1024,4096,8192] [--group 8]
                                        [--cap-gib 12] [--paths full,chunked,chunked+gc] [--repeats 1]
    python benchmarks/long_sequences.py --models tiny-152k,qwen --lengths 2048,8192,16384 --group 1
                                        --paths chunked+gc,chunked+gc+sp2      # sequence parallelism, SP=1 vs 2

One group of `--group` completions of each length after one 64-token prompt (`--groups` of them), in one
micro-batch (as a user with micro_batch_size = the rows would run it), bf16 weights (trainer.precision bf16-true).
`--lengths 32 --group 4 --groups 4 --paths full+shared,chunked+shared` is the real-model recipe's micro-batch.
`tiny-152k` is the tiny Qwen2 with Qwen2.5's vocabulary (151,936 rows: the head dominates); `smollm2`, `qwen` and
`gemma` the real SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct and Gemma-3-270M (python -m rlhf.models). Each
measurement runs in a process of its own; its peak extra memory is the growth of the process's peak RSS over what
it held after loading (CPU; on a GPU `max_memory_allocated`). A process that grows past --cap-gib is stopped and
reported as such, so the sweep cannot take the machine down.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.helpers import print_table  # noqa: E402
from common.remote import python_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = 64
REAL = {"smollm2": "smollm2-135m-instruct", "qwen": "qwen2.5-coder-0.5b-instruct", "gemma": "gemma-3-270m"}


def model_dir(name: str) -> str:
    """A local folder for `name`: the tiny Qwen2 with a 151,936-row vocabulary (made once under the cache), or a
    provisioned real model (REAL)."""
    if name in REAL:
        from rlhf import models
        return models.provision(REAL[name])
    from transformers import AutoModelForCausalLM

    from rlhf.config import TinyModelConfig
    from rlhf.weights.tiny import save_tiny_model
    out = os.path.join(ROOT, ".cache", "long_sequences", "tiny-152k")
    if not os.path.isfile(os.path.join(out, "config.json")):
        save_tiny_model(TinyModelConfig(max_position_embeddings=32768), out)
        model = AutoModelForCausalLM.from_pretrained(out)
        model.resize_token_embeddings(151936, mean_resizing=False)  # new rows random: Qwen2.5's head
        model.save_pretrained(out)
    return out


def group_batch(vocab: int, completion: int, group: int, groups: int = 1):
    """`groups` prompts of PROMPT tokens, each with `group` completions of `completion` tokens."""
    import torch

    from common.batch import pack_sequences
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (PROMPT,), generator=g).tolist() for _ in range(groups)]
    completions = [torch.randint(10, vocab, (completion,), generator=g).tolist() for _ in range(group * groups)]
    batch = pack_sequences([p for p in prompts for _ in range(group)], completions, pad_id=0)
    batch["advantages"] = torch.randn(group * groups, 1, generator=g) * batch["loss_mask"]
    return batch


class Peak:
    """Peak memory growth over a block: the peak RSS (VmHWM, reset at entry) or the GPU's max allocated."""

    def __enter__(self):
        import torch
        self.gpu = torch.cuda.is_available()
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = self._status("VmRSS")
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch
        self.seconds = time.perf_counter() - self.start
        self.top = torch.cuda.max_memory_allocated() if self.gpu else self._status("VmHWM")
        self.extra = self.top - self.base

    @staticmethod
    def _status(key: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)


def peaks(call, repeats: int) -> list[Peak]:
    """`call()` `repeats` times, each under its own Peak."""
    out = []
    for _ in range(repeats):
        with Peak() as peak:
            call()
        out.append(peak)
    return out


def split_of(path: str) -> int:
    """trainer.sequence_parallel_size of a path (+spN), 1 without."""
    found = re.search(r"\+sp(\d+)", path)
    return int(found[1]) if found else 1


def planned(planner, tr, batch) -> str:
    """The micro-batches the step ran, as their rows (`6+6+4 rows`), cut as the trainer cuts them (a token budget:
    the plan's, trainer.plan_memory, or trainer.max_tokens_per_micro_batch), and `gc` where it checkpointed."""
    from actors.batching.packing import micro_batches_needed, token_budget_groups
    lengths = batch["attention_mask"].sum(1).tolist()
    budget = planner.tokens if planner is not None and planner.tokens is not None else tr.max_tokens_per_micro_batch
    sizes = ([len(g) for g in token_budget_groups(lengths, micro_batches_needed(lengths, budget))] if budget
             else [min(tr.micro_batch_size, len(lengths))])
    gc = tr.gradient_checkpointing or (planner is not None and planner.checkpointing)
    return "+".join(map(str, sizes)) + f" row{'s' * (sum(sizes) != 1)}" + (" gc" if gc else "")


def measure_one(model: str, completion: int, group: int, path: str, groups: int = 1, repeats: int = 1,
                rank: int = 0, port: int = 0) -> dict:
    """In this process: `repeats` rl_steps and reference passes of the group; the median seconds and the largest
    peak extra bytes of each (the first call pays one-time costs, so a speed needs repeats > 1). Under +spN this is
    rank `rank` of N processes that split each sequence (the group on `port`); the reference, one process in a
    run, is not measured there."""
    import statistics

    from actors.policy import PolicyTrainer
    from actors.reference import ReferenceModel
    from rlhf.config import AlgorithmConfig, TrainerConfig

    folder = model_dir(model)
    chunked = path.startswith("chunked")
    rows = group * groups
    budget = re.search(r"\+mb(\d+)", path)  # trainer.max_tokens_per_micro_batch: the step in smaller micro-batches
    limit = re.search(r"\+lim([\d.]+)", path)  # trainer.memory_limit_gb (+plan: the default, a quarter of the node)
    tr = TrainerConfig(lr=1e-5, batch_size=rows, micro_batch_size=rows, warmup_steps=0,
                       chunked_logprobs=chunked, gradient_checkpointing="+gc" in path,
                       shared_prefix="+shared" in path, max_tokens_per_micro_batch=budget and int(budget[1]),
                       plan_memory="+plan" in path, memory_limit_gb=limit and float(limit[1]),
                       world_size=split_of(path),
                       sequence_parallel_size=split_of(path))
    trainer = PolicyTrainer(folder, tr, dtype="bfloat16", rank=rank, world_size=split_of(path),
                            master_port=port or None)
    batch = group_batch(trainer.model.config.vocab_size, completion, group, groups)
    steps = peaks(functools.partial(trainer.rl_step, batch, AlgorithmConfig()), repeats)
    plan = planned(trainer.ds.planner, tr, batch)
    del trainer
    if split_of(path) > 1:
        return dict(plan=plan, step_s=statistics.median(p.seconds for p in steps),
                    step_gib=max(p.extra for p in steps) / 2**30, step_total_gib=max(p.top for p in steps) / 2**30,
                    ref_s=float("nan"), ref_gib=float("nan"))
    reference = ReferenceModel(folder, "bfloat16", micro_batch_size=rows, chunked_logprobs=chunked,
                               max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch)
    refs = peaks(functools.partial(reference.compute_logprobs, batch), repeats)
    return dict(plan=plan, step_s=statistics.median(p.seconds for p in steps),
                step_gib=max(p.extra for p in steps) / 2**30, step_total_gib=max(p.top for p in steps) / 2**30,
                ref_s=statistics.median(p.seconds for p in refs), ref_gib=max(p.extra for p in refs) / 2**30)


def rank_env(env: dict, rank: int, ranks: int) -> dict:
    """Rank `rank` of a split step on a GPU of its own where the machine has one for each rank (NCCL refuses two ranks
    on one GPU); on CPU the environment as it is."""
    import torch
    if not 1 < ranks <= torch.cuda.device_count():
        return env
    seen = env.get("CUDA_VISIBLE_DEVICES")  # (a parent limited to some GPUs: the rank's is the rank-th of those)
    return dict(env, CUDA_VISIBLE_DEVICES=seen.split(",")[rank] if seen else str(rank))


def run_one(model: str, completion: int, group: int, path: str, cap: float, groups: int = 1,
            repeats: int = 1) -> dict:
    """`measure_one` in a child process (one per rank under +spN, the machine's cores shared between them), each
    stopped if its RSS passes `cap` GiB; a split step reports its slowest and largest rank."""
    import psutil

    from common.net import free_port
    ranks, port = split_of(path), free_port()
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), OMP_NUM_THREADS=threads)
    procs = [subprocess.Popen([sys.executable, "-c", "import json; from benchmarks.long_sequences import measure_one; "
                               f"print('ROW ' + json.dumps(measure_one({model!r}, {completion}, {group}, {path!r}, "
                               f"{groups}, {repeats}, {rank}, {port})))"], cwd=ROOT, env=rank_env(env, rank, ranks),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    over = False
    while any(p.poll() is None for p in procs) and not over:
        for p in procs:
            try:
                over = over or psutil.Process(p.pid).memory_info().rss > cap * 2**30
            except psutil.Error:
                pass
        time.sleep(0.2)
    for p in procs:
        if over:
            p.kill()
    got = [p.communicate() for p in procs]
    rows = [[line for line in out.splitlines() if line.startswith("ROW ")] for out, _ in got]
    if over or any(p.returncode != 0 for p in procs) or not all(rows):
        err = next((e for p, (_, e) in zip(procs, got) if p.returncode != 0), got[0][1])
        return dict(failed=f"over {cap:g} GiB" if over else f"exit {procs[0].returncode}: {err.strip()[-300:]}")
    each = [json.loads(r[-1][4:]) for r in rows]
    return {k: max(r[k] for r in each) for k in each[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-152k,smollm2")
    p.add_argument("--lengths", default="256,1024,4096,8192")
    p.add_argument("--paths", default="full,chunked,chunked+gc",
                   help="full logits (before), chunked_logprobs, + trainer.gradient_checkpointing (+gc), + "
                        "trainer.shared_prefix (+shared), + trainer.max_tokens_per_micro_batch N (+mbN), + "
                        "trainer.plan_memory (+plan; off otherwise, so a path means what it always did), + "
                        "trainer.memory_limit_gb N (+limN, with +plan), + "
                        "trainer.sequence_parallel_size N (+spN: N processes, one rank each, sharing the cores)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--groups", type=int, default=1, help="prompts in the micro-batch, each with --group completions")
    p.add_argument("--cap-gib", type=float, default=12.0)
    p.add_argument("--repeats", type=int, default=1, help="steps and reference passes each; seconds are medians")
    a = p.parse_args()
    table = []
    for model in a.models.split(","):
        for length in [int(x) for x in a.lengths.split(",")]:
            got = {path: run_one(model, length, a.group, path, a.cap_gib, a.groups, a.repeats)
                   for path in a.paths.split(",")}
            for path, r in got.items():
                print(json.dumps(dict(model=model, completion=length, path=path, **r)), flush=True)
                base = next(iter(got.values()))  # the first path is the baseline (today's: full)
                if "failed" in r:
                    table.append([model, length, path, "-", r["failed"], "", "", "", "", ""])
                    continue
                ratio = (f"{r['step_s'] / base['step_s']:.2f} / {r['step_gib'] / max(base['step_gib'], 1e-9):.2f}"
                         if "step_s" in base else "-")
                table.append([model, length, path, r.get("plan", "-"), r["step_s"], r["step_gib"],
                              r["step_total_gib"], r["ref_s"], r["ref_gib"], ratio])
    print_table(["model", "completion tokens", "log-probs", "micro-batches", "train step s", "step peak extra GiB",
                 "trainer process peak GiB", "reference s",
                 "reference peak extra GiB", "step s / GiB vs the first"], table)


if __name__ == "__main__":
    main()
