"""The RL stage's checks that concern the objective (algorithm.*): estimator group sizes, the policy loss and its
options, KL and the overlong shaping. Part of rlhf.config.validate(); `bad(key, value, fix)` records one problem."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf.config import RunConfig

# algorithms/policy_losses.py's table (not imported here: config loads without torch; tests check they agree)
POLICY_LOSSES = ("clip", "gspo", "gspo_token", "cispo")


def validate_objective(cfg: RunConfig, bad, choice) -> None:
    a, r = cfg.algorithm, cfg.rollout
    choice("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES)
    choice("algorithm.rollout_correction", a.rollout_correction, ("token", "sequence"))
    if a.kl_coef < 0:
        bad("algorithm.kl_coef", a.kl_coef, "must be >= 0 (0 disables the KL penalty and the reference model)")
    if a.loss_norm_len is not None and a.loss_norm_len <= 0:
        bad("algorithm.loss_norm_len", a.loss_norm_len, "must be > 0 (seq-mean-token-sum-norm's constant), or null "
            "for rollout.max_new_tokens")
    if a.dual_clip is not None and a.dual_clip <= 1:
        bad("algorithm.dual_clip", a.dual_clip, "must be > 1 (e.g. 3.0), or null to disable")
    if a.dual_clip is not None and a.policy_loss != "clip":
        bad("algorithm.dual_clip", a.dual_clip, f"bounds the clip surrogate's loss; with algorithm.policy_loss="
            f"{a.policy_loss} set it to null")
    if a.tis_cap is not None and a.tis_cap <= 0:
        bad("algorithm.tis_cap", a.tis_cap, "must be > 0 (e.g. 2.0), or null to disable")
    bounds = (a.tis_mask_low, a.tis_mask_high)
    if (bounds[0] is None) != (bounds[1] is None) or (bounds[0] is not None and not 0 < bounds[0] <= 1 <= bounds[1]):
        bad("algorithm.tis_mask_low/tis_mask_high", bounds, "set both (0 < low <= 1 <= high, e.g. 0.5 and 5.0), or "
            "neither")
    if not 0 <= a.overlong_buffer < r.max_new_tokens:
        bad("algorithm.overlong_buffer", a.overlong_buffer, f"must be >= 0 (0 = off) and below rollout.max_new_tokens "
            f"= {r.max_new_tokens}: the penalty ramps over the last overlong_buffer tokens of the budget")
    if a.overlong_buffer and (cfg.env.name is not None or cfg.agent.fn is not None):
        bad("algorithm.overlong_buffer", a.overlong_buffer, "shapes single-turn completions against "
            "rollout.max_new_tokens; a multi-turn trajectory has a budget per turn: set it to 0 with env.name or "
            "agent.fn")
    if a.overlong_penalty < 0:
        bad("algorithm.overlong_penalty", a.overlong_penalty, "must be >= 0 (the reward lost at the budget's end)")
    if (a.name == "opd") != (cfg.teacher.path is not None):
        bad("teacher.path", cfg.teacher.path, "algorithm.name=opd distils from a teacher: set teacher.path to its HF "
            "folder; other algorithms have none (set it to null)")
    if a.name == "opd" and a.opd_task_coef and r.n_samples < 2:
        bad("rollout.n_samples", r.n_samples, "algorithm.opd_task_coef compares samples of the same prompt: use >= 2")
    from algorithms.estimators import ESTIMATORS
    if a.name in ESTIMATORS and r.n_samples < ESTIMATORS[a.name].min_group_size:
        bad("rollout.n_samples", r.n_samples, f"{a.name} compares samples of the same prompt (with fewer than "
            f"{ESTIMATORS[a.name].min_group_size} every advantage is 0): use >= {ESTIMATORS[a.name].min_group_size}")
