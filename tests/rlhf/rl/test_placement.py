"""Placement: the pure plan, and real Ray placement groups on logical GPUs (colocate shares bundles, split does
not); an unsatisfiable request is a clear error, not a hang."""
import pytest

from common.errors import UserError
from rlhf.config.resolve import reference_ranks, seed_per_prompt
from rlhf.rl.placement import Placement, describe_placement, plan_placement
from rollout.sync import sync_channel


def test_plan_colocate_shares_bundles():
    bundles, plan = plan_placement("colocate", 2, {"policy": 2, "reference": 1, "rollout": 2})
    assert len(bundles) == 2
    assert plan["policy"] == [(0, 0.333), (1, 0.333)] and plan["reference"] == [(0, 0.333)]
    assert sum(frac for slots in plan.values() for b, frac in slots if b == 0) <= 1.0


def test_plan_split_gives_each_role_its_own_bundles():
    bundles, plan = plan_placement("split", 4, {"policy": 2, "rollout": 2})
    assert len(bundles) == 4 and plan == {"policy": [(0, 1.0), (1, 1.0)], "rollout": [(2, 1.0), (3, 1.0)]}


def test_a_tensor_parallel_engine_takes_a_bundle_of_as_many_gpus_as_its_workers():
    bundles, plan = plan_placement("split", 6, {"policy": 2, "rollout": 2}, gpus_per_rank={"rollout": 2})
    assert [b["GPU"] for b in bundles] == [1, 1, 2, 2]
    assert plan == {"policy": [(0, 1.0), (1, 1.0)], "rollout": [(2, 2.0), (3, 2.0)]}
    with pytest.raises(UserError, match=r"6 for 2 policy, 2 rollout x 2 GPUs"):
        plan_placement("split", 5, {"policy": 2, "rollout": 2}, gpus_per_rank={"rollout": 2})
    tp = {"rollout": 2}
    assert describe_placement("split", 6, {"policy": 2, "rollout": 2}, tp, tp) == (
        "placement: split on 6 GPUs: 2 policy x 1 GPU; 2 rollout x 2 GPUs, 2 workers each")
    assert describe_placement("colocate", 0, {"policy": 1, "rollout": 1}, tp, tp) == (
        "placement: CPU only: 1 policy; 1 rollout, 2 workers each")


def test_hybrid_engines_have_no_role_of_their_own():
    """The engines live in the policy ranks: the plan is colocate's without a rollout role, every rank on its GPU."""
    from rlhf.config import RunConfig
    from rlhf.config.resolve import role_ranks
    cfg = RunConfig()
    cfg.placement.mode, cfg.trainer.world_size, cfg.rollout.num_engines = "hybrid", 2, 2
    assert role_ranks(cfg, needs_critic=True) == {"policy": 2, "critic": 2}
    bundles, plan = plan_placement("hybrid", 2, role_ranks(cfg, needs_critic=True))
    assert len(bundles) == 2 and plan == {"policy": [(0, 0.5), (1, 0.5)], "critic": [(0, 0.5), (1, 0.5)]}
    cfg.placement.mode = "colocate"
    assert role_ranks(cfg, needs_critic=False) == {"policy": 2, "rollout": 2}


@pytest.mark.parametrize("mode, gpus, needle", [("colocate", 1, "one GPU per rank of the largest role"),
                                                ("split", 3, "whole GPUs for every rank of every role"),
                                                ("mixed", 4, "must be colocate, hybrid or split")])
def test_plan_errors(mode, gpus, needle):
    with pytest.raises(UserError, match=needle):
        plan_placement(mode, gpus, {"policy": 2, "rollout": 2})


@pytest.mark.parametrize("requested, mode, gpus, engines, ranks, expected", [
    ("auto", "colocate", 0, 2, 1, "ipc"),  # CPU host: shared memory reaches every local engine
    ("auto", "split", 0, 2, 1, "ipc"),
    ("auto", "colocate", 2, 2, 2, "ipc"),  # engine i shares GPU i with trainer rank i
    ("auto", "colocate", 2, 2, 1, "broadcast"),  # engine 1 would be alone on GPU 1
    ("auto", "split", 4, 2, 2, "broadcast"),
    ("broadcast", "colocate", 2, 2, 2, "broadcast"),
    ("ipc", "colocate", 0, 2, 1, "ipc"),
    ("auto", "hybrid", 0, 2, 2, "local"),  # each engine is in its trainer rank's process
    ("auto", "hybrid", 2, 2, 2, "local"),
])
def test_sync_channel_follows_the_placement(requested, mode, gpus, engines, ranks, expected):
    assert sync_channel(requested, mode, gpus, engines, ranks) == expected


