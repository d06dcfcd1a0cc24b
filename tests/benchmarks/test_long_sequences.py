"""benchmarks/long_sequences.py's pieces that decide where a split step runs and what its table says."""
from types import SimpleNamespace

import torch

from benchmarks.long_sequences import planned, rank_env


def test_a_split_step_puts_each_rank_on_a_gpu_of_its_own_only_where_there_is_one_for_each(monkeypatch):
    env = {"OMP_NUM_THREADS": "1"}
    for gpus, rank, ranks, want in [(0, 1, 2, None), (1, 1, 2, None), (2, 1, 2, "1"), (2, 0, 2, "0"), (2, 0, 1, None)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        got = rank_env(env, rank, ranks)
        assert got.get("CUDA_VISIBLE_DEVICES") == want and got["OMP_NUM_THREADS"] == "1", (gpus, rank, ranks)
    assert "CUDA_VISIBLE_DEVICES" not in env  # (the parent's environment is left as it was)


def test_the_table_says_the_micro_batching_the_plan_chose():
    batch = {"input_ids": torch.zeros(16, 2112, dtype=torch.long)}
    assert planned(None, 16, batch) == "16 rows"
    assert planned(SimpleNamespace(tokens=None, checkpointing=False), 16, batch) == "16 rows"
    assert planned(SimpleNamespace(tokens=7 * 2112, checkpointing=True), 16, batch) == "7 rows gc"
    assert planned(SimpleNamespace(tokens=2112, checkpointing=False), 16, batch) == "1 row"
    assert planned(SimpleNamespace(tokens=21 * 2112, checkpointing=True), 16, batch) == "16 rows gc"  # (a budget)
