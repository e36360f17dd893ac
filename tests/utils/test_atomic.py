"""Atomic directory writes: a failed write leaves the destination as it was and no staging directory."""
import pytest

from miles_k3.utils.atomic import atomic_directory


def test_success_replaces_only_when_overwrite(tmp_path):
    dest = tmp_path / "ckpt"
    with atomic_directory(dest) as d:
        (d / "a.txt").write_text("one")
    assert (dest / "a.txt").read_text() == "one"
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"), atomic_directory(dest):
        pass
    with atomic_directory(dest, overwrite=True) as d:
        (d / "b.txt").write_text("two")
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or old directory left


def test_failure_inside_the_block_keeps_the_previous_directory(tmp_path):
    dest = tmp_path / "ckpt"
    with atomic_directory(dest) as d:
        (d / "a.txt").write_text("one")
    with pytest.raises(RuntimeError, match="crash"), atomic_directory(dest, overwrite=True) as d:
        (d / "a.txt").write_text("half-written")
        raise RuntimeError("crash")
    assert (dest / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "x").write_text("not a dir")
    with pytest.raises(FileExistsError, match="not a directory"), atomic_directory(tmp_path / "x", overwrite=True):
        pass
