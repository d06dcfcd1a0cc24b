"""The `sft` stage: supervised fine-tuning on prompt/answer rows or whole conversations, evaluated with greedy
decoding, saved as a Hugging Face folder (`<output_dir>/final`) that a later stage's `model.path` can point to."""
from __future__ import annotations

from common.batch import Batch, pack_masked
from rlhf.config import RunConfig
from rlhf.stages.data import BatchIterator, prompt_rows
from rlhf.stages.loop import answer_metric, run_loop
from rlhf.stages.setup import model_and_renderer, policy_and_engine
from rollout.episodes import evaluate_completions
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
    # Inputs first: a bad data file or reward function fails in seconds, before any model is built or loaded.
    reward_fn = reward_fn_for(cfg.reward, cfg.data.task)
    batches = BatchIterator(prompt_rows(cfg.data, "train", cfg.seed, need_answer=True), cfg.trainer.batch_size,
                            cfg.seed)
    eval_rows = prompt_rows(cfg.data, "eval", cfg.seed)
    model_path, renderer = model_and_renderer(cfg)
    trainer, engine = policy_and_engine(cfg, model_path, renderer)

    def step(_: int) -> dict:
        return trainer.sft_step(tokenize_sft(renderer, batches.next()))

    def evaluate():
        return evaluate_completions(engine, renderer, eval_rows, reward_fn, cfg.eval, cfg.seed)
    return run_loop(cfg, step, evaluate,
                    answer_metric(cfg), trainer, batches, model_path)[1]
