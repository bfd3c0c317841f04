"""lib/atomic.py: a file appears whole or not at all, and a failed write leaves nothing beside it."""
import os
import stat

import pytest

from lib.atomic import write_atomic


def test_replaces_whole_with_the_mode_asked(tmp_path):
    p = tmp_path / "state.json"
    write_atomic(p, "old")
    write_atomic(p, b"new", mode=0o600)
    assert p.read_text() == "new" and stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "verified.json"
    target.mkdir()                                  # os.replace cannot put a file over a directory
    with pytest.raises(OSError):
        write_atomic(target, b"{}")
    assert target.is_dir() and os.listdir(tmp_path) == ["verified.json"]
