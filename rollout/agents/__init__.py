"""Agents: a user's own code played against the rollout's OpenAI-compatible endpoint."""
