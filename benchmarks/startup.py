"""Where a run's start-up goes: `python -m rlhf.run` launched a few times (GRPO, the tiny model, one step), each
part of its start-up as it logs them with step 0 (time/start_*), the seconds from launch to the end of start-up,
and the whole run's wall time; with its own local Ray (the default) and joining a Ray that is already running (as
under `ray job submit`, or in the test suite); and the seconds from the run's last line ("grpo done: ...") to the
process's end (`exit`: stopping the workers, Ray's shutdown, the interpreter's).

    python benchmarks/startup.py [--repeats 3] [--engines 1] [--ranks 1] [--placements colocate,hybrid]
                                 [--exits fast,full]

Prints the median of each column over the repeats, per mode and placement (`hybrid`: each engine inside its
trainer rank's process, one engine per rank; the placements alternate launch by launch). The parts overlap
(trainers and engines load at once; the tokenizer loads while Ray starts), so they do not add up to the total.
`--exits fast,full` alternates `python -m rlhf.run` (rlhf.run.exit_now: no interpreter teardown) with the same
`main()` left to the interpreter's usual exit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.helpers import print_table  # noqa: E402
from common.remote import python_path  # noqa: E402


ENTRY = {"fast": ["-m", "rlhf.run"],  # what users run: exit_now after main()
         "full": ["-c", "import sys; from rlhf.run import main; sys.exit(main(sys.argv[1:]))"]}


def launch(model: str, out: str, ranks: int, engines: int, env: dict, placement: str = "colocate",
           exit_mode: str = "fast") -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *ENTRY[exit_mode], "--config", "examples/sort_grpo.yaml",
                             f"model.path={model}", f"output_dir={out}", "trainer.max_steps=1", "eval.every=0",
                             "data.num_eval=16", "rollout.prompts_per_step=16", "trainer.batch_size=128",
                             f"trainer.world_size={ranks}", f"rollout.num_engines={engines}", "checkpoint.every=0",
                             "logging.tensorboard=false", f"placement.mode={placement}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    done = None
    for line in proc.stdout:
        if " done: " in line:
            done = time.perf_counter()
    if proc.wait() != 0 or done is None:
        raise SystemExit(f"the run in {out} failed (exit {proc.returncode})")
    end = time.perf_counter()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    return {**{k[len("time/start_"):]: v for k, v in first.items() if k.startswith("time/start_")},
            "exit": end - done, "wall": end - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--placements", default="colocate", help="comma-separated placement.mode values to compare")
    p.add_argument("--exits", default="fast", help="comma-separated: fast (python -m rlhf.run), full (the "
                                                   "interpreter's usual exit after main())")
    args = p.parse_args()
    placements, exits = args.placements.split(","), args.exits.split(",")

    import secrets

    from benchmarks.helpers import build
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    os.environ.update(RAY_AUTH_MODE=env["RAY_AUTH_MODE"], RAY_AUTH_TOKEN=env["RAY_AUTH_TOKEN"])
    import ray  # after the auth settings: Ray reads them on import
    root = tempfile.mkdtemp(prefix="rlhf-startup-")
    model = build("1M", root)
    # One mode after the other, not alternating: a local Ray starts slower while another one runs.
    runs: dict[tuple[str, str, str], list[dict]] = {}

    def launches(mode: str, env: dict) -> None:
        for i in range(args.repeats):
            for placement in placements:
                for exit_mode in exits:
                    runs.setdefault((mode, placement, exit_mode), []).append(
                        launch(model, os.path.join(root, f"{mode[:3]}-{placement}-{exit_mode}-{i}"), args.ranks,
                               args.engines, env, placement, exit_mode))
    launches("own local Ray", env)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    launches("joining a running Ray", dict(env, RAY_ADDRESS=ray.get_runtime_context().gcs_address))
    ray.shutdown()
    first = next(iter(runs.values()))[0]
    columns = [k for k in first if k not in ("since_launch", "exit", "wall")] + ["since_launch", "exit", "wall"]
    print(f"GRPO, 1M model, {args.ranks} trainer rank(s), {args.engines} engine(s), one step; median of "
          f"{args.repeats} launches, seconds:")
    print_table(["Ray", "placement", "exit mode"] + columns,
                [list(key) + [statistics.median(r.get(c, 0.0) for r in rs) for c in columns]
                 for key, rs in runs.items()])


if __name__ == "__main__":
    main()
