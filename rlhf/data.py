"""Datasets: rows from JSONL, Parquet or a `datasets` folder on disk (with configurable field names), or from a
built-in synthetic task. A malformed row is an error naming the file and line; an empty dataset is an error."""
from __future__ import annotations

import json
import os
from typing import Iterator, Optional

from rlhf.config import DataConfig
from rlhf.errors import UserError
from rlhf import tasks


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


def load_records(path: str, fields: dict[str, str]) -> list[dict]:
    """Rows of `path` as dicts keyed by our names. `fields` maps our name -> the file's column (e.g.
    {"prompt": "question"}); every mapped column must hold a string. Extra columns are kept as metadata."""
    rows = []
    for where, row in read_rows(path):
        if not isinstance(row, dict):
            raise UserError(f"{path}:{where}: expected a JSON object, got {type(row).__name__}")
        out = {k: v for k, v in row.items() if k not in fields.values()}
        for ours, theirs in fields.items():
            if theirs not in row:
                raise UserError(f"{path}:{where}: missing field {theirs!r} (has {sorted(row)}); set "
                                f"data.{ours}_key to the column that holds the {ours}")
            if not isinstance(row[theirs], str):
                raise UserError(f"{path}:{where}: field {theirs!r} must be a string, got "
                                f"{type(row[theirs]).__name__}")
            out[ours] = row[theirs]
        rows.append(out)
    if not rows:
        raise UserError(f"{path}: the dataset is empty; it needs at least one row")
    return rows


def prompt_rows(d: DataConfig, split: str, seed: int) -> list[dict]:
    """Rows with `prompt` and `answer` for SFT, RL prompts and evaluation."""
    if d.task is not None:
        return tasks.make_rows(d, split, seed)
    path: Optional[str] = d.train_path if split == "train" else d.eval_path
    if path is None:
        raise UserError("data.eval_path is unset and data.task is null: set data.eval_path to held-out prompts")
    return load_records(path, {"prompt": d.prompt_key, "answer": d.answer_key})


def preference_rows(d: DataConfig, split: str, seed: int) -> list[dict]:
    """Rows with `prompt`, `chosen` and `rejected` for reward-model and DPO training."""
    if d.task is not None:
        return tasks.make_preference_rows(d, split, seed)
    path = d.train_path if split == "train" else d.eval_path
    if path is None:
        raise UserError("data.eval_path is unset and data.task is null: set data.eval_path to held-out pairs")
    return load_records(path, {"prompt": d.prompt_key, "chosen": d.chosen_key, "rejected": d.rejected_key})


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
        if self.index + self.batch_size > len(self.rows):  # drop the ragged tail, start a new epoch
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle()
        picked = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return [self.rows[i] for i in picked]

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle()
