"""Whose checkpoint is this? A run's identity (its stage, the training-relevant config and its data files'
fingerprints) goes into every checkpoint's driver.json; a rerun into the same output_dir resumes only a checkpoint
of the same run, and one lock per run folder keeps two runs from writing into it at once."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator

from common.errors import UserError

# keys a resumed run may change: how long it runs, what it logs and evaluates, how often it checkpoints, deadlines,
# machine-dependent resources, and the asynchronous pacing (a checkpoint resumes under another rollout.max_staleness,
# docs/async.md, with the off-policy correction it resolves to); everything else changes what is trained
MAY_CHANGE = ("output_dir", "trainer.max_steps", "trainer.max_bad_steps", "logging.", "eval.", "checkpoint.",
              "rollout.timeout_s", "rollout.max_engine_restarts", "rollout.multiprocess", "rollout.logprob_diff_warn",
              "placement.cpu_threads", "rollout.max_staleness", "rollout.chunk_tokens", "rollout.inflight_kv",
              "algorithm.tis_cap", "algorithm.tis_mask_low", "algorithm.tis_mask_high", "rollout.router_agreement_warn",
              "run.")


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def file_fingerprint(path: str) -> str:
    """Size and a hash of the first and last MiB of each file (a folder: of every file in it): cheap on large data,
    unchanged by a copy or a touch, changed by an edit that moves either end or the size."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    h = hashlib.sha256()
    for name in files:
        size = os.path.getsize(name)
        h.update(f"{os.path.relpath(name, path)}:{size}".encode())
        with open(name, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read())
    return h.hexdigest()[:16]


def identity(cfg) -> dict:
    """The run's stage, its training-relevant config (flattened, JSON values) and its data files' fingerprints;
    with LoRA also the base model folder's (`base`): a LoRA checkpoint holds the adapter, and a resume reads the
    base from model.path again."""
    from omegaconf import OmegaConf

    flat = _flat(json.loads(json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg)))))
    data = {p: file_fingerprint(p) for p in (cfg.data.train_path, cfg.data.eval_path) if p and os.path.exists(p)}
    found = {"stage": cfg.stage, "config": {k: v for k, v in flat.items() if not may_change(k)}, "data": data}
    if cfg.model.lora.rank and cfg.model.path and os.path.isdir(cfg.model.path):
        found["base"] = {cfg.model.path: file_fingerprint(cfg.model.path)}
    return found


def differences(saved: dict, now: dict) -> list[str]:
    """'key: saved -> now' for each difference that makes `now` another run than `saved`."""
    out = [f"stage: {saved['stage']} -> {now['stage']}"] if saved["stage"] != now["stage"] else []
    old, new = saved["config"], now["config"]
    out += [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in sorted(set(old) | set(new)) if not may_change(k) and old.get(k) != new.get(k)]
    out += [f"data file {p}: its contents changed" for p in sorted(set(saved["data"]) & set(now["data"]))
            if saved["data"][p] != now["data"][p]]
    old_base, new_base = saved.get("base", {}), now.get("base", {})  # (checkpoints before it: none to compare)
    out += [f"model.path {p}: its files changed (a LoRA checkpoint holds the adapter; the base is read from here)"
            for p in sorted(set(old_base) & set(new_base)) if old_base[p] != new_base[p]]
    return out


def check_same_run(folder: str, saved: dict, now: dict, output_dir: str) -> None:
    diff = differences(saved, now)
    if diff:
        listed = "\n  ".join(diff)
        raise UserError(f"{output_dir} holds a checkpoint of another run ({folder}); resuming it would train that "
                        f"run, not this one. What differs:\n  {listed}\nEither give this run its own folder "
                        f"(output_dir=...) or start over in this one with checkpoint.resume=false (the old "
                        f"checkpoints and metrics are then moved into {output_dir}/previous-<time>/, not deleted).")


@contextmanager
def run_lock(output_dir: str) -> Iterator[None]:
    """Hold `<output_dir>/.lock` for the run; a second run into the folder exits 2 naming the holder."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ".lock")
    f = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise UserError(f"{output_dir} is in use by another run ({holder}); two runs in one folder would "
                            f"interleave their checkpoints. Wait for it, or give this run output_dir=<another "
                            f"folder>") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        yield
    finally:
        f.close()  # closing releases the lock
