"""Where a run's time goes: spans of every actor's work on one clock, kept by the driver (logging.trace).

The driver sees every worker call start and end (common.remote.ray_get waits for each by its role: "policy trainer
0", "rollout engine 1", ...), and times its own phases (rlhf.outputs.metrics.PhaseTimer); each becomes a span on the
track of the actor or of the driver, named by the driver's phase at the time ("rollout", "ref", "train", "sync",
...). A worker's span runs from the driver's call to its answer, so it holds the transport too, and a worker with
no call in flight is idle. What the worker did inside (common.spans) is on a track beside it (INSIDE). The spans are appended to `<output_dir>/trace.json` as each step ends, as Chrome
trace events (ui.perfetto.dev and chrome://tracing open the file as it is, also while the run still writes it; a
resumed run keeps the earlier launch's as trace-1.json, ...), and turned into each step's `util/...` metrics
(`utilisation`).

Nothing here imports torch or Ray."""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Optional

DRIVER = "driver"
STEPS = "steps"
INSIDE = " (inside)"  # a worker's own spans (common.spans) on a track beside its calls': "policy trainer 0 (inside)"
_local = threading.local()
_current: Optional["Timeline"] = None
ACTORS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # role -> Ray actor (common.remote)


def current() -> Optional["Timeline"]:
    """The run's timeline, or None where nothing records (a worker process, logging.trace off)."""
    return _current


def install(timeline: Optional["Timeline"]) -> None:
    global _current
    _current = timeline


def phase_name() -> str:
    """The phase this thread's driver code is in (`in_phase`), or what a thread outside any phase does."""
    thread = threading.current_thread()
    return getattr(_local, "phase", None) or ("other" if thread is threading.main_thread() else thread.name)


def carrying_phase(fn):
    """`fn`, to run on another thread under this thread's phase (a pool's worker threads have none)."""
    name = getattr(_local, "phase", None)

    def run(*args, **kwargs):
        with in_phase(name):
            return fn(*args, **kwargs)
    return run if name else fn


@contextmanager
def in_phase(name: Optional[str]):
    before = getattr(_local, "phase", None)
    _local.phase = name
    try:
        yield
    finally:
        _local.phase = before


class Timeline:
    """Spans (track, name, start, end) in seconds since the epoch, written out at each `flush`."""

    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()
        self.pending: list[tuple[str, str, float, float, dict]] = []
        self.recent: list[tuple[str, str, float, float, dict]] = []  # the spans of the step being measured
        self.tids: dict[str, int] = {}
        self.seen: set[str] = set()  # every track a span was recorded on
        if os.path.exists(path):  # an earlier launch's (a resumed run): kept beside, each file one whole trace
            n = 1
            while os.path.exists(f"{path[:-5]}-{n}.json"):
                n += 1
            os.replace(path, f"{path[:-5]}-{n}.json")
        self.file = open(path, "w", encoding="utf-8")
        self.file.write("[\n")
        self.pid = os.getpid()

    def span(self, track: str, name: str, start: float, end: float, **args) -> None:
        with self.lock:
            self.seen.add(track)
            self.pending.append((track, name, start, end, args))
            self.recent.append((track, name, start, end, args))

    def flush(self) -> None:
        """Append the spans recorded since the last flush to the file (and the names of new tracks)."""
        with self.lock:
            spans, self.pending = self.pending, []
        lines = []
        for track, name, start, end, args in spans:
            if track not in self.tids:
                self.tids[track] = len(self.tids) + 1
                lines.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": self.tids[track],
                              "args": {"name": track}})
            lines.append({"ph": "X", "name": name, "pid": self.pid, "tid": self.tids[track], "ts": start * 1e6,
                          "dur": max(end - start, 0.0) * 1e6, "args": args})
        self.file.write("".join(json.dumps(e) + ",\n" for e in lines))
        self.file.flush()

    def take_recent(self) -> list[tuple[str, str, float, float, dict]]:
        with self.lock:
            spans, self.recent = self.recent, []
        return spans

    def close(self) -> None:
        """The spans left, and the array closed."""
        self.flush()
        self.file.write(json.dumps({"ph": "M", "name": "process_name", "pid": self.pid, "args": {"name": "run"}}) +
                        "\n]\n")
        self.file.close()


def read_trace(path: str) -> list[dict]:
    """The events of a trace this module wrote, whole or cut short (a run still writing, or killed mid-line)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:  # (the last line, cut by a kill)
                    break
    return events


def union_seconds(intervals: list[tuple[float, float]], lo: float = float("-inf"),
                  hi: float = float("inf")) -> float:
    """Seconds of [lo, hi] (everywhere, without them) covered by at least one of `intervals`."""
    covered, last = 0.0, lo
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= max(start, last):  # (outside [lo, hi], or covered already)
            continue
        covered += end - max(start, last)
        last = end
    return covered


def is_worker(track: str) -> bool:
    """A track of a worker's calls (not the driver's, the steps', nor a worker's own spans)."""
    return track not in (DRIVER, STEPS) and not track.endswith(INSIDE)


def role_of(track: str) -> str:
    """'policy trainer 1' -> 'policy_trainer'; 'rollout engine 0' -> 'rollout_engine'."""
    words = track.split()
    if words and words[-1].isdigit():
        words = words[:-1]
    return "_".join(words)


def utilisation(spans: list[tuple[str, str, float, float, dict]], start: float, end: float,
                known: tuple[str, ...] = ()) -> dict[str, float]:
    """A step's `util/<role>_busy` (the fraction of [start, end] each actor had a call in flight, the mean over a
    role's actors) and `util/bubble` (the mean idle fraction over every worker actor: those with a span here and
    the `known` ones, seen earlier in the run, idle through this step): the driver's own track and the step markers
    are not workers."""
    wall = max(end - start, 1e-9)
    per_track: dict[str, list[tuple[float, float]]] = {t: [] for t in known if is_worker(t)}
    for track, _, s, e, _ in spans:
        if is_worker(track):
            per_track.setdefault(track, []).append((s, e))
    busy = {t: union_seconds(iv, start, end) / wall for t, iv in per_track.items()}
    roles: dict[str, list[float]] = {}
    for track, frac in busy.items():
        roles.setdefault(role_of(track), []).append(frac)
    out = {f"util/{role}_busy": sum(v) / len(v) for role, v in roles.items()}
    if busy:
        out["util/bubble"] = 1.0 - sum(busy.values()) / len(busy)
        out["util/workers"] = float(len(busy))
    return out


def now() -> float:
    return time.time()
