"""Multi-turn environments played against the engines (the Environment contract is rollout/env.py)."""
