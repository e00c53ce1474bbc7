"""The test aids' own contracts: what they set and restore, and what they refuse (their use is
exercised by every package's tests)."""

from __future__ import annotations

import numpy as np
import pytest

from velox_core.kernels import config
from velox_core.kernels.merge import MERGE
from velox_testing import kernel_env, scratch_dir, tiny_model
from velox_testing.emulate import EmulatedKernels, Emulator
from velox_testing.models import tiny_config


def test_kernel_env_puts_the_setting_in_force_and_monkeypatch_restores_it():
    before = config.kernel_config()
    mp = pytest.MonkeyPatch()
    try:
        record = kernel_env(mp, "VELOX_KERNELS", "0")
        assert record.enabled is False
        assert config.kernel_config() is record
        record = kernel_env(mp, "VELOX_DECODE_WARPS", "2")  # the environment's whole record
        assert (record.decode_warps, record.enabled) == (2, False)
        assert config.kernel_config() is record
    finally:
        mp.undo()
    assert config.kernel_config() == before


def test_kernel_env_refuses_what_is_not_a_kernel_setting(monkeypatch):
    with pytest.raises(ValueError, match="VELOX_SHARED is not a kernel setting"):
        kernel_env(monkeypatch, "VELOX_SHARED", "/tmp")
    with pytest.raises(ValueError, match="VELOX_DECODE_WARPS must be an integer"):
        kernel_env(monkeypatch, "VELOX_DECODE_WARPS", "many")


def test_scratch_dir_is_a_new_folder_per_call():
    a, b = scratch_dir("velox-t-"), scratch_dir("velox-t-")
    assert a != b and a.is_dir() and b.is_dir() and a.name.startswith("velox-t-")


def test_tiny_config_takes_overrides_and_refuses_an_unknown_family():
    cfg = tiny_config("qwen3", num_hidden_layers=3)
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 3
    assert tiny_config("mistral")["model_type"] == "mistral"
    with pytest.raises(ValueError, match="unknown family 'gpt9'"):
        tiny_model("gpt9")


def test_emulator_refuses_inputs_unlike_the_registered_kernel_before_compiling(tmp_path):
    emu = Emulator(tmp_path)
    parts = [np.zeros((1, 1, 2, 1, 8), np.float32), np.zeros((1, 1, 2, 1, 2), np.float32)]
    handle = emu.kernel(MERGE, parts, ["float32"] * 3)
    shapes = [(1, 1, 1, 8), (1, 1, 1, 1), (1, 1, 1, 1)]
    with pytest.raises(ValueError, match="do not match the registered kernel's signature"):
        emu.run(handle, [parts[0].astype(np.float16), parts[1]], shapes, (32, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match="init_value must be None or 0"):
        emu.run(handle, parts, shapes, (32, 1, 1), (32, 1, 1), init=1.0)
    assert not list(tmp_path.glob("emu_*"))  # refused before any compile


def test_emulated_kernels_take_metal_or_cuda_only(tmp_path):
    with pytest.raises(ValueError, match="backend must be 'metal' or 'cuda'"):
        EmulatedKernels(tmp_path, backend="vulkan")
