"""`cedlm.util.atomic_directory`: the one writer of model and checkpoint directories."""
from __future__ import annotations

import os
import stat

import pytest

from cedlm.util import atomic_directory


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_new_directory_appears_whole_with_umask_permissions(tmp_path):
    dst = tmp_path / "out" / "model"
    with atomic_directory(dst) as tmp:
        assert tmp.parent == dst.parent and not dst.exists()
        (tmp / "a.txt").write_text("a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
        os.chmod(tmp / "a.txt", 0o600)                     # as mkstemp leaves a file
    mask = os.umask(0)
    os.umask(mask)
    assert (dst / "a.txt").read_text() == "a" and (dst / "sub" / "b.txt").read_text() == "b"
    assert _mode(dst / "a.txt") == 0o666 & ~mask and _mode(dst) == 0o777 & ~mask
    assert _mode(dst / "sub") == 0o777 & ~mask
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model"]     # no temp or old dir left


def test_an_existing_directory_is_replaced(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with atomic_directory(dst) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in dst.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_write_leaves_the_old_directory_and_no_temp(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(dst) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert [p.name for p in dst.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_an_atomically_written_file_has_umask_permissions(tmp_path, mask):
    """A file written whole (the graph store's graphs, estimates, exports) is readable by whoever a
    plain `open` would let read it: a cache folder shared by a group needs umask 002's 0o664."""
    from cedlm.util import atomic_write_bytes
    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "g.pt2", b"graph")
    finally:
        os.umask(old)
    assert (tmp_path / "g.pt2").read_bytes() == b"graph" and _mode(tmp_path / "g.pt2") == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["g.pt2"]
