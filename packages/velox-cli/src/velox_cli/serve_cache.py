"""``velox serve``'s prompt cache: mlx-lm's ``LRUPromptCache`` held within
``--prompt-cache-bytes`` after every insertion, with an entry a request reuses made the most
recent, a longer entry's prefix reused wherever its caches keep a trimmed prefix
(:func:`trims_to_prefix`), and the counts ``GET /v1/velox`` reports (see
:mod:`velox_cli.serve`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
from typing import Any

__all__: list[str] = []


def trims_to_prefix(prompt_cache: list) -> bool:
    """Whether every layer cache of ``prompt_cache`` can be trimmed to a shorter prompt's
    prefix: mlx-lm's ``is_trimmable``, or a velox cache's ``reuses_prefix`` (coded tokens
    stay coded: ``VeloxCache.reuses_prefix``). mlx-lm asks ``is_trimmable`` alone, which most
    velox caches answer False (a trim is not exactly the cache that never saw the tokens), so
    its server reuses no prefix of a longer entry of theirs."""

    def one(c) -> bool:
        reuses = getattr(c, "reuses_prefix", None)
        return c.is_trimmable() or (reuses is not None and reuses())

    return all(one(c) for c in prompt_cache)


@functools.cache
def _prompt_cache_class():
    """:class:`VeloxPromptCache`, built on mlx-lm's ``LRUPromptCache`` once it is imported."""
    from mlx_lm.models.cache import LRUPromptCache

    class _Order(LRUPromptCache.CacheOrder):
        """mlx-lm's eviction order, counting the entries it gives up (``pop`` evicts; an
        entry replaced or made redundant by a longer one leaves through ``remove``)."""

        def __init__(self):
            super().__init__()
            self.popped = 0

        def pop(self):
            out = super().pop()
            self.popped += 1
            return out

    class VeloxPromptCache(LRUPromptCache):
        """mlx-lm's prompt cache held within ``max_bytes`` (``--prompt-cache-bytes``) after
        every insertion, least recently used first, with an entry a request reuses made the
        most recent; measured and read under a lock (the HTTP threads read it while the
        generation thread changes it)."""

        def __init__(self, max_size: int = 10, max_bytes: int | None = None):
            super().__init__(max_size, (1 << 63) if max_bytes is None else max_bytes)
            self.budget = max_bytes
            self._lru = _Order()
            self._lock = threading.RLock()
            self.peak_nbytes = 0

        def _reused(self, model, tokens) -> tuple[Any, int, int] | None:
            """``(key, trimmed, reused)``: the entry a request for ``tokens`` copies, how many
            of its last tokens the copy drops and how many of ``tokens`` it holds; None where
            no entry serves. mlx-lm's choice, with :func:`trims_to_prefix` in place of its
            ``can_trim_prompt_cache``."""
            found = self._trie.search(model, tokens)
            if found.exact is not None:
                return found.exact, 0, len(tokens)
            short = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > short:
                entry = self._trie.get(found.model, found.longer)
                if trims_to_prefix(entry.prompt_cache):
                    prefix = min(len(tokens) - 1, found.common_prefix)
                    return found.longer, len(found.longer) - prefix, prefix
            return (found.shorter, 0, short) if short > 0 else None

        def fetch_nearest_cache(self, model, tokens):
            with self._lock:
                reused = self._reused(model, tokens)
                if reused is None:
                    return None, tokens
                key, trimmed, n = reused
                entry = self._trie.get(model, key)
                self._lru.remove(model, key)
                self._lru.push(model, key, entry.cache_type)
                cache = copy.deepcopy(entry.prompt_cache)
            for c in cache if trimmed else ():
                c.trim(trimmed)
            return cache, tokens[n:]

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            with self._lock:
                if self.budget is not None and sum(c.nbytes for c in prompt_cache) > self.budget:
                    self._lru.popped += 1  # never stored: mlx-lm would evict every entry,
                    return  # then this one
                exact = all(c.is_trimmable() for c in prompt_cache)
                if exact or not trims_to_prefix(prompt_cache):
                    super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
                else:
                    self._insert_dropping_prefixes(model, tokens, prompt_cache, cache_type)
                self.peak_nbytes = max(self.peak_nbytes, self._n_bytes)

        def _insert_dropping_prefixes(self, model, tokens, prompt_cache, cache_type):
            """Store an entry whose caches keep a trimmed prefix and drop the entries that
            are prefixes of it, before the limits evict anything (as mlx-lm does for a
            trimmable entry: this one serves their requests)."""
            limits = self.max_size, self.max_bytes
            self.max_size = self.max_bytes = 1 << 63
            try:
                super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            finally:
                self.max_size, self.max_bytes = limits
            for n, entry in self._trie.pop_prefixes(model, tokens):
                self._n_bytes -= entry.nbytes
                self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
                self._lru.remove(model, tokens[:n])
            super().trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)

        def trim_to(self, *, n_sequences=None, n_bytes=None):
            with self._lock:
                super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

        def resident_nbytes(self) -> int:
            """The stored velox caches' bytes, measured now."""
            with self._lock:
                return sum(
                    c.nbytes
                    for lru in self._lru._lrus.values()
                    for model, tokens in lru
                    for c in self._trie.get(model, tokens).prompt_cache
                )

        def info(self) -> dict:
            with self._lock:
                by_model: dict[Any, list] = {}
                for lru in self._lru._lrus.values():
                    for model, tokens in lru:
                        by_model.setdefault(model, []).append(tokens)
                return {
                    "sequences": len(self),
                    "sessions": sum(_sessions(keys) for keys in by_model.values()),
                    "resident_bytes": int(self.resident_nbytes()),
                    "max_bytes": self.budget,
                    "max_sequences": self.max_size,
                    "peak_resident_bytes": int(self.peak_nbytes),
                    "evicted": self._lru.popped,
                    "by_type": self.stats_by_type(),
                }

    return VeloxPromptCache


def _sessions(keys: list) -> int:
    """How many of ``keys`` (token lists) are no prefix of another: the distinct sequences a
    request can resume. mlx-lm stores a batched request's prompt when its prefill ends and
    the prompt with its answer when it finishes; a cache that cannot be trimmed keeps both
    entries, which are one session."""
    ordered = sorted(tuple(k) for k in keys)
    # a key that is a prefix of another is a prefix of the key sorted right after it
    return sum(1 for a, b in itertools.pairwise(ordered) if b[: len(a)] != a) + bool(ordered)


def _budgeted_prompt_cache(original):
    """``ResponseGenerator.__init__`` given a :class:`VeloxPromptCache` of mlx-lm's
    ``--prompt-cache-size`` and ``--prompt-cache-bytes`` in place of mlx-lm's cache, which
    ``mlx_lm.server.run`` makes without the byte limit."""

    def __init__(self, model_provider, prompt_cache):
        cls = _prompt_cache_class()
        if not isinstance(prompt_cache, cls):
            budget = getattr(model_provider.cli_args, "prompt_cache_bytes", None)
            prompt_cache = cls(prompt_cache.max_size, budget)
        original(self, model_provider, prompt_cache)

    return __init__
