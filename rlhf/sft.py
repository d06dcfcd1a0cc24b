"""The `sft` stage: supervised fine-tuning on prompt/answer rows or whole conversations, evaluated with greedy
decoding, saved as a Hugging Face folder (`<output_dir>/final`) that a later stage's `model.path` can point to."""
from __future__ import annotations

from common.batch import Batch, pack_masked
from rlhf.config import RunConfig
from rlhf.data import BatchIterator, make_renderer, prompt_rows
from rlhf.evaluate import evaluate
from rlhf.loop import answer_metric, run_loop
from rlhf.tiny import ensure_model
from rollout.render import PromptRenderer
from rollout.rewards import reward_fn_for


def tokenize_sft(renderer: PromptRenderer, rows: list[dict]) -> Batch:
    """Rows rendered as generation will see them: the prompt's ids (`<bos>`, chat template and generation prompt
    included), then the answer's ids and the token that ends it (eos, or the template's turn close: the model must
    learn to stop), trained on the answer only. A row with `messages` trains on every assistant turn."""
    seqs, targets = [], []
    for r in rows:
        if "messages" in r:
            ids, mask = renderer.conversation_ids(r["messages"])
        else:
            prompt, answer = renderer.prompt_ids(r["prompt"]), renderer.answer_ids(r["prompt"], r["answer"])
            ids, mask = prompt + answer, [False] * len(prompt) + [True] * len(answer)
        seqs.append(ids)
        targets.append(mask)
    return pack_masked(seqs, targets, renderer.pad_id)


def run_sft(cfg: RunConfig) -> dict[str, float]:
    from actors.policy import PolicyTrainer
    from rollout.hf_engine import HFEngine

    # Inputs first: a bad data file or reward function fails in seconds, before any model is built or loaded.
    reward_fn = reward_fn_for(cfg.reward, cfg.data.task)
    batches = BatchIterator(prompt_rows(cfg.data, "train", cfg.seed, need_answer=True), cfg.trainer.batch_size,
                            cfg.seed)
    eval_rows = prompt_rows(cfg.data, "eval", cfg.seed)
    model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
    renderer = make_renderer(cfg, model_path)
    trainer = PolicyTrainer(model_path, cfg.trainer, cfg.model.dtype, seed=cfg.seed,
                            trust_remote_code=cfg.model.trust_remote_code, lora=cfg.model.lora)
    engine = HFEngine.from_model(trainer.model, renderer.eos_id, renderer.pad_id)

    def step(_: int) -> dict:
        return trainer.sft_step(tokenize_sft(renderer, batches.next()))

    return run_loop(cfg, step, lambda: evaluate(engine, renderer, eval_rows, reward_fn, cfg.eval, cfg.seed),
                    answer_metric(cfg), trainer, batches, model_path)[1]
