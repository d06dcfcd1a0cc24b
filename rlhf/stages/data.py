"""Datasets: rows from JSONL, Parquet or a `datasets` folder on disk (with configurable field names), or from a
built-in synthetic task. A malformed row is an error naming the file and line; an empty dataset is an error."""
from __future__ import annotations

import json
import os
from typing import Iterator, Optional

from common.errors import UserError
from rlhf.config import DataConfig
from rlhf.stages import tasks
from rollout.render import PromptRenderer, is_messages


def read_rows(path: str) -> Iterator[tuple[int, object]]:
    """(line or row number, row) pairs from a .jsonl/.json file, a .parquet file, or a datasets folder."""
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file or folder (check data.train_path / data.eval_path)")
    if os.path.isdir(path):
        yield from _datasets_rows(path)
    elif path.endswith((".jsonl", ".json")):
        yield from _jsonl_rows(path)
    elif path.endswith(".parquet"):
        yield from _parquet_rows(path)
    else:
        raise UserError(f"{path}: unknown data format; use .jsonl, .parquet, or a folder written by "
                        "datasets' save_to_disk")


def _jsonl_rows(path: str) -> Iterator[tuple[int, object]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno}: not valid UTF-8; re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); each line must be "
                                "one JSON object") from None


def _parquet_rows(path: str) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: cannot read as Parquet ({e})") from None
    yield from enumerate(table.to_pylist(), start=1)


def _datasets_rows(path: str) -> Iterator[tuple[int, object]]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise UserError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path}: a DatasetDict without a 'train' split (splits: {list(ds)}); save one split")
        ds = ds["train"]
    yield from enumerate(ds, start=1)


# What each of our columns may hold: the check, and how to say what was expected.
_KINDS = {
    "prompt": (lambda v: isinstance(v, str) or is_messages(v), "a string or a list of {role, content} messages"),
    "chosen": (lambda v: isinstance(v, str) or is_messages(v), "a string or a list of assistant messages"),
    "answer": (lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool) or is_messages(v),
               "a string, a number or a list of assistant messages"),
    "messages": (is_messages, "a list of {role, content} messages"),
}
_KINDS["rejected"] = _KINDS["chosen"]


