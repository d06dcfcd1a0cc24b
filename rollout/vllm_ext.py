"""The worker-extension path earlier releases gave vLLM (`worker_extension_cls="rollout.vllm_ext.WeightSyncExtension"`),
kept for engines started outside this project; the code lives in rollout/engines/vllm_ext.py."""
from rollout.engines.vllm_ext import WeightSyncExtension  # noqa: F401
