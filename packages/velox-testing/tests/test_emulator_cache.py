"""The emulator's shared binary cache (``VELOX_EMU_CACHE``): emulators of different workdirs
build a program once, and a change to a shim header builds it again."""

from __future__ import annotations

import shutil
import stat

import pytest

from velox_testing import emulate, emulate_build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


class _Tiny(emulate.Emulator):
    """An emulator whose program is a fixed one including a header of ``headers``."""

    def __init__(self, workdir, headers):
        super().__init__(workdir)
        self.headers = headers

    def source(self) -> str:
        return '#include "tiny.h"\nint main() { return TINY; }\n'

    def _include_dirs(self):
        return [self.headers]


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """``$CXX`` set to g++ behind a script counting its calls; returns the count's file."""
    log = tmp_path / "calls"
    script = tmp_path / "cxx"
    script.write_text(f'#!/bin/sh\necho x >> "{log}"\nexec g++ "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    return log


def _calls(log) -> int:
    return len(log.read_text().split()) if log.exists() else 0


def test_shared_folder_builds_once_and_again_after_a_header_change(tmp_path, monkeypatch, counted):
    headers, shared = tmp_path / "inc", tmp_path / "shared"
    headers.mkdir()
    (headers / "tiny.h").write_text("#define TINY 0\n")
    monkeypatch.setenv(emulate_build.CACHE_ENV, str(shared))
    first = _Tiny(tmp_path / "a", headers).build()
    second = _Tiny(tmp_path / "b", headers).build()
    assert first == second and first.parent == shared and first.is_file()
    assert _calls(counted) == 1
    # only the binary stays: no source or partial build left beside it
    assert [p.name for p in shared.iterdir()] == [first.name]
    (headers / "tiny.h").write_text("#define TINY 1\n")
    third = _Tiny(tmp_path / "c", headers).build()
    assert third != first and _calls(counted) == 2


def test_without_the_folder_each_workdir_builds_its_own(tmp_path, monkeypatch, counted):
    headers = tmp_path / "inc"
    headers.mkdir()
    (headers / "tiny.h").write_text("#define TINY 0\n")
    monkeypatch.delenv(emulate_build.CACHE_ENV, raising=False)
    a = _Tiny(tmp_path / "a", headers).build()
    b = _Tiny(tmp_path / "b", headers).build()
    assert a.parent == tmp_path / "a" and b.parent == tmp_path / "b"
    assert _calls(counted) == 2
    assert _Tiny(tmp_path / "a", headers).build() == a and _calls(counted) == 2


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch, counted):
    headers, shared = tmp_path / "inc", tmp_path / "shared"
    headers.mkdir()
    (headers / "tiny.h").write_text("#error broken\n")
    monkeypatch.setenv(emulate_build.CACHE_ENV, str(shared))
    with pytest.raises(RuntimeError, match="emulator compile failed"):
        _Tiny(tmp_path / "a", headers).build()
    assert list(shared.iterdir()) == []
