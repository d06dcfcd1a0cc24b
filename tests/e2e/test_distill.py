"""On-policy distillation end to end (algorithm.name: opd): a randomly initialised student samples, the SFT model
hosted as the teacher (a ReferenceModel actor on teacher.path) scores the student's tokens, and each token's
advantage is the negative reverse-KL estimate: the student's samples move toward the teacher's distribution."""
import pytest

from rlhf.outputs.metrics import read_metrics
from tests.helpers import run_cli


@pytest.mark.slow
def test_a_random_student_moves_toward_the_teacher(sft_model, tmp_path):
    res = run_cli("--config", "examples/sort_opd.yaml", f"output_dir={tmp_path}", "model.path=null",
                  f"teacher.path={sft_model}", "trainer.max_steps=10", "trainer.lr=1e-2", "eval.every=0",
                  "data.num_eval=16", "rollout.prompts_per_step=16", "trainer.batch_size=64", "checkpoint.every=0",
                  timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    kl = [r["rollout/teacher_kl"] for r in rows[1:]]
    assert len(kl) == 10 and kl[0] > 1.0, kl  # a random model's tokens are unlikely under the teacher
    assert max(kl[-3:]) < 0.7 * kl[0], kl
    assert "rollout/signal_frac" not in rows[1]  # the rewards play no part: no warning about groups without signal
