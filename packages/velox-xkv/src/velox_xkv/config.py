"""Settings of the xKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import check_bool, check_int

__all__ = ["XKVConfig"]


@dataclass
@rope_fields
class XKVConfig:
    """xKV (arXiv 2503.18893) settings.

    Attributes:
        layer_group: adjacent layers that share one token latent (the paper's layer group
            size ``G``): layers ``0..G-1``, ``G..2G-1``, ... of the model (the last group may be
            smaller). A cache used alone is a group of one (the paper's single-layer SVD).
        key_rank: width of the group's key latent: the rank kept of the cross-layer SVD of the
            group's pre-RoPE keys (the authors' ``rank_k``, for the whole group). The stored
            width is ``min(key_rank, G * kv_heads * head_dim, tokens)``.
        value_rank: the same for the values (the authors' ``rank_v``).
        pre_rope: factorize keys before RoPE (the paper); False factorizes post-RoPE keys,
            which lets attention score keys in the latent without rebuilding them.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache
            (``mlx.nn.RoPE`` settings). Leave ``rope_base`` unset with a model:
            ``make_cache`` binds each layer's own RoPE.
    """

    layer_group: int = 2
    key_rank: int = 192
    value_rank: int = 256
    pre_rope: bool = True

    def __post_init__(self):
        check_int("layer_group", self.layer_group, minimum=1)
        check_int("key_rank", self.key_rank, minimum=1)
        check_int("value_rank", self.value_rank, minimum=1)
        check_bool("pre_rope", self.pre_rope)
        check_rope_settings(**rope_settings(self))
