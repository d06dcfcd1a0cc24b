"""`python -m rlhf.plot <run_dir>`: draw a run's metrics.jsonl as PNG curves in <run_dir>/plots/summary.png —
rewards, evaluation, KL, losses, the engine/trainer log-prob agreement, and the step time split by phase."""
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
PHASES = ["time/rollout", "time/reward", "time/ref", "time/train", "time/sync"]


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