class Where:
    def gpu(self):
        import os
        return os.environ.get("CUDA_VISIBLE_DEVICES")  # None when unset


def gpus_by_role(placement, roles):
    from common.remote import make_actor, ray_get
    actors = {r: [make_actor(Where, r, o) for o in placement.options[r]] for r in roles}
    out = {r: ray_get([a.gpu.remote() for a in acts], 60, [r] * len(acts)) for r, acts in actors.items()}
    return out


@pytest.mark.slow
def test_logical_gpu_placement(ray_local):
    ranks = {"policy": 2, "rollout": 2}
    colo = Placement("colocate", 2, ranks)
    placed = gpus_by_role(colo, ranks)
    assert placed["policy"] == placed["rollout"] and len(set(placed["policy"])) == 2
    colo.remove()

    split = Placement("split", 2, {"policy": 1, "rollout": 1})
    placed = gpus_by_role(split, {"policy": 1, "rollout": 1})
    assert placed["policy"] != placed["rollout"]
    split.remove()

    # An actor that asks for no GPU sees none (Ray would leave it every GPU of the host).
    assert gpus_by_role(Placement("colocate", 0, {"reference": 1}), {"reference": 1})["reference"] == [""]

    with pytest.raises(UserError, match="could not be reserved within 2 s; the cluster has 2 GPUs"):
        Placement("split", 4, {"policy": 2, "rollout": 2}, timeout_s=2)


@pytest.mark.parametrize("requested, mode, gpus, world, expected", [
    (None, "colocate", 8, 8, 8),  # one beside each trainer rank: scoring is spread over every GPU
    (None, "hybrid", 4, 4, 4),  # hybrid is colocate with the engines inside the ranks
    (None, "split", 8, 4, 1),  # each copy would take a GPU of its own
    (None, "colocate", 0, 2, 1),  # CPU: one actor (start-up time)
    (2, "split", 8, 4, 2),
])
def test_reference_ranks_scale_with_the_trainer_when_colocated(requested, mode, gpus, world, expected):
    assert reference_ranks(requested, mode, gpus, world) == expected


def test_reference_copies_sit_beside_each_trainer_rank(ray_local):
    ranks = {"policy": 2, "rollout": 2, "reference": reference_ranks(None, "colocate", 2, 2)}
    colo = Placement("colocate", 2, ranks)
    placed = gpus_by_role(colo, ranks)
    assert placed["reference"] == placed["policy"] and len(set(placed["reference"])) == 2
    colo.remove()


def test_per_prompt_seeds_by_default_on_cpu_only():
    assert seed_per_prompt(None, 0) and not seed_per_prompt(None, 8)
    assert seed_per_prompt(True, 8) and not seed_per_prompt(False, 0)


def test_cpu_threads_share_the_cores_among_workers_that_run_at_once(monkeypatch, ray_local):
    from rlhf.config import RunConfig
    from rlhf.config.resolve import busy_at_once, cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = RunConfig()
    assert busy_at_once(cfg, {"policy": 1, "rollout": 1}) == 1  # the phases take turns
    assert busy_at_once(cfg, {"policy": 2, "rollout": 1, "critic": 2}) == 4
    cfg.rollout.max_staleness = 1  # generating ahead: trainers and engines compute at once
    assert busy_at_once(cfg, {"policy": 2, "rollout": 2}) == 4
    assert cpu_threads(None, 1, cores=2) == 2 and cpu_threads(None, 2, cores=2) == 1
    assert cpu_threads(None, 4, cores=2) == 1 and cpu_threads(3, 4, cores=2) == 3  # the config wins
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting wins over the default (tests run two at a time)
    assert cpu_threads(None, 1, cores=16) == 1
    assert Placement("colocate", 0, {"policy": 1})
    assert Placement("colocate", 0, {"policy": 1, "rollout": 1}, threads=2).options["rollout"][0]["env_vars"] == \
        {"OMP_NUM_THREADS": "2"}


def test_a_cpu_run_whose_actors_cannot_all_be_placed_exits_2_at_once(tmp_path, tiny_model_dir):
    """8 trainer ranks and 2 engines ask 5 of the session Ray's 4 CPUs: refused before any actor starts, instead of
    the last ones pending until a deadline blames a collective."""
    import time

    from tests.helpers import run_cli
    start = time.monotonic()
    res = run_cli("--config", "examples/sort_grpo.yaml", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                  "trainer.world_size=8", "trainer.micro_batch_size=4", "rollout.num_engines=2", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "starts 10 actors (8 policy, 2 rollout), 0.5 CPU each in Ray = 5, and the cluster has 4" in res.stderr
    assert time.monotonic() - start < 120
