"""What the one-process stages (sft, dpo, rm) set up alike: the model folder and its renderer, and for sft and dpo
the policy trainer with a generation engine on the trainer's own weights (evaluation generates with it)."""
from __future__ import annotations

from rlhf.config import RunConfig
from rlhf.stages.data import make_renderer
from rlhf.weights.tiny import ensure_model
from rollout.render import PromptRenderer


def model_and_renderer(cfg: RunConfig) -> tuple[str, PromptRenderer]:
    """`model.path`, or the tiny kit's model built into the output folder; and the renderer of its tokenizer."""
    model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
    return model_path, make_renderer(cfg, model_path)


def policy_and_engine(cfg: RunConfig, model_path: str, renderer: PromptRenderer):
    """(PolicyTrainer, HFEngine sharing its module): one copy of the weights for training and evaluation."""
    from actors.policy import PolicyTrainer
    from rollout.engines.hf import HFEngine
    trainer = PolicyTrainer(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                            trust_remote_code=cfg.model.trust_remote_code, lora=cfg.model.lora)
    return trainer, HFEngine.from_model(trainer.model, renderer.eos_id, renderer.pad_id)
