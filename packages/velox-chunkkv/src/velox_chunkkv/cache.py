"""``ChunkKVCache``: ChunkKV's eviction (optionally with ``Uniform`` codes of the kept tokens).

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_chunkkv.ChunkKVPolicy`:
after each prefill chunk (and, with ``every``, during decode) the stored tokens are cut to
``budget`` per KV head, keeping the observation window and the whole chunks of consecutive
tokens it votes for most; every KV head of a layer keeps the same chunks. With ``reuse > 1``
the ChunkKV layers of a model go in runs of ``reuse`` adjacent layers, and each layer of a
run keeps the chunks its first layer chose (the paper's layer-wise index reuse):
``velox_core.make_cache(model, ...)`` and ``load_cache`` link them (:meth:`link_layers`); a
cache made alone chooses its own. Attention must be routed to the cache
(``velox_core.routed(model)`` or ``velox_core.generate``) for the policy to see the queries;
see :mod:`velox_chunkkv.policy` for the mechanism and the deviations from the paper.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.eviction import EvictionCache
from velox_core.policy.voting import VOTE_PARAMS

from .config import ChunkKVConfig, check_chunk_length, check_reuse
from .policy import ChunkKVPolicy

__all__ = ["ChunkKVCache"]

# the settings a follower must share with its leader for the leader's kept positions to be
# its own choice's equal in kind (the same tokens always kept, the same budget and cadence)
_SAME = ("budget", "sinks", "window", "every", "observe", "chunk_length", "reuse")


class ChunkKVCache(EvictionCache):
    """ChunkKV's cache for one layer. Parameters: see :class:`ChunkKVConfig`."""

    method = "chunkkv"
    Config = ChunkKVConfig
    Policy = ChunkKVPolicy
    policy_params = (*VOTE_PARAMS, "chunk_length")

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        # ChunkKV's own counts first: NaN or inf there is a count out of range, said so
        if "chunk_length" in params:
            check_chunk_length(params["chunk_length"])
        if "reuse" in params:
            check_reuse(params["reuse"])
        self.leader: ChunkKVCache | None = None
        super().__init__(flush=flush, check_finite=check_finite, **params)

    # -- layer-wise index reuse ---------------------------------------------------------------
    def follow(self, leader: ChunkKVCache | None) -> None:
        """Keep the positions ``leader`` keeps at each cut (None: choose on its own)."""
        self.leader = leader
        self.policy.follow(None if leader is None else leader.policy)

    @classmethod
    def link_layers(cls, caches: list) -> None:
        """Runs of ``reuse`` adjacent ChunkKV layers, in model order, follow the first of
        their run. Layers left to the model's own cache or given another method are skipped
        (adjacency is among the ChunkKV layers); a layer whose settings differ from the
        run's first (``layers={...}`` overrides) starts a run of its own."""
        ours = [c for c in caches if isinstance(c, ChunkKVCache)]
        for c in ours:
            c.follow(None)
        leader, members = None, 0
        for c in ours:
            same = leader is not None and all(
                getattr(c.cfg, n) == getattr(leader.cfg, n) for n in _SAME
            )
            if same and members < leader.cfg.reuse:
                c.follow(leader)
                members += 1
            else:
                leader, members = c, 1

    def __deepcopy__(self, memo) -> ChunkKVCache:
        """One ``deepcopy`` of a model's caches links the copies as the originals are linked
        (a layer copied without its leader chooses on its own)."""
        out = self.copy()
        memo[id(self)] = out
        lead = self.leader
        if lead is not None and id(lead) in memo:
            out.follow(memo[id(lead)])
        return out

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "it sums the votes of all the layer's KV heads per chunk and keeps the same chunks "
        "in every head"
    )
