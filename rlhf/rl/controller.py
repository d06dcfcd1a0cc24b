"""The on-policy RL loop (stage: rl): generate -> score -> reference/old log-probs -> advantages -> update -> sync.

`RLController.step()` reads top to bottom, one timed phase per block. Workers are Ray actors; the advantage math
runs here on the driver (algorithms/)."""
from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from algorithms.advantages import informative_groups
from algorithms.estimators import EstimatorInputs, estimator
from algorithms.kl import kl_estimate
from algorithms.masked import masked_mean
from algorithms.reward import overlong_penalty
from common.batch import RolloutBatch, samples_to_batch
from common.errors import TrainingStopped
from common.remote import Shipped
from rlhf.config import RunConfig, to_yaml
from rlhf.config.resolve import require_resolved
from rlhf.outputs import checkpoint
from rlhf.outputs.metrics import MetricsLogger, PhaseTimer, RolloutDumps, TrainedRows, since_launch, startup_line
from rlhf.rl.rounds import Round, TokenScores, agreement_alarm, rollout_metrics, select_groups, teacher_kl
from rlhf.rl.startup import check_teacher
from rlhf.stages.data import BatchIterator, checked_renderer, prompt_rows, tokenizer_source
from rlhf.stages.loop import answer_metric, drive, resume_point, worker_died
from rlhf.weights.tiny import ensure_model
from rollout.engine import SamplingConfig
from rollout.episodes import episodes_for
from rollout.sources import rollout_source


