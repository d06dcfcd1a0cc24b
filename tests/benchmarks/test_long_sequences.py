"""benchmarks/long_sequences.py's pieces that decide where a split step runs and what its table says."""
from types import SimpleNamespace

import torch

from benchmarks.long_sequences import planned, rank_env
from rlhf.config import TrainerConfig


def test_a_split_step_puts_each_rank_on_a_gpu_of_its_own_only_where_there_is_one_for_each(monkeypatch):
    env = {"OMP_NUM_THREADS": "1"}
    for gpus, rank, ranks, want in [(0, 1, 2, None), (1, 1, 2, None), (2, 1, 2, "1"), (2, 0, 2, "0"), (2, 0, 1, None)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        got = rank_env(env, rank, ranks)
        assert got.get("CUDA_VISIBLE_DEVICES") == want and got["OMP_NUM_THREADS"] == "1", (gpus, rank, ranks)
    assert "CUDA_VISIBLE_DEVICES" not in env  # (the parent's environment is left as it was)
    assert rank_env({"CUDA_VISIBLE_DEVICES": "4,5"}, 1, 2)["CUDA_VISIBLE_DEVICES"] == "5"  # the parent's GPUs


def test_the_table_says_the_micro_batches_as_the_trainer_cuts_them():
    batch = {"attention_mask": torch.ones(16, 2112, dtype=torch.long)}
    tr = TrainerConfig(batch_size=16, micro_batch_size=16)
    plan = SimpleNamespace
    assert planned(None, tr, batch) == "16 rows"
    assert planned(plan(tokens=None, checkpointing=False), tr, batch) == "16 rows"
    # a budget of 7 rows needs 3 micro-batches, which the trainer evens out: not 7+7+2
    assert planned(plan(tokens=7 * 2112, checkpointing=True), tr, batch) == "6+6+4 rows gc"
    assert planned(plan(tokens=21 * 2112, checkpointing=True), tr, batch) == "16 rows gc"  # (a budget past the rows)
    assert planned(None, TrainerConfig(batch_size=16, micro_batch_size=16, gradient_checkpointing=True,
                                       max_tokens_per_micro_batch=8 * 2112), batch) == "8+8 rows gc"
    one = {"attention_mask": torch.ones(1, 2112, dtype=torch.long)}
    assert planned(None, TrainerConfig(batch_size=1, micro_batch_size=1), one) == "1 row"
