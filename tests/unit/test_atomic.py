"""atomic.py: a file or directory is either the old complete one or the new complete one."""

from __future__ import annotations

import os

import pytest

from megazero.atomic import atomic_dir, atomic_write, commit_dir, existing_dir, prepare_dir, recover_dir, write_text


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "f.txt")
    write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_write(path, "w") as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_directory_is_replaced_whole(tmp_path):
    path = str(tmp_path / "d")
    atomic_dir(path, lambda tmp: write_text(os.path.join(tmp, "a"), "1"))
    atomic_dir(path, lambda tmp: write_text(os.path.join(tmp, "b"), "2"))
    assert os.listdir(path) == ["b"] and sorted(os.listdir(tmp_path)) == ["d"]
    with pytest.raises(ValueError):
        atomic_dir(path, lambda tmp: (write_text(os.path.join(tmp, "c"), "3"), int("x")))
    assert os.listdir(path) == ["b"] and sorted(os.listdir(tmp_path)) == ["d"]


def test_kill_between_the_two_renames_is_recovered(tmp_path):
    """commit_dir renames the old version aside, then the new one in: a kill between the two
    leaves PATH.old, which readers use and the next writer restores before replacing."""
    path = str(tmp_path / "iter_0000003")
    atomic_dir(path, lambda tmp: write_text(os.path.join(tmp, "v"), "old"))
    tmp = prepare_dir(path)
    write_text(os.path.join(tmp, "v"), "new")
    os.replace(path, path + ".old")  # the first rename, then the kill
    assert open(os.path.join(existing_dir(path), "v")).read() == "old"
    recover_dir(path)
    assert open(os.path.join(path, "v")).read() == "old" and existing_dir(path) == path
    prepare_dir(path)  # a new attempt starts from a clean temporary
    write_text(os.path.join(path + ".tmp", "v"), "new")
    commit_dir(path)
    assert open(os.path.join(path, "v")).read() == "new" and sorted(os.listdir(tmp_path)) == ["iter_0000003"]