class RLController:
    def __init__(self, cfg: RunConfig):
        from common.remote import init_ray
        require_resolved(cfg)
        self.cfg, a, r = cfg, cfg.algorithm, cfg.rollout
        self.estimator = estimator(a.name)
        clock = PhaseTimer()  # where start-up goes: logged with step 0, printed below
        with clock("start_inputs"):  # inputs first: bad data fails fast
            self.episodes = episodes_for(cfg)  # completions, an environment's trajectories or an agent's episodes
            self.per_round = math.ceil(r.prompts_per_step * a.oversample)  # prompts a rollout round generates
            need_prompt = self.episodes.needs_prompt
            self.prompts = BatchIterator(prompt_rows(cfg.data, "train", cfg.seed, need_prompt=need_prompt),
                                         self.per_round, cfg.seed)
            self.eval_rows = prompt_rows(cfg.data, "eval", cfg.seed, need_prompt=need_prompt)
            self.model_path = ensure_model(cfg.model.path, cfg.model.tiny, cfg.output_dir, cfg.seed)
            if cfg.teacher.path is not None:
                check_teacher(cfg, self.model_path)
        self.syncs, self.verified = 0, 0  # full-weight syncs so far; tensors the last verified one checked
        self.memory_plan = (0.0, float(cfg.trainer.gradient_checkpointing))  # as configured: nothing to say
        # One update per rollout (one epoch, one mini-batch): the old log-probs are the training forward's own.
        self.fused_old_logprobs = (a.ppo_epochs == 1 and r.prompts_per_step * r.n_samples == cfg.trainer.batch_size
                                   and a.kl_mode() != "reward")
        self.resume_from, self.resume_state = resume_point(cfg)  # before anything appends to the run folder
        self.dumps = RolloutDumps(cfg.output_dir, cfg.logging, self.resume_state["step"] if self.resume_state else -1)
        with ThreadPoolExecutor(1) as pool, clock("start_ray_tokenizer"):  # the tokenizer loads as Ray starts
            renderer = pool.submit(checked_renderer, cfg, self.model_path, self.prompts.rows, self.eval_rows)
            init_ray()
            self.renderer = renderer.result()  # a bad tokenizer fails here, before any worker starts
        self.tokenizer_path = tokenizer_source(cfg, self.model_path, self.renderer)  # saved beside every model
        self._start_workers()
        self.episodes.start(self.workers.rollout, self.renderer, self.workers.reward_model)
        self.source = rollout_source(self.workers.rollout, self.prompts, self.episodes, self._sampling,
                                     max_staleness=r.max_staleness, chunk_tokens=r.chunk_tokens,
                                     last_step=cfg.trainer.max_steps)
        if r.max_engine_restarts > 0 and not self.workers.rollout.in_trainers:  # (hybrid: a dead engine is a dead rank)
            self.workers.rollout.on_restart = lambda engine: self.source.on_restart(engine, self._engine_restarted)
        self.trained_rows = TrainedRows(cfg.output_dir)
        self.startup = {**clock.times, **self.startup, "time/start_since_launch": since_launch()}
        self.logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.trainer.max_steps, to_yaml(cfg), desc=a.name,
                                    max_new_tokens=cfg.rollout.max_new_tokens)
        self.logger.console(startup_line(self.startup))
        if self.episodes.notice() is not None:  # (agents: where the endpoint listens)
            self.logger.console(self.episodes.notice())

    def _start_workers(self) -> None:
        from rlhf.rl.startup import start_workers
        from rollout.sync import sync_channel
        from rollout.sync.buckets import plan_buckets

        cfg, r = self.cfg, self.cfg.rollout
        w = self.workers = start_workers(cfg, self.model_path, self.estimator.needs_critic)
        self.startup = w.startup
        engines_start = time.perf_counter()
        self.plan = plan_buckets(self.workers.policy.weight_specs(), r.sync_bucket_mb << 20)
        self.channel = "adapter" if w.adapter_sync else sync_channel(
            r.sync_channel, cfg.placement.mode, cfg.placement.num_gpus, r.num_engines, cfg.trainer.world_size)
        self._setup_sync()
        print(f"weight sync: {self.channel}", flush=True)
        for role, group in (("policy trainer", w.policy), ("critic", w.critic)):  # at the longest rows allowed
            said = group.memory_plan(r.max_model_len) if group is not None else None
            if said is not None:
                print(f"memory plan, {role} (trainer.plan_memory): {said}", flush=True)
        self.startup["time/start_engines"] += time.perf_counter() - engines_start

    def _setup_sync(self) -> None:
        """Form the trainer -> engines channel (again after an engine restart: its old peer is gone)."""
        from rollout.sync import setup_sync
        if self.channel != "adapter":
            self.channel = setup_sync(self.channel, self.workers.policy.actors, self.workers.rollout, self.plan,
                                      self.cfg.rollout.sync_channel == "ipc",
                                      verify=self.cfg.rollout.verify_sync_every > 0,
                                      workers=self.cfg.rollout.tensor_parallel_size)

    def _engine_restarted(self, engine: int) -> None:
        """Ray restarted a dead engine with the weights it started with: bring it to the trainer's."""
        restarts = self.workers.rollout.restarts
        self.logger.console(f"rollout engine {engine} died and Ray restarted it ({restarts} restart(s) "
                            "so far); pushing the current weights into it and redoing its share of the work")
        self._setup_sync()
        self._push_weights()

    # ---- one step, top to bottom ----
    def step(self, step: int) -> dict[str, float]:
        a = self.cfg.algorithm
        t = PhaseTimer()
        rollout, metrics, row_ids, sampled = self._collect(step, t)  # timed as rollout + reward
        shipped = self.workers.policy.ship(rollout.rows())  # put once: the step's worker calls pass its references
        with t("ref"):
            scores = self._token_scores(shipped)
        overlong, distill = self._overlong(rollout), teacher_kl(rollout, scores)  # DAPO's shaping, opd's signal
        advantages, returns, kl = self._advantages(rollout, scores, overlong, distill)
        # token-budget micro-batches: each mini-batch's rows are dealt to the ranks by length
        mini_batches = len(rollout.input_ids) // self.cfg.trainer.batch_size \
            if self.cfg.trainer.max_tokens_per_micro_batch else 0
        self.step_shape = f"{len(rollout.input_ids)} rows x {rollout.input_ids.shape[1]} tokens"  # (said if OOM)
        with t("train"):
            metrics.update(self.workers.policy.train_step(shipped, a, mini_batches,
                                                  extra=self._policy_inputs(scores, advantages)))
            if self.workers.critic is not None:
                metrics.update(self.workers.critic.train_step(shipped, a, mini_batches,
                                                      extra={"old_values": scores.old_values, "returns": returns}))
        with t("sync"):
            self._sync_weights(step)
        if self.verified:  # rollout.verify_sync_every: this step's sync was checked, tensor by tensor
            metrics["rollout/sync_verified_tensors"], self.verified = float(self.verified), 0
        metrics.update(self._rollout_metrics(rollout, kl, metrics))
        metrics["train/tokens"] = float(rollout.loss_mask.sum())  # (perf/device_s_per_token: rlhf.outputs.steps)
        if overlong is not None:
            metrics["rollout/overlong_penalty_mean"] = overlong.mean().item()
        if distill is not None:  # opd: how far the student's samples are from the teacher
            metrics["rollout/teacher_kl"] = masked_mean(distill, rollout.loss_mask).item()
        metrics.update(self.source.phase_metrics(sampled, t.times["time/rollout"]))
        self._say_memory_plan(metrics)
        self.trained_rows.write(step, row_ids)
        return {**metrics, **t.times}

    def _say_memory_plan(self, metrics: dict[str, float]) -> None:
        """trainer.plan_memory: the console says when the trainers' plan changes (their prints stay in Ray's logs)."""
        if "train/planned_tokens" not in metrics:  # (plan_memory off)
            return
        plan = (metrics["train/planned_tokens"], metrics["train/checkpointing"])
        if plan != self.memory_plan:
            rows = f"at most {plan[0]:.0f} padded tokens" if plan[0] else "trainer.micro_batch_size rows"
            self.logger.console(f"memory plan: the update's micro-batches take {rows}"
                                f"{', with gradient checkpointing' if plan[1] else ''} (trainer.plan_memory)")
        self.memory_plan = plan

    def _token_scores(self, shipped: Shipped) -> TokenScores:
        """The old policy's, the reference's and the critic's view of the rollout's tokens, each where needed."""
        w = self.workers
        old = None if self.fused_old_logprobs else w.policy.compute_logprobs(shipped)
        ref = (w.reference.compute_logprobs(shipped) if w.reference is not None
               else w.policy.compute_ref_logprobs(shipped) if w.lora_reference else None)
        values = w.critic.compute_values(shipped) if w.critic is not None else None
        teacher = w.teacher.compute_logprobs(shipped) if w.teacher is not None else None
        return TokenScores(old, ref, values, teacher)

    def _policy_inputs(self, scores: TokenScores, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the policy update reads beside the shipped rollout: the advantages, the old log-probs unless its own
        forward gives them, and the reference's when KL is a loss term."""
        a, extra = self.cfg.algorithm, {"advantages": advantages}
        if scores.old_logprobs is not None:
            extra["old_logprobs"] = scores.old_logprobs
        if scores.ref_logprobs is not None and a.kl_mode() == "loss":
            extra["ref_logprobs"] = scores.ref_logprobs
        return extra

    def _sync_weights(self, version: int) -> None:
        """After update `version` (or a resume from it), where the source lets it run (generating ahead: between
        two engine calls, which a sync sent meanwhile would wait behind)."""
        self.source.synced(self._push_weights, version)

    def _push_weights(self) -> None:
        """The trainer's new weights into every engine: the LoRA adapter alone, or all weights (ipc or broadcast)."""
        from rollout.sync import sync_weights
        policy, engines = self.workers.policy, self.workers.rollout
        engines.wake_up(["weights"])
        if self.channel == "adapter":
            engines.load_adapter(policy.export_adapter())
        else:
            every = self.cfg.rollout.verify_sync_every
            checked = bool(every) and (self.syncs + 1) % every == 0 and self.channel in ("ipc", "broadcast")
            sync_weights(policy.actors, engines, fingerprint=checked)  # only checked syncs fingerprint
            self.syncs += 1
            if checked:
                from rollout.sync.check import verify_sync
                self.verified = verify_sync(policy.actors, engines, self.channel)

    MAX_FILL_ROUNDS = 4  # dynamic sampling: rollout rounds per step before topping up with all-equal groups

    def _collect(self, step: int, t: PhaseTimer) -> tuple[RolloutBatch, dict[str, float], list[int], float]:
        """Generate and score `prompts_per_step` groups: (their rollout, metrics, their dataset rows, the tokens
        sampled in all rounds, the rollout rate's numerator; the chosen groups hold only some of them). Each round
        generates `self.per_round` groups (algorithm.oversample x prompts_per_step); when that is more, or with
        algorithm.dynamic_sampling (DAPO, Yu et al. 2025: further rounds until enough groups have signal), the step
        trains on the groups whose rewards are not all equal (an all-equal group has zero advantage), topped up
        with all-equal ones if too few."""
        a, want = self.cfg.algorithm, self.cfg.rollout.prompts_per_step
        self._offload_trainers(t)
        selecting = a.dynamic_sampling or self.per_round > want
        with self.source.engine_memory() as engines:
            if not selecting:  # the engines free the GPU for the reward and reference models as soon as they are done
                r = self._round(step, 0, t, done_generating=engines.release)
                return r.batch, r.metrics, r.row_ids, r.batch.loss_mask.sum().item()
            rounds = []
            for attempt in range(self.MAX_FILL_ROUNDS if a.dynamic_sampling else 1):
                rounds.append(self._round(step, attempt, t))
                if sum(int(r.signal.sum()) for r in rounds) >= want:
                    break
        # (asleep only now, not between rounds: a level-2 sleep discards the weights, and only a sync restores them)
        batch, metrics, row_ids = select_groups(rounds, want, self.cfg.rollout.n_samples, self.renderer.pad_id)
        metrics.update(self.source.trained(batch.samples, step))
        return batch, metrics, row_ids, sum(r.batch.loss_mask.sum().item() for r in rounds)

    def _offload_trainers(self, t: PhaseTimer) -> None:
        """trainer.offload (GPU colocation): the engines get the memory; the trainers reload on their next call."""
        if self.cfg.trainer.offload:
            with t("offload"):
                for group in (self.workers.policy, self.workers.critic):
                    if group is not None:
                        group.offload()

    def _round(self, step: int, attempt: int, t: PhaseTimer, done_generating: Callable[[], None] = lambda: None):
        """One rollout round: generate (or take what was generated ahead), then score; the first is dumped."""
        with t("rollout"):
            row_ids, samples, metrics = self.source.generate(step, attempt)
        rows = [self.prompts.rows[i] for i in row_ids]
        done_generating()
        packed = samples_to_batch(samples, self.renderer.pad_id)
        with t("reward"):
            scores, scored = self.episodes.score(rows, samples, packed)
        if attempt == 0:
            self.dumps.write(step, rows, samples, scores, self.renderer)
        return Round(row_ids, RolloutBatch.of(samples, scores, self.renderer.pad_id, packed),
                     {**metrics, **scored}, informative_groups(scores, self.cfg.rollout.n_samples))

    def _sampling(self, step: int, attempt: int) -> SamplingConfig:
        r = self.cfg.rollout
        return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              n=r.n_samples, seed=self.seed_for(step, attempt))

    def seed_for(self, step: int, attempt: int) -> Optional[int]:
        """Per-prompt sampling seeds (reproducible rollouts; on CPU by default), or None: the engine's own RNG."""
        if not self.cfg.rollout.seed_per_prompt:
            return None
        return self.cfg.seed * 1_000_003 + step * 10_007 + attempt * 101

    def _overlong(self, rollout: RolloutBatch) -> Optional[torch.Tensor]:
        """algorithm.overlong_buffer: (B,) the reward each sample loses for running into the length budget."""
        a = self.cfg.algorithm
        if not a.overlong_buffer:
            return None
        lengths = rollout.loss_mask.sum(-1)  # single-turn (validated): the completion's tokens
        return overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)

    def _advantages(self, rollout: RolloutBatch, scores: TokenScores, overlong: Optional[torch.Tensor],
                    distill: Optional[torch.Tensor]):
        """(advantages (B, L-1), the critic's returns (B, L-1) or None, the KL penalty (B, L-1) or None) by the
        algorithm's entry in algorithms.estimators, from the rewards plus the overlong penalty (and opd's teacher
        KL); the KL to the reference is estimated here only when it goes into the reward (as a loss term the
        update estimates it)."""
        a = self.cfg.algorithm
        kl = kl_estimate(scores.old_logprobs, scores.ref_logprobs, a.kl_estimator) \
            if a.kl_mode() == "reward" else None
        rewards = rollout.rewards if overlong is None else rollout.rewards + overlong
        advantages, returns = self.estimator.fn(EstimatorInputs(
            rewards, rollout.loss_mask, self.cfg.rollout.n_samples, kl=kl, kl_coef=a.kl_coef, values=scores.old_values,
            gamma=a.gamma, lam=a.lam, scale_by_std=a.scale_by_std, teacher_kl=distill, task_coef=a.opd_task_coef))
        return advantages, returns, kl

    def _rollout_metrics(self, rollout: RolloutBatch, kl: Optional[torch.Tensor],
                         trained: dict[str, float]) -> dict[str, float]:
        """The rollout's metrics; its log-prob drift (and, with KL as a loss term, its KL) came from the update,
        which holds the old log-probs."""
        diff, warn_at = trained.get("rollout/logprob_diff", 0.0), self.cfg.rollout.logprob_diff_warn
        if diff > warn_at and trained.get("rollout/staleness_max", 0) == 0:  # else it holds updates too
            self.logger.warn(f"rollout/logprob_diff = {diff:.2e} > rollout.logprob_diff_warn = {warn_at:g}: the "
                             "engines' weights or numerics differ from the trainer's (a missed sync or a stale prefix "
                             "cache shows up here)")
        alarm = agreement_alarm(trained, self.cfg.rollout.router_agreement_warn, self.cfg.algorithm.routing_replay)
        if alarm:
            self.logger.warn(alarm)
        from_rewards = self.estimator.from_rewards or self.cfg.algorithm.opd_task_coef > 0
        return {**rollout_metrics(rollout, kl, self.cfg.rollout.n_samples, from_rewards),
                "rollout/engine_restarts": float(self.workers.rollout.restarts)}

    # ---- the loop ----
    def evaluate(self) -> dict[str, float]:
        self.workers.rollout.wake_up(["kv_cache"])
        return self.episodes.evaluate(self.eval_rows, self.cfg.eval, self.cfg.seed)

    def fit(self) -> dict[str, float]:
        """The shared loop (rlhf.stages.loop.drive) over this controller's steps; returns the last metrics row."""
        return drive(self.cfg, self, self.cfg.algorithm.name, answer_metric(self.cfg), self.logger, self.resume_from,
                     self.resume_state)[1]

    # ---- the loop's hooks (rlhf.stages.loop.Stage) ----
    def initial_metrics(self) -> dict[str, float]:
        return self.startup

    def save(self, folder: str) -> None:
        w = self.workers
        w.policy.save_checkpoint(folder)
        if w.critic is not None:
            w.critic.save_checkpoint(folder)
        # with LoRA, the adapter's copy alone (policy_hf_adapter/): the base is model.path
        w.policy.save_hf(os.path.join(folder, "policy_hf"), self.tokenizer_path, merged=False)

    def driver_state(self) -> dict:
        """The data position; generating ahead, also the prompts in flight with their tokens at the last sync."""
        return self.source.state()

    def restore(self, folder: str, state: dict) -> None:
        """The checkpoint's weights and optimizer states into the workers, its weights into the engines."""
        w = self.workers
        w.policy.load_checkpoint(folder)
        if w.critic is not None:
            w.critic.load_checkpoint(folder)
        self.source.restore(state, state["step"])
        self._sync_weights(state["step"])

    def save_final(self, out: str) -> None:
        self.workers.policy.save_hf(out, self.tokenizer_path)

    def close(self) -> None:
        """Stop everything this run started. Best effort, part by part: after a worker died, shutting it down
        raises again, and that must neither mask the first error nor leave the other parts running."""
        w = self.workers
        parts = [("rollout source", self.source.close), ("episodes", self.episodes.close),
                 ("logger", self.logger.close), ("rollout engines", w.rollout.shutdown),
                 ("policy trainers", w.policy.kill)]
        parts += [(role, x.kill) for role, x in (("critic", w.critic), ("reference model", w.reference),
                                                  ("teacher", w.teacher), ("reward model", w.reward_model))
                  if x is not None]
        for role, stop in parts + [("placement group", w.placement.remove)]:
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - a dead actor raises Ray's errors; report and go on
                print(f"note: {role} did not shut down cleanly ({type(e).__name__})", file=sys.stderr)


def run_rl(cfg: RunConfig) -> dict[str, float]:
    from common.remote import WorkerDied

    controller = None
    try:
        controller = RLController(cfg)  # inside: a worker failing at start-up is reported as one failing later
        return controller.fit()
    except WorkerDied as e:
        step = getattr(controller, "step_shape", "")
        raise TrainingStopped(worker_died(e, checkpoint.latest(cfg.output_dir), step)) from None
    finally:
        if controller is not None:
            controller.close()
