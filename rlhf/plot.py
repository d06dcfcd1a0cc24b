"""`python -m rlhf.plot <run_dir>`: draw a run's metrics.jsonl as PNG curves in <run_dir>/plots/summary.png —
rewards, evaluation, KL, losses, the engine/trainer log-prob agreement, and the step time split by phase — and,
where the run kept a trace (logging.trace), <run_dir>/plots/timeline.png: each actor's calls over the last steps,
and each role's busy fraction a step."""
from __future__ import annotations

import argparse
import os
import sys

from common.errors import UserError
from rlhf.outputs.metrics import read_metrics

PANELS = [
    ("reward", ["rollout/reward_mean", "rollout/task_reward_mean", "eval/reward_mean"], "linear"),
    ("evaluation", ["eval/accuracy", "eval/exact_match", "eval/pass@1", "eval/pass@4", "eval/pair_accuracy"], "linear"),
    ("KL", ["rollout/kl", "policy/kl", "policy/approx_kl"], "linear"),
    ("losses", ["train/loss", "policy/loss", "critic/loss"], "linear"),
    ("rollout/logprob_diff (engine vs trainer)", ["rollout/logprob_diff"], "log"),
]
PHASES = ["time/rollout", "time/reward", "time/ref", "time/train", "time/sync", "time/other"]
TIMELINE_STEPS = 3  # the steps the timeline draws (the last ones)


def plot_run(run_dir: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        raise UserError(f"{run_dir}: no metrics.jsonl there; pass the output_dir of a run") from None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys, scale) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval/") else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale(scale if any(r.get(k) for r in rows for k in keys) else "linear")
        if ax.lines:
            ax.legend(fontsize=8)
    _phase_breakdown(axes.flat[5], rows)
    fig.suptitle(os.path.abspath(run_dir))
    fig.tight_layout()
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if os.path.exists(os.path.join(run_dir, "trace.json")):
        _timeline_figure(run_dir, rows, out_dir, plt)
    return path


def _timeline_figure(run_dir: str, rows: list[dict], out_dir: str, plt) -> str:
    """plots/timeline.png: the trace's spans of the last TIMELINE_STEPS steps, a row per track (coloured by the
    driver's phase), over the busy fractions a step of each role (util/...)."""
    from common.timeline import STEPS, read_trace

    events = read_trace(os.path.join(run_dir, "trace.json"))
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    steps = [e for e in spans if tracks.get(e["tid"]) == STEPS][-TIMELINE_STEPS:]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8), gridspec_kw={"height_ratios": [3, 2]})
    if steps:
        lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        shown = [e for e in spans if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
        names = sorted({e["name"] for e in shown if tracks.get(e["tid"]) != STEPS})
        colours = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
        order = sorted(tracks, key=lambda t: tracks[t])
        for y, tid in enumerate(order):  # (longest first: a worker's update under its forward and backward)
            for e in sorted((e for e in shown if e["tid"] == tid), key=lambda e: -e["dur"]):
                colour = "lightgrey" if tracks[tid] == STEPS else colours[e["name"]]
                top.barh(y, e["dur"] / 1e6, left=(e["ts"] - lo) / 1e6, color=colour, edgecolor="white")
        top.set_yticks(range(len(order)), [tracks[t] for t in order])
        top.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=n) for n, c in colours.items()], fontsize=8,
                   loc="upper right")
    top.set_xlabel("seconds")
    top.set_title(f"the last {len(steps)} steps: each actor's calls, by the driver's phase, and its own spans")
    keys = sorted({k for r in rows for k in r if k.startswith("util/") and k.endswith("_busy")})
    keys += sorted({k for r in rows for k in r if k.startswith("perf/") and k.endswith(("_mfu", "_util"))})
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        bottom.plot(*zip(*pts), marker="o", markersize=3, label=key.split("/")[1],
                    linestyle="--" if key.startswith("perf/") else "-")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("step")
    bottom.set_title("busy fraction of each step by role (solid); MFU and bandwidth used (dashed)")
    if keys:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "timeline.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _phase_breakdown(ax, rows: list[dict]) -> None:
    """Stacked bars: seconds per step in each phase (the rest of time/step is eval and bookkeeping)."""
    steps = [r for r in rows if "time/step" in r]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        vals = [r.get(phase, 0.0) for r in steps]
        if any(vals):
            ax.bar([r["step"] for r in steps], vals, bottom=bottom, label=phase.split("/")[1])
            bottom = [b + v for b, v in zip(bottom, vals)]
    if not any(bottom):  # stages without phases: the step time alone
        ax.bar([r["step"] for r in steps], [r["time/step"] for r in steps], label="step")
    ax.set_title("seconds per step, by phase")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return UserError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
