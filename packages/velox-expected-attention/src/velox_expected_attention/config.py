"""Settings of the Expected Attention cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import check_bool, check_float, check_int

__all__ = ["ExpectedAttentionConfig", "check_scoring"]


def check_scoring(
    n_future_positions, use_covariance, use_vnorm, epsilon
) -> tuple[int, bool, bool, float]:
    """Expected Attention's own settings, checked (each error names the setting and what it
    may be): ``n_future_positions`` an int >= 1, ``use_covariance`` and ``use_vnorm`` True or
    False, ``epsilon`` a finite number >= 0."""
    n = check_int("n_future_positions", n_future_positions, minimum=1)
    cov = check_bool("use_covariance", use_covariance)
    vnorm = check_bool("use_vnorm", use_vnorm)
    eps = check_float("epsilon", epsilon, minimum=0.0)
    return n, cov, vnorm, eps


@dataclass
@rope_fields
class ExpectedAttentionConfig(EvictionConfig):
    """Expected Attention (arXiv 2510.00636, kvpress's ``ExpectedAttentionPress``) settings:
    the shared eviction settings (:class:`~velox_core.cache.eviction.EvictionConfig`), with
    kvpress's defaults for its own.

    Attributes:
        budget: tokens kept per KV head: the sinks, the body of highest expected attention
            and the window (kvpress: ``compression_ratio``, a share of the context).
        sinks: first tokens always kept, whose queries are also left out of the statistics
            (kvpress's ``n_sink``, 4).
        window: most recent tokens always kept, unscored (0: kvpress has none).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (None: kvpress's prefill press, the prompt only).
        n_future_positions: the future queries' RoPE is averaged over this many positions
            after the newest token (kvpress: 512).
        use_covariance: add the queries' covariance term ``k^T Sigma k / 2d`` (kvpress: True).
        use_vnorm: rescale the scores as ``(score + epsilon) * ||v||`` (kvpress: True).
        epsilon: added to the scores before the value-norm rescaling (kvpress: 0.0).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16).
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a cache made by hand
            (``mlx.nn.RoPE``'s settings), to turn its queries back to pre-RoPE; unset with a
            model, whose layer's RoPE ``make_cache`` reads (:mod:`velox_core.codec.prerope`).
    """

    sinks: int = 4
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_scoring(self.n_future_positions, self.use_covariance, self.use_vnorm, self.epsilon)
        check_rope_settings(**rope_settings(self))
