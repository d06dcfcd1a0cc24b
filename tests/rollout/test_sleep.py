"""The engines' sleep/wake bookkeeping across rollout rounds, syncs and evaluations (GPU colocation; vLLM on CPU
has no sleep mode, so the state machine the engine consults is tested on its own)."""
import pytest

from rollout.engines.sleep import SleepState


def test_full_sync_round_trip_at_level_2():
    s = SleepState(enabled=True, level=2)
    s.check_can_generate()  # fresh: everything resident
    assert s.sleep() == 2 and s.sleep() is None  # released once, not twice
    with pytest.raises(RuntimeError, match="sleeping engine"):
        s.check_can_generate()
    assert s.wake(["weights"]) == ["weights"] and s.wake(["weights"]) is None
    s.loaded_weights()  # the sync overwrote every discarded weight
    assert s.wake(["kv_cache"]) == ["kv_cache"]
    s.check_can_generate()


def test_level_2_weights_must_be_synced_before_generating():
    s = SleepState(enabled=True, level=2)
    s.sleep()
    assert s.wake() == ["weights", "kv_cache"]
    with pytest.raises(RuntimeError, match="without a weight sync"):
        s.check_can_generate()


def test_a_second_rollout_round_wakes_what_the_first_put_to_sleep():
    """Dynamic sampling generates several rounds; waking only the KV cache after a full sleep would leave the
    weights released, and vLLM would then wait forever for them."""
    s = SleepState(enabled=True, level=1)
    s.sleep()
    s.wake(["kv_cache"])
    with pytest.raises(RuntimeError, match="weights released"):
        s.check_can_generate()
    assert s.wake() == ["weights"]  # level 1 keeps a host copy: waking restores the weights
    s.check_can_generate()


def test_disabled_sleep_is_a_no_op():
    s = SleepState(enabled=False, level=2)
    assert s.sleep() is None and s.wake() is None
    s.check_can_generate()
    with pytest.raises(ValueError, match="level"):
        SleepState(enabled=True, level=3)
