"""The workers' own spans (common.spans) brought to the driver at each step's end, put on their actors' tracks of
the run's timeline, and judged against each device's peaks: `perf/<role>_mfu` (a training role's model FLOPs over
its update time), `perf/prefill_mfu` and `perf/decode_bw_util` (the engines' prefill FLOPs, and the bytes their
decode steps read, over the seconds vLLM spent on each).

Collecting asks each actor for its spans with a call of its own (Ray's __ray_call__), which waits behind whatever
the actor is doing: a worker still busy when the step ends (an engine generating the next step's samples under
rollout.max_staleness) answers later, and its spans join the step that collects them. A step's end waits for the
idle workers' answers only (FIRST_S, QUIET_S)."""
from __future__ import annotations

from typing import Optional

from common import spans, timeline

FIRST_S = 0.5  # how long a step's end waits for the first worker's spans
QUIET_S = 0.05  # and then for each next one: a worker that takes longer is busy, its spans join a later step
PROBE_TIMEOUT_S = 30.0  # for each worker's peaks, before the first step


class WorkerSpans:
    def __init__(self):
        self.pending: dict = {}  # ObjectRef -> track
        self.probed = False

    def start(self) -> None:
        """Ask every actor the run made to keep spans (again each step: an actor Ray restarted starts without). The
        first time, before the first step, each measures its device's peaks in turn (common.spans.probe)."""
        if not self.probed:
            self.probed = True
            self._probe_in_turn()
        for actor in list(timeline.ACTORS.values()):
            actor.__ray_call__.remote(spans.start)

    @staticmethod
    def _probe_in_turn() -> None:
        import ray
        for actor in list(timeline.ACTORS.values()):
            try:
                ray.get(actor.__ray_call__.remote(spans.probe), timeout=PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 — a worker that cannot answer now measures when first asked for spans
                continue

    def collect(self) -> dict[str, dict]:
        """track -> {"spans": [(name, start, end, args)], "peaks": {...} or None} of the actors that answered."""
        asked = set(self.pending.values())
        for track, actor in list(timeline.ACTORS.items()):
            if track not in asked:
                self.pending[actor.__ray_call__.remote(spans.take)] = track
        if not self.pending:
            return {}
        import ray
        ready, waiting = [], list(self.pending)
        while waiting:  # (idle actors answer within milliseconds of each other; a busy one is not waited for)
            got, waiting = ray.wait(waiting, num_returns=1, timeout=QUIET_S if ready else FIRST_S)
            if not got:
                break
            ready += got
        out: dict[str, dict] = {}
        for ref in ready:
            track = self.pending.pop(ref)
            try:
                out[track] = ray.get(ref)
            except Exception:  # noqa: BLE001 — an actor that died or was stopped has nothing more to say
                continue
        return out

    def close(self) -> None:
        self.pending.clear()


def perf_metrics(collected: dict[str, dict]) -> dict[str, float]:
    """Utilisation from the workers' spans: `perf/<role>_mfu` (forward + backward FLOPs with gradients over the
    seconds of the updates that hold them, times the device's peak, summed over the role's ranks),
    `perf/prefill_mfu` and `perf/decode_bw_util` (over the engines). A device without peaks adds nothing."""
    sums: dict[str, list[float]] = {}  # key -> [work, peak-seconds]
    out_peaks: dict[str, float] = {}

    def add(key: str, work: float, peak_seconds: float) -> None:
        if work > 0 and peak_seconds > 0:
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + work, acc[1] + peak_seconds

    for track, got in collected.items():
        peaks: Optional[dict] = got.get("peaks")
        kept = got.get("spans", [])
        if not peaks or not kept:
            continue
        role = timeline.role_of(track)  # (the peaks judged against, in the row: a CPU's are measured, not looked up)
        out_peaks[f"perf/{role}_peak_tflops"] = peaks["flops"] / 1e12
        out_peaks[f"perf/{role}_peak_gb_s"] = peaks["bytes_s"] / 1e9
        trained = [s for s in kept if s[0] in ("forward", "backward") and s[3].get("grad", True)]
        add(f"perf/{role}_mfu", spans.sum_args(trained, ("forward", "backward"), "flops"),
            spans.seconds(kept, ("update",)) * peaks["flops"])
        for _, _, _, args in (s for s in kept if s[0] == "generate"):
            devices = args.get("devices", 1)
            add("perf/prefill_mfu", args.get("prefill_flops", 0.0),
                args.get("prefill_s", 0.0) * peaks["flops"] * devices)
            add("perf/decode_bw_util", args.get("decode_bytes", 0.0),
                args.get("decode_s", 0.0) * peaks["bytes_s"] * devices)
    out = {key: work / peak_seconds for key, (work, peak_seconds) in sums.items()} | out_peaks
    calls = [args for got in collected.values() for name, _, _, args in got.get("spans", []) if name == "generate"]
    if calls:  # (how many sequences each generate call decoded together, at most: the advice's measure)
        out["perf/decode_seqs"] = sum(a.get("sequences", 0) for a in calls) / len(calls)
    return out


def to_trace(trace: timeline.Timeline, collected: dict[str, dict]) -> None:
    """Each worker span on a track beside its actor's calls ("policy trainer 0 (inside)"): the driver's call spans
    start when it begins waiting, a little after it sent them, so the worker's own may begin before them."""
    for track, got in collected.items():
        for name, start, end, args in got.get("spans", []):
            trace.span(track + timeline.INSIDE, name, start, end, **args)
