"""The test aids' own contracts: what they set and restore, and what they refuse (their use is
exercised by every package's tests)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_core import make
from velox_core.kernels import config
from velox_core.kernels.merge import MERGE
from velox_core.policy.view import Tokens
from velox_testing import (
    CacheConformance,
    assert_exact_ends,
    assert_reloads_alike,
    kernel_env,
    scratch_dir,
    tiny_model,
)
from velox_testing.emulate import EmulatedKernels, Emulator
from velox_testing.kernel_path import compile_instantiation
from velox_testing.models import tiny_config
from velox_testing.refusals import int_refusals, named_refusals, share_refusals


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


class _Held:
    """A cache as the eviction aids read it: 2 sinks, a body of chosen positions per KV head
    (row 0) and a window of 3, of 20 tokens seen; ``attend`` reads every token of ``k, v``."""

    def __init__(self, k=None, v=None):
        self.k, self.v = k, v
        self.policy_view = SimpleNamespace(
            body_positions=lambda: [mx.array([[4, 9, 11]]), mx.array([[5, 6, 12]])],
            protected=lambda: (
                Tokens(None, None, mx.array([0, 1], dtype=mx.int32)),
                Tokens(None, None, mx.array([17, 18, 19], dtype=mx.int32)),
            ),
        )

    def attend(self, q, scale):
        return mx.fast.scaled_dot_product_attention(q, self.k, self.v, scale=scale)


def test_kept_and_stored_positions_read_body_sinks_and_window():
    c = _Held()
    assert ev.kept_positions(c, 1) == {5, 6, 12} and ev.kept_positions(c, 0, below=10) == {4, 9}
    assert ev.stored_positions(c, 0) == {0, 1, 4, 9, 11, 17, 18, 19}


def test_assert_attends_to_fails_on_tokens_the_cache_does_not_read():
    k, v, q = ev.attention_data(20, seed=1)
    c = _Held(k, v)
    ev.assert_attends_to(c, q[:, :, -1:], k, v, lambda h: range(20), 0.125)
    with pytest.raises(AssertionError):
        ev.assert_attends_to(c, q[:, :, -1:], k, v, lambda h: range(19), 0.125)


def test_attention_data_is_seeded_and_sharp_scales_the_queries():
    k, v, q = ev.attention_data(8, r=3, seed=4)
    assert k.shape == v.shape == (1, 2, 8, 64) and q.shape == (1, 6, 8, 64)
    assert all(mx.array_equal(a, b) for a, b in zip((k, v, q), ev.attention_data(8, r=3, seed=4)))
    flat = ev.attention_data(8, r=3, seed=4, sharp=0.5)[2]
    assert mx.allclose(flat, q * 0.5).item()


def test_pool1d_reference_pools_with_zero_padding_and_refuses_other_poolings():
    x = np.array([1.0, 4.0, 2.0, 0.0])
    assert refs.pool1d_reference(x, 3, "max").tolist() == [4.0, 4.0, 4.0, 2.0]
    assert np.allclose(refs.pool1d_reference(x, 3, "avg"), [5 / 3, 7 / 3, 2.0, 2 / 3])
    with pytest.raises(ValueError, match="pooling='sum' must be 'avg' or 'max'"):
        refs.pool1d_reference(x, 3, "sum")


def test_compile_instantiation_refuses_a_backend_it_has_no_compiler_for(tmp_path):
    with pytest.raises(ValueError, match="backend must be 'metal' or 'cuda', got 'vulkan'"):
        compile_instantiation("vulkan", [], tmp_path)


def test_named_int_and_share_refusals_write_the_entries():
    assert named_refusals(theta=[0.0, "x"], window=0, prior=[[1, 2]]) == (
        ({"theta": 0.0}, "theta"),
        ({"theta": "x"}, "theta"),
        ({"window": 0}, "window"),
        ({"prior": [1, 2]}, "prior"),
    )
    assert int_refusals(iters=(0, 64), seed=(None, None)) == (
        ({"iters": -1}, "iters must be >= 0"),
        ({"iters": 65}, "iters must be <= 64"),
        ({"iters": 0.5}, "iters must be an int"),
        ({"iters": 0.0}, "iters must be an int"),
        ({"seed": 0.5}, "seed must be an int"),
        ({"seed": 0.0}, "seed must be an int"),
    )
    with pytest.raises(TypeError, match="give \\(minimum, maximum\\)"):
        int_refusals(iters=0)
    values = [next(iter(s.values())) for s, match in share_refusals("recent")]
    assert {match for _, match in share_refusals("recent")} == {"recent"}
    assert values[:5] == [-1, -0.5, 1.0, 2.5, True] and None in values


def test_the_suite_fails_on_a_setting_its_class_accepts():
    class Uniform(CacheConformance):
        spec = "uniform:bits=4"

    Uniform.bad_settings = int_refusals(group=(1, None))
    Uniform().test_bad_settings()
    Uniform.bad_settings = int_refusals(group=(2, None))  # group=1 is a group
    with pytest.raises(pytest.fail.Exception, match="group.*1.*was accepted"):
        Uniform().test_bad_settings()


def test_exact_ends_and_reloads_check_the_cache(tmp_path):
    sinks, body, window = assert_exact_ends(make("uniform:bits=4,sinks=16,window=40"), 0.3)
    assert sinks.tokens == 16 and sinks.tokens + body.tokens + window.tokens == 700
    with pytest.raises(AssertionError):  # 4-bit codes are not that close
        assert_exact_ends(make("uniform:bits=4,sinks=16,window=40"), 1e-6)
    c = make("uniform:bits=4")
    loaded = assert_reloads_alike(c, tmp_path / "c.safetensors")
    assert loaded.offset == c.offset == 600
