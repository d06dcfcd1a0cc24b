"""Checkpoint folders: `<output_dir>/checkpoints/step_<N>/`, written into a temp folder and renamed into place, with
a `COMPLETE` marker written last, so a crash at any moment leaves the previous checkpoint intact. Each holds the
workers' DeepSpeed states (model, optimizer, scheduler per rank), a Hugging Face copy of the policy, and the driver's
state (step, data-loader position)."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

MARKER = "COMPLETE"


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def latest(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder, or None. Incomplete ones (no marker) are ignored."""
    found = []
    if os.path.isdir(root(output_dir)):
        for name in os.listdir(root(output_dir)):
            m = re.fullmatch(r"step_(\d+)", name)
            if m and os.path.isfile(os.path.join(root(output_dir), name, MARKER)):
                found.append((int(m.group(1)), os.path.join(root(output_dir), name)))
    return max(found)[1] if found else None


def begin(output_dir: str, step: int) -> str:
    """A fresh temp folder to write step `step` into (any leftover from a crash is discarded)."""
    tmp = os.path.join(root(output_dir), f".tmp_step_{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, output_dir: str, step: int, driver_state: dict, keep_last: int) -> str:
    """Write the driver state and the marker, rename into place, then delete all but the newest `keep_last`."""
    with open(os.path.join(tmp, "driver.json"), "w", encoding="utf-8") as f:
        json.dump(driver_state, f)
    open(os.path.join(tmp, MARKER), "w").close()
    final = os.path.join(root(output_dir), f"step_{step:06d}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    complete = sorted(n for n in os.listdir(root(output_dir)) if re.fullmatch(r"step_\d+", n))
    for name in complete[:-keep_last]:
        shutil.rmtree(os.path.join(root(output_dir), name), ignore_errors=True)
    return final


def load_driver_state(path: str) -> dict:
    with open(os.path.join(path, "driver.json"), encoding="utf-8") as f:
        return json.load(f)


def truncate_metrics(output_dir: str, last_step: int, name: str = "metrics.jsonl") -> None:
    """Drop rows of `<output_dir>/<name>` (one JSON object with a `step` a line) after the checkpoint's step, so the
    resumed run logs each step exactly once."""
    path = os.path.join(output_dir, name)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    kept = []
    for line in rows:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            break  # a line cut by the kill: everything after it is newer anyway
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
