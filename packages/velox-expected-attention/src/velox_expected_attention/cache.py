"""``ExpectedAttentionCache``: Expected Attention eviction (arXiv 2510.00636) as a velox preset.

The cache is a :class:`velox_core.VeloxCache` with an
:class:`~velox_expected_attention.ExpectedAttentionPolicy`: after each prefill chunk (and,
with ``every``, during decode) the stored tokens are cut to ``budget`` per KV head, keeping
the ``sinks`` first tokens (kvpress's ``n_sink``), the ``window`` newest ones and, between
them, the tokens the queries to come are expected to attend to most (times their value
norm). The policy sees the queries only through velox attention
(``velox_core.routed(model)`` or ``velox_core.generate``); see
:mod:`velox_expected_attention.policy` for the mechanism and the deviations from kvpress.
kvpress keeps fp16 tokens; ``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache
from velox_core.codec.prerope import ROPE_SETTINGS

from .config import ExpectedAttentionConfig
from .policy import ExpectedAttentionPolicy

__all__ = ["ExpectedAttentionCache"]


class ExpectedAttentionCache(EvictionCache):
    """Expected Attention's cache for one layer. Parameters: see
    :class:`ExpectedAttentionConfig`."""

    method = "expected-attention"
    Config = ExpectedAttentionConfig
    Policy = ExpectedAttentionPolicy
    policy_params = (
        "budget",
        "every",
        "n_future_positions",
        "use_covariance",
        "use_vnorm",
        "epsilon",
        *ROPE_SETTINGS,
    )