def column(row: dict, key: str):
    """`row[key]`, where a dotted key reaches into nested columns (verl's `reward_model.ground_truth`); a column
    whose own name has a dot wins. KeyError when absent."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def load_records(path: str, fields: dict[str, str], optional: tuple[str, ...] = ()) -> list[dict]:
    """Rows of `path` as dicts keyed by our names. `fields` maps our name -> the file's column (e.g.
    {"prompt": "question"}, or a dotted path into a nested column); our names in `optional` may be missing from a
    row. Prompts, answers, chosen and rejected may be strings or message lists. Other columns are kept as
    metadata (a reward function receives them)."""
    rows = [row for _, row in _records(path, fields, optional)]
    if not rows:
        raise UserError(f"{path}: the dataset is empty; it needs at least one row")
    return rows


def _records(path: str, fields: dict[str, str], optional: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    for where, row in read_rows(path):
        if not isinstance(row, dict):
            raise UserError(f"{path}:{where}: expected a JSON object, got {type(row).__name__}")
        out = {k: v for k, v in row.items() if k not in fields.values()}
        for ours, theirs in fields.items():
            try:
                value = column(row, theirs)
            except KeyError:
                if ours in optional:
                    continue
                raise UserError(f"{path}:{where}: missing field {theirs!r} (has {sorted(row)}); set "
                                f"data.{ours}_key to the column that holds the {ours}") from None
            check, expected = _KINDS[ours]
            if not check(value):
                raise UserError(f"{path}:{where}: field {theirs!r} must be {expected}, got "
                                f"{type(value).__name__} {str(value)[:60]!r}")
            out[ours] = value
        yield where, out


def _path(d: DataConfig, split: str, what: str) -> str:
    path: Optional[str] = d.train_path if split == "train" else d.eval_path
    if path is None:
        raise UserError(f"data.eval_path is unset and data.task is null: set data.eval_path to held-out {what}")
    return path


def prompt_rows(d: DataConfig, split: str, seed: int, need_answer: bool = False,
                need_prompt: bool = True) -> list[dict]:
    """Rows with a `prompt` (a string or messages) and, where the data has one, an `answer` (RL prompt sets need
    none). A row with a conversation in `data.messages_key` and no prompt column gets the conversation before its
    last assistant turn as `prompt` and that turn as `answer`, and keeps `messages` (SFT trains on every assistant
    turn). `need_answer` (SFT) makes a row with a prompt but no answer an error; without `need_prompt`
    (multi-turn: the environment's reset gives the first message) any JSON object is a row."""
    if d.task is not None:
        return tasks.make_rows(d, split, seed)
    path, rows = _path(d, split, "prompts"), []
    fields = {"prompt": d.prompt_key, "answer": d.answer_key, "messages": d.messages_key}
    for where, row in _records(path, fields, optional=("prompt", "answer", "messages")):
        if "prompt" not in row and "messages" in row:
            row = _split_conversation(row, path, where)
        elif "prompt" not in row and need_prompt:
            raise UserError(f"{path}:{where}: missing field {d.prompt_key!r} (has {sorted(row)}); set "
                            f"data.prompt_key to the column that holds the prompt, or data.messages_key to a "
                            "column of conversations")
        elif need_answer and "answer" not in row:
            raise UserError(f"{path}:{where}: missing field {d.answer_key!r}, which SFT trains on; set "
                            "data.answer_key to the column that holds the answer")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: the dataset is empty; it needs at least one row")
    return rows


def _split_conversation(row: dict, path: str, where: int) -> dict:
    messages = row["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    if last == 0:
        raise UserError(f"{path}:{where}: the conversation in 'messages' needs an assistant turn after a user turn")
    return {**row, "prompt": messages[:last], "answer": [messages[last]]}


def preference_rows(d: DataConfig, split: str, seed: int) -> list[dict]:
    """Rows with `prompt`, `chosen` and `rejected` for reward-model and DPO training. Without a prompt column,
    chosen and rejected may be whole conversations (TRL's implicit prompt): their shared first turns are the
    prompt."""
    if d.task is not None:
        return tasks.make_preference_rows(d, split, seed)
    path = _path(d, split, "pairs")
    rows = load_records(path, {"prompt": d.prompt_key, "chosen": d.chosen_key, "rejected": d.rejected_key},
                        optional=("prompt",))
    for where, r in enumerate(rows, start=1):
        if "prompt" not in r:
            r.update(_implicit_prompt(r, path, where, d.prompt_key))
    return rows


def _implicit_prompt(row: dict, path: str, where: int, prompt_key: str) -> dict:
    chosen, rejected = row["chosen"], row["rejected"]
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError(f"{path}:{where}: missing field {prompt_key!r}; set data.prompt_key, or give chosen and "
                        "rejected as whole conversations whose first turns (the prompt) are the same")
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or any(m["role"] != "assistant" for m in chosen[n:] + rejected[n:]):
        raise UserError(f"{path}:{where}: chosen and rejected must share their first turns (the prompt) and differ "
                        "only in assistant turns")
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


class BatchIterator:
    """Endless shuffled batches of rows, reshuffled every epoch from a seed. Its position is two integers
    (`state()` / `load_state()`), so a resumed run sees exactly the rows it would have seen."""

    def __init__(self, rows: list, batch_size: int, seed: int):
        if len(rows) < batch_size:
            raise UserError(f"the dataset has {len(rows)} rows, fewer than one batch of {batch_size}; add rows or "
                            "lower the batch size")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        import random
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next(self) -> list:
        return [self.rows[i] for i in self.next_ids()]

    def next_ids(self) -> list[int]:
        """The next batch as indices into `rows` (a run's trained_rows.jsonl records them)."""
        if self.index + self.batch_size > len(self.rows):  # drop the ragged tail, start a new epoch
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle()
        picked = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle()


def make_renderer(cfg, model_path: str) -> PromptRenderer:
    """The prompt renderer of a run: the checkpoint's tokenizer and generation_config, `data.apply_chat_template`."""
    return PromptRenderer.from_pretrained(model_path, chat=cfg.data.apply_chat_template,
                                          trust_remote_code=cfg.model.trust_remote_code,
                                          chat_template=cfg.data.chat_template)


def tokenizer_source(cfg, model_path: str, renderer: Optional[PromptRenderer] = None) -> str:
    """The folder whose tokenizer the run saves beside its models: the checkpoint's, or under data.chat_template
    that tokenizer with the template, written to <output_dir>/tokenizer (so a stage started from the run's model
    renders as this run did)."""
    if not cfg.data.chat_template:
        return model_path
    out = os.path.join(cfg.output_dir, "tokenizer")
    (renderer or make_renderer(cfg, model_path)).tokenizer.save_pretrained(out)
    return out


def checked_renderer(cfg, model_path: str, train: list[dict], held_out: list[dict]) -> PromptRenderer:
    """make_renderer, and every prompt of the train and eval rows checked to fit the engines' context: a
    prompt of rollout.max_model_len tokens or more is refused by the engine on every rerun, so it stops the run
    here, named (no row has a prompt under a multi-turn environment: nothing to check)."""
    renderer = make_renderer(cfg, model_path)
    limit = cfg.rollout.max_model_len
    for split, rows in (("train", train), ("eval", held_out)):
        for i, row in enumerate(rows):
            if "prompt" in row and len(ids := renderer.prompt_ids(row["prompt"])) >= limit:
                where = getattr(cfg.data, f"{split}_path", None) or f"data.task={cfg.data.task}"
                raise UserError(f"{where}, {split} row {i + 1}: its prompt is {len(ids)} tokens once rendered, and "
                                f"the engines hold rollout.max_model_len = {limit} tokens for prompt and completion "
                                f"together. Raise rollout.max_model_len (to at least {len(ids)} + "
                                f"rollout.max_new_tokens = {len(ids) + cfg.rollout.max_new_tokens}), or shorten or "
                                f"drop that row")
    return renderer
