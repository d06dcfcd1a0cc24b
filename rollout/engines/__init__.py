"""Generation engines behind rollout.engine.RolloutEngine: vLLM and transformers, with what they keep between
weight updates."""
