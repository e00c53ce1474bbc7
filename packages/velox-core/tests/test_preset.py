"""The pieces method packages share: ``PresetCache``'s default ``build`` over ``make_codecs``,
``CodeWidths``, ``config_fields``, ``check_optional`` and ``Method.of``."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from velox_core import CodeWidths, Method, PresetCache, Uniform, config_fields
from velox_core.validation import check_optional, check_widths


@dataclass
class _Config(CodeWidths):
    bits: int = 3
    group: int = 16
    window: int = 0
    sinks: int = 0
    layer: int | None = None

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_optional(self, "layer", minimum=0)


class _Cache(PresetCache):
    method = "preset-probe"
    Config = _Config

    def make_codecs(self, cfg, kb, vb):
        return Uniform(kb, cfg.group), Uniform(vb, cfg.group)


class _NoCodecs(PresetCache):
    method = "preset-none"
    Config = _Config


def test_code_widths_resolve_each_side_from_bits():
    assert _Config().widths == (3, 3)
    assert _Config(key_bits=4).widths == (4, 3)
    assert _Config(bits=2, value_bits=8).widths == (2, 8)
    # the subclass's own default for bits, and the shared fields first, in order
    assert [f for f in _Config.__dataclass_fields__][:3] == ["bits", "key_bits", "value_bits"]


def test_default_build_takes_make_codecs_at_the_resolved_widths():
    cache = _Cache(bits=2, key_bits=4)
    key_codec, value_codec = cache.tiers[0].key_codec, cache.tiers[0].value_codec
    assert (key_codec.bits, value_codec.bits) == (4, 2)
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, 40, 16)), dtype=mx.float16)
    cache.update_and_fetch(k, k)
    assert cache.offset == 40 and cache.config()["key_bits"] == 4


def test_a_cache_without_make_codecs_or_build_says_which_to_define():
    with pytest.raises(NotImplementedError, match=r"make_codecs\(config, kb, vb\) or build"):
        _NoCodecs()


def test_check_optional_accepts_none_and_rejects_below_minimum():
    assert _Config(layer=None).layer is None
    assert _Config(layer=0).layer == 0
    with pytest.raises(ValueError, match="layer must be >= 0"):
        _Config(layer=-1)
    with pytest.raises(TypeError, match="layer must be an int"):
        _Config(layer=1.5)


def test_config_fields_copies_the_named_fields():
    assert config_fields(_Config(group=8), "group", "bits") == {"group": 8, "bits": 3}


def test_method_of_takes_the_name_from_the_cache_class():
    method = Method.of(_Cache, "probe", paper="https://arxiv.org/abs/0000.00000")
    assert (method.name, method.cache_class, method.summary) == ("preset-probe", _Cache, "probe")
    assert method.paper.endswith("0000.00000")
