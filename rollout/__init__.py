"""rollout: generation engines (vLLM, transformers), weight sync channels and reward functions."""
