"""Checkpoint folders: `<output_dir>/checkpoints/step_<N>/`, written into a temp folder and renamed into place, with
a `COMPLETE` marker written last, so a crash at any moment leaves the previous checkpoint intact. Each holds the
workers' DeepSpeed states (model, optimizer, scheduler per rank), a Hugging Face copy of the policy, and the driver's
state (step, data-loader position)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from typing import Optional

MARKER = "COMPLETE"
# what a full disk says: the OS's words, and torch's writer's own for a short write (it keeps no errno)
FULL_DISK_TEXT = ("No space left on device", "Disk quota exceeded", "file write failed", "unexpected pos")
LOW_SPACE = 64 * 2**20


def root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete(output_dir: str) -> list[str]:
    """Complete checkpoint folders (marker present), newest first. Incomplete ones are ignored."""
    found = []
    if os.path.isdir(root(output_dir)):
        for name in os.listdir(root(output_dir)):
            m = re.fullmatch(r"step_(\d+)", name)
            if m and os.path.isfile(os.path.join(root(output_dir), name, MARKER)):
                found.append((int(m.group(1)), os.path.join(root(output_dir), name)))
    return [path for _, path in sorted(found, reverse=True)]


def latest(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder, or None."""
    found = complete(output_dir)
    return found[0] if found else None


def tmp_folder(output_dir: str, step: int) -> str:
    """Where step `step` is written before commit renames it into place."""
    return os.path.join(root(output_dir), f".tmp_step_{step:06d}")


def begin(output_dir: str, step: int) -> str:
    """A fresh temp folder to write step `step` into (any leftover from a crash is discarded)."""
    tmp = tmp_folder(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_manifest(folder: str) -> dict[str, int]:
    """Every file under `folder` flushed to disk (then each directory), and their sizes by relative path: a machine
    crash after the marker can no longer leave empty or short files behind a "complete" checkpoint."""
    sizes = {}
    for d, _, names in os.walk(folder, topdown=False):
        for name in names:
            path = os.path.join(d, name)
            _fsync(path)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
        _fsync(d)
    return sizes


def commit(tmp: str, output_dir: str, step: int, driver_state: dict, keep_last: int) -> str:
    """Flush the workers' files, write the driver state (with their sizes) and the marker, each durably, rename
    into place, then delete older steps of this run beyond the newest `keep_last` (never a later step: a folder
    holding one belongs to another run, and resume_point refuses or moves those aside before anything is written)."""
    state = {**driver_state, "files": _durable_manifest(tmp)}
    with open(os.path.join(tmp, "driver.json"), "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(tmp, MARKER), "w") as f:
        os.fsync(f.fileno())
    _fsync(tmp)
    final = os.path.join(root(output_dir), f"step_{step:06d}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root(output_dir))
    older = [p for p in complete(output_dir) if int(os.path.basename(p)[5:]) <= step]
    for path in older[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def load_driver_state(path: str) -> dict:
    """driver.json, checked against the file sizes it records (checkpoints written before it recorded them: as
    they are). Raises ValueError naming what is missing or cut."""
    try:
        with open(os.path.join(path, "driver.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}/driver.json cannot be read ({e})") from None
    for rel, size in state.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full) or os.path.getsize(full) != size:
            have = os.path.getsize(full) if os.path.isfile(full) else "missing"
            raise ValueError(f"{full} is {have} bytes, the checkpoint wrote {size}")
    return state


def set_aside(output_dir: str) -> Optional[str]:
    """checkpoint.resume=false in a used folder: the earlier run's checkpoints, metrics and final model move into
    `<output_dir>/previous-<time>/` (nothing is deleted). Returns that folder, or None when there was nothing."""
    names = [n for n in ("checkpoints", "metrics.jsonl", "trained_rows.jsonl", "final", "final_adapter")
             if os.path.exists(os.path.join(output_dir, n))]
    if not names or names == ["checkpoints"] and not os.listdir(root(output_dir)):
        return None
    dest = os.path.join(output_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(dest)
    for n in names:
        os.replace(os.path.join(output_dir, n), os.path.join(dest, n))
    return dest


def truncate_metrics(output_dir: str, last_step: int, name: str = "metrics.jsonl") -> None:
    """Drop rows of `<output_dir>/<name>` (one JSON object with a `step` a line) after the checkpoint's step, so the
    resumed run logs each step exactly once."""
    path = os.path.join(output_dir, name)
    if not os.path.isfile(path):
        return
    keep = 0  # bytes: cut in place, so a logger that holds the file open (append mode) writes after the cut
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    if json.loads(line)["step"] > last_step or not line.endswith(b"\n"):
                        break
                except (ValueError, KeyError):
                    break  # a line cut by the kill: everything after it is newer anyway
            keep += len(line)
    os.truncate(path, keep)


def free_bytes(folder: str) -> int:
    """Bytes free on the disk holding `folder` (or its nearest existing parent)."""
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def out_of_space(error: BaseException, folder: str) -> bool:
    """Whether `error`, raised while writing under `folder`, is the disk filling up: ENOSPC or EDQUOT anywhere in its
    chain (a Ray task error's `cause` too), a full disk's words in its message (a Ray worker's error reaches the
    driver as text), or under LOW_SPACE left on that disk now."""
    seen: Optional[BaseException] = error
    for _ in range(16):  # a chain can loop back on itself
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    return any(text in str(error) for text in FULL_DISK_TEXT) or free_bytes(folder) < LOW_SPACE
