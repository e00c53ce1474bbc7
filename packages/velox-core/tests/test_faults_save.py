"""A save that fails midway leaves the previous file intact (issue 55)."""

import os

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from velox_core import load_cache, make, save_cache
from velox_testing import kv_data


def _filled(cache, t=40, seed=0):
    k, v = kv_data(t=t, seed=seed)
    cache.update_and_fetch(k, v)
    return cache


def _good_file(tmp_path):
    path = tmp_path / "cache.safetensors"
    save_cache(path, [_filled(make("uniform:bits=4")), _filled(KVCache())], {"run": "1"})
    return path


def _assert_untouched(path, before):
    assert path.read_bytes() == before
    caches, meta = load_cache(path, return_metadata=True)
    assert len(caches) == 2 and meta == {"run": "1"}
    assert sorted(os.listdir(path.parent)) == [path.name], "a temporary file was left behind"


def test_writer_failing_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    path = _good_file(tmp_path)
    before = path.read_bytes()
    real = mx.save_safetensors

    def killed(file, arrays, metadata=None):
        # the writer gets as far as truncating and half-writing its target, then dies
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", killed)
    with pytest.raises(OSError, match="disk full"):
        save_cache(path, [_filled(make("uniform:bits=2"), seed=1)])
    monkeypatch.setattr(mx, "save_safetensors", real)
    _assert_untouched(path, before)


def test_interrupt_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C during a long save) cleans up the same way."""
    path = _good_file(tmp_path)
    before = path.read_bytes()

    def interrupted(file, arrays, metadata=None):
        with open(file, "wb") as f:
            f.write(b"\0" * 16)
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_cache(path, [_filled(KVCache())])
    monkeypatch.undo()
    _assert_untouched(path, before)


def test_successful_save_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = _good_file(tmp_path)
    save_cache(path, [_filled(make("uniform:bits=2"), seed=2)], {"run": "2"})
    caches, meta = load_cache(path, return_metadata=True)
    assert len(caches) == 1 and meta == {"run": "2"}
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_save_into_a_relative_path_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_cache("here.safetensors", [_filled(KVCache())])
    assert len(load_cache("here.safetensors")) == 1
    assert sorted(os.listdir(tmp_path)) == ["here.safetensors"]


def test_save_through_a_symlink_replaces_its_target(tmp_path):
    real = _good_file(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real.name)
    save_cache(link, [_filled(KVCache())], {"run": "2"})
    assert link.is_symlink() and load_cache(real, return_metadata=True)[1] == {"run": "2"}
    assert sorted(os.listdir(tmp_path)) == ["cache.safetensors", "link.safetensors"]
