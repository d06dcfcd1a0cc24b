"""The ipc channel's /dev/shm staging files: created new (O_EXCL) and private (0600) whatever the umask, their
space reserved at once so a small /dev/shm fails by name (not as a SIGBUS at the first sync), and nothing left
behind when reserving fails."""
import errno
import os
import stat

import pytest

from rollout.sync import ipc


def test_staging_files_are_private_whatever_the_umask():
    old = os.umask(0o002)  # in the real /dev/shm
    try:
        buf, path = ipc.allocate_shared(1 << 16)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and buf.numel() == 1 << 16
    assert os.stat(path).st_blocks * 512 >= 1 << 16  # reserved, not a sparse file
    ipc.unlink_file(path)


def test_a_full_shm_is_a_clear_error_and_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(ipc, "SHM_DIR", str(tmp_path))
    calls = []

    def full(fd, offset, length):
        calls.append(length)
        if len(calls) == 2:  # the second buffer of a sender does not fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    plan = [[ipc.TensorSpec("w", (1024,), "torch.float32")]]
    with pytest.raises(RuntimeError, match=r"cannot reserve 0.0 MiB in .*No space left on device.*--shm-size.*"
                                           r"rollout.sync_bucket_mb.*rollout.sync_channel=broadcast"):
        ipc.IpcSender(None, 0, [0], plan)
    assert os.listdir(tmp_path) == []  # the first buffer's file is gone too
