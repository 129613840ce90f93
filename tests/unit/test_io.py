"""longdoc.io: atomic files and folders appear complete or not at all, readable, in UTF-8."""

from __future__ import annotations

import stat

import pytest

from longdoc.io import atomic_write_text, building_dir


def test_text_is_written_as_utf8(tmp_path):
    path = atomic_write_text(tmp_path / "r.md", "Müller § 3 — résumé\n")
    assert path.read_bytes().decode("utf-8") == "Müller § 3 — résumé\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.md"]


def test_a_built_folder_replaces_the_old_one_and_is_readable(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with building_dir(target) as tmp:
        assert not tmp.samefile(target.parent) and tmp.parent == tmp_path
        (tmp / "model.safetensors").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_failed_build_leaves_the_old_folder(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="killed"):
        with building_dir(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (target / "old.txt").read_text() == "old"
