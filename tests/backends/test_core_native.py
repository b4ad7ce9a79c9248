"""pnmix._native: where native libraries are looked for, and the one-line reason when absent."""

import pytest

from pnmix import _native
from pnmix.errors import PnMixError


def test_missing_library_gives_a_one_line_reason():
    ok, reason = _native.library_status("pnmix_no_such_library")
    assert not ok
    assert "libpnmix_no_such_library.so not found" in reason and "cmake -S plugins" in reason
    assert "\n" not in reason
    with pytest.raises(PnMixError, match="not found"):
        _native.load_library("pnmix_no_such_library")


def test_env_dir_is_searched_first(tmp_path, monkeypatch):
    fake = tmp_path / _native.library_filename("pnmix_fake")
    fake.write_bytes(b"not an ELF file")
    monkeypatch.setenv("PNMIX_LIB_DIR", str(tmp_path))
    assert _native.search_dirs()[0] == tmp_path
    path, reason = _native.find_library("pnmix_fake")
    assert path == fake and reason == ""
    # found but unloadable: the reason names the file
    with pytest.raises(PnMixError, match="cannot load .*pnmix_fake"):
        _native.load_library("pnmix_fake")


def test_subfolders_of_a_build_are_searched(tmp_path, monkeypatch):
    sub = tmp_path / "cuda"
    sub.mkdir()
    (sub / _native.library_filename("pnmix_fake2")).write_bytes(b"")
    monkeypatch.setenv("PNMIX_LIB_DIR", str(tmp_path))
    assert _native.find_library("pnmix_fake2")[0] == sub / _native.library_filename("pnmix_fake2")


def test_search_order_is_env_package_then_builds(monkeypatch):
    monkeypatch.delenv("PNMIX_LIB_DIR", raising=False)
    dirs = _native.search_dirs()
    assert dirs[0] == _native.PACKAGE_DIR / "lib"
    assert dirs[1] == _native.REPO_DIR / "build" / "dev"
    assert dirs[2] == _native.REPO_DIR / "build"
