"""Checking a sync: fingerprints (pure), and a real trainer -> HF engine sync over ipc whose damaged tensor is named."""
import pytest
import torch

from rollout.engines.hf import HFEngine
from rollout.sync.check import first_difference, fingerprint


def test_a_fingerprint_changes_with_any_word_and_with_order():
    t = torch.randn(1000)
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base
    bumped = t.clone()
    bumped[517] = torch.nextafter(bumped[517], torch.tensor(float("inf")))  # one bit
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert fingerprint(bumped) != base and fingerprint(swapped) != base
    assert fingerprint(t.to(torch.bfloat16)) == fingerprint(t.to(torch.bfloat16).clone())
    assert fingerprint(torch.ones(3, dtype=torch.uint8)) != fingerprint(torch.ones(2, dtype=torch.uint8))


def test_first_difference_names_the_first_tensor_in_sending_order():
    sent = {"a": (1, 1), "b": (2, 2), "c": (3, 3)}
    assert first_difference(sent, dict(sent)) is None
    assert first_difference(sent, {"a": (1, 1), "b": (2, 9), "c": (0, 0)}) == "received 'b' with other contents"
    assert first_difference(sent, {"a": (1, 1), "c": (3, 3)}).startswith("never received 'b'")
    assert first_difference(sent, {**sent, "z": (0, 0)}) == "received 'z', which is more"


class DamagingHFEngine(HFEngine):
    """An HF engine whose channel damages one tensor on its way in (after the shared buffer, before the model)."""

    def damage_next_sync(self, name: str) -> None:
        ipc, receive = self._receiver.ipc, self._receiver.ipc.receive

        def damaged(plan):
            for n, t in receive(plan):
                if n == name:
                    t = t.clone()
                    t.view(-1)[0] += 1.0
                yield n, t
        ipc.receive = damaged


@pytest.mark.slow
def test_a_damaged_tensor_stops_the_run_and_is_named(ray_local, tiny_model_dir):
    from actors.policy import PolicyTrainer
    from common.errors import TrainingStopped
    from common.remote import make_actor, ray_get
    from rlhf.config import TrainerConfig
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync, sync_weights
    from rollout.sync.buckets import plan_buckets
    from rollout.sync.check import verify_sync

    trainer = make_actor(PolicyTrainer, "trainer", {}, tiny_model_dir, TrainerConfig(lr=1e-3, warmup_steps=0))
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir), engine_cls=DamagingHFEngine)
    try:
        specs = ray_get([trainer.weight_specs.remote()], 60, ["trainer"])[0]
        setup_sync("ipc", [trainer], group, plan_buckets(specs, bucket_bytes=64 << 10), verify=True)
        sync_weights([trainer], group)
        assert verify_sync([trainer], group, "ipc") == len(specs)  # every tensor, bit for bit
        name = specs[len(specs) // 2].name
        ray_get([group.engines[0].damage_next_sync.remote(name)], 60, ["engine"])
        sync_weights([trainer], group)
        with pytest.raises(TrainingStopped, match=f"rollout engine 0 received '{name}' with other contents than "
                                                  "policy trainer 0 sent"):
            verify_sync([trainer], group, "ipc")
        sync_weights([trainer], group, fingerprint=False)  # a sync verify_sync_every does not check costs nothing
        assert ray_get([trainer.sync_fingerprints.remote(), group.engines[0].sync_fingerprints.remote()], 60,
                       ["trainer", "engine"]) == [{}, {}]
    finally:
        group.shutdown()
        ray_local.kill(trainer)
