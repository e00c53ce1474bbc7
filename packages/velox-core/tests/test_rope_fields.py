"""``velox_core.codec.prerope.rope_fields``: the standalone RoPE settings appended to a
config dataclass after its own fields."""

import dataclasses
import inspect

import pytest

from velox_core.codec.prerope import ROPE_SETTINGS, check_rope_settings, rope_fields, rope_settings


@dataclasses.dataclass
@rope_fields
class _Config:
    bits: int = 4
    pre_rope: bool = True

    def __post_init__(self):
        check_rope_settings(**rope_settings(self))


def test_fields_follow_the_class_own_with_the_rope_defaults():
    names = [f.name for f in dataclasses.fields(_Config)]
    assert names == ["bits", "pre_rope", *ROPE_SETTINGS]
    assert list(inspect.signature(_Config).parameters) == names
    cfg = _Config(2, True, 10000.0)  # positional order as declared: own fields, then RoPE
    assert (cfg.bits, cfg.rope_base) == (2, 10000.0)
    assert rope_settings(_Config()) == {
        "pre_rope": True,
        "rope_base": None,
        "rope_traditional": False,
        "rope_scale": 1.0,
        "rope_dims": None,
    }


def test_settings_are_checked_by_the_config():
    with pytest.raises(ValueError, match="need rope_base"):
        _Config(rope_dims=64)
    with pytest.raises(ValueError, match="need pre_rope=True"):
        _Config(pre_rope=False, rope_base=10000.0)


def test_a_class_declaring_a_rope_setting_is_refused():
    with pytest.raises(TypeError, match="already declares rope_scale"):

        @rope_fields
        class _Twice:
            rope_scale: float = 2.0
