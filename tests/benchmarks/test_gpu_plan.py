"""benchmarks/gpu_plan.py, the paper plan for 7B-72B and two mixtures of experts: the rules it applies give the layouts
docs/gpus.md quotes."""
import pytest

from benchmarks.gpu_plan import GIB, MODELS, engine_split, plan, trainer_gib


def test_the_engine_split_grows_with_the_model_and_divides_the_heads():
    gpu = 80 * GIB
    assert [engine_split(m, gpu) for m in MODELS] == [1, 2, 4, 2, 16]  # (an MoE's engine holds every expert)
    assert all(m.heads % engine_split(m, gpu) == 0 for m in MODELS)


def test_splitting_the_sequence_or_offloading_is_chosen_only_where_the_update_would_not_fit():
    seven, _, seventy_two, *_ = MODELS
    row = plan(seven, 8, 8192, 80 * GIB)
    assert row[3:8] == ["colocate", 1, 8, 1, "no"]  # 7B on one node: nothing split, nothing offloaded
    assert trainer_gib(seventy_two, 32, 32768, 2, False) < trainer_gib(seventy_two, 32, 32768, 1, False)
    assert plan(seventy_two, 8, 8192, 80 * GIB)[6] == "none fits"  # 72B full fine-tuning on 4 trainer GPUs


def test_a_mixture_of_experts_is_sized_by_all_its_experts_and_trained_with_the_activations_of_its_active_ones():
    dense_32b, a3b, a22b = MODELS[1], MODELS[3], MODELS[4]
    assert a3b.layer_params() * a3b.layers == pytest.approx(a3b.params, rel=0.1)  # every expert counted
    # at 32k tokens a 30B-A3B trainer needs no sequence split where the dense 32B needs 8 (16 GPUs)
    assert plan(a3b, 16, 32768, 80 * GIB)[6] == 1 and plan(dense_32b, 16, 32768, 80 * GIB)[6] == 8
    assert plan(a22b, 8, 8192, 80 * GIB)[5] == "none fits"  # tensor parallelism alone: 16 GPUs an engine
