"""benchmarks/gpu_plan.py, the paper plan for 7B-72B: the rules it applies give the layouts docs/gpus.md quotes."""
from benchmarks.gpu_plan import GIB, MODELS, engine_split, plan, trainer_gib


def test_the_engine_split_grows_with_the_model_and_divides_the_heads():
    gpu = 80 * GIB
    assert [engine_split(m, gpu) for m in MODELS] == [1, 2, 4]
    assert all(m.heads % engine_split(m, gpu) == 0 for m in MODELS)


def test_splitting_the_sequence_or_offloading_is_chosen_only_where_the_update_would_not_fit():
    seven, _, seventy_two = MODELS
    row = plan(seven, 8, 8192, 80 * GIB)
    assert row[3:8] == ["colocate", 1, 8, 1, "no"]  # 7B on one node: nothing split, nothing offloaded
    assert trainer_gib(seventy_two, 32, 32768, 2, False) < trainer_gib(seventy_two, 32, 32768, 1, False)
    assert plan(seventy_two, 8, 8192, 80 * GIB)[6] == "none fits"  # 72B full fine-tuning on 4 trainer GPUs
