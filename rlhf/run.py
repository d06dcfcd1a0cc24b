"""Command-line entry point: `python -m rlhf.run --config FILE [dotted.key=value ...]`.

Bad input (config, data, reward function) ends with exit code 2 and a one-paragraph message, never a traceback;
a run that stops itself (consecutive NaN/Inf steps) ends with exit code 3 and a message.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading

from common.errors import TrainingStopped, UserError
from rlhf.config import RunConfig, load_config, to_yaml
from rlhf.config.resolve import precision_facts


def _stage_runner(stage: str):
    if stage == "sft":
        from rlhf.stages.sft import run_sft
        return run_sft
    if stage == "dpo":
        from rlhf.stages.preference import run_dpo
        return run_dpo
    if stage == "rm":
        from rlhf.stages.preference import run_rm
        return run_rm
    if stage == "rl":
        from rlhf.rl.controller import run_rl
        return run_rl
    raise UserError(f"stage = {stage!r} has no runner")


def run(cfg: RunConfig):
    """The stage, on a config from load_config (its machine-dependent defaults resolved: what it saves is what ran)."""
    from rlhf.outputs.run_identity import run_lock
    with run_lock(cfg.output_dir):  # one run per folder
        return _stage_runner(cfg.stage)(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML recipe, e.g. examples/sort_sft.yaml")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                        help="print every config key (or a section's, e.g. rollout) with its type, default, allowed "
                             "values and meaning, and exit")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.lr=1e-4")
    args = parser.parse_args(argv)
    try:
        if args.help_config is not None:
            from rlhf.config.doc import help_text
            print(help_text(args.help_config), end="")
            return 0
        cfg = load_config(args.config, args.overrides)
        if cfg.stage == "rl":  # what the config alone cannot say: the user's code loads, the host can run it
            from rlhf.rl.preflight import preflight
            preflight(cfg)
        _, line, warning = precision_facts(cfg)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        print(line, flush=True)
        run(cfg)
    except (UserError, TrainingStopped) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def exit_now(code: int) -> None:
    """End the process with `code` once a run's work is done: wait for its other threads, run the atexit handlers
    (Ray's shutdown, logging's flush, ...) and flush stdout/stderr, then leave without the interpreter's teardown.
    That teardown frees every module and object one by one and gains nothing at the end of a process
    (benchmarks/startup.py --exits fast,full measures the difference)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
