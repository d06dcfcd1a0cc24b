"""The console a person watches: a short line per logged step, warnings that name what to do, plain off a terminal."""
import io

from rlhf.outputs.console import Console, duration, step_line, warnings_for

ROW = {"rollout/reward_mean": 0.421875, "policy/entropy": 0.31, "rollout/response_len": 38.25,
       "rollout/truncated_frac": 0.03125, "rollout/signal_frac": 0.5, "time/step": 40.93,
       "perf/rollout_tokens_per_s": 321.4, "policy/loss": 0.0123, "train/lr": 2e-5, "time/sync": 0.7,
       "eval/accuracy": 0.546875, "eval/exact_match": 0.0, "eval/pass@1": 0.47, "eval/pass@4": 0.84, "eval/pass@2": 0.7}


def test_a_step_line_holds_what_a_person_watches_and_the_time_left():
    line = step_line(10, 20, ROW, left_s=410.0)
    assert line == ("step 10/20  reward 0.422  eval acc 0.547  entropy 0.310  len 38.2  cut 3%  signal 50%  "
                    "s/step 40.9  tok/s 321  pass@1 0.470  pass@2 0.700  pass@4 0.840  left 6:50")
    assert "train/lr" not in line and "sync" not in line  # the full row is in metrics.jsonl, not here
    assert step_line(20, 20, {"time/step": 1.0, "rollout/reward_mean": float("nan")}, left_s=0.0) == \
        "step 20/20  s/step 1.0"
    # logging.trace: the mean idle fraction of the workers (util/bubble), the step's one utilisation number
    assert step_line(3, 20, {"time/step": 2.0, "util/bubble": 0.483}, left_s=None) == "step 3/20  s/step 2.0  idle 48%"


def test_warnings_name_the_setting_to_change():
    assert warnings_for(ROW) == []
    cut, few = warnings_for({"rollout/truncated_frac": 0.75, "rollout/signal_frac": 0.125}, max_new_tokens=64)
    assert cut.startswith("75% of the completions were cut at rollout.max_new_tokens = 64")
    assert few.startswith("only 12% of the prompt groups") and "algorithm.oversample" in few


def test_off_a_terminal_the_console_prints_plain_lines(capsys):
    console = Console(total_steps=3, desc="grpo", stream=io.StringIO())  # not a tty: no bar, no colour
    with console.phase("evaluating"):
        console.line("step 1/3  reward 0.5")
    console.warn("most completions were cut")
    for seconds in (4.0, 2.0, 3.0):
        console.advance(seconds)
    console.close()
    assert capsys.readouterr().out == "step 1/3  reward 0.5\nWARNING most completions were cut\n"
    assert console.left_s(1) == 6.0  # the median step, twice more


def test_durations_read_as_clock_times():
    assert (duration(59.6), duration(410), duration(3725)) == ("1:00", "6:50", "1:02:05")
