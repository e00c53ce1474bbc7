"""``KVzipPolicy``: the retention policy of a KVzip cache (arXiv 2505.23416).

KVzip (Kim et al., *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*)
scores each cached context KV pair by how much the model needs it to reconstruct the
context, and evicts the lowest-scored pairs once; the compressed cache then serves any later
query. The scores need the model: a second forward over a repeat prompt and the context
itself. So the policy does not cut as tokens arrive; :func:`velox_kvzip.compress` runs that
forward after the prefill and asks each layer's policy for its scores:

* :meth:`KVzipPolicy.begin` names the chunk being reconstructed, :meth:`observe` (called by
  ``VeloxCache.attend`` with the reconstruction tokens' post-RoPE queries, so only under
  ``velox_core.routed``; once per piece of the input) scores its context pairs
  (:func:`~velox_kvzip.score.chunk_scores`, the max over the pieces) and :meth:`take`
  hands the scores over;
* :meth:`done` records that the cache was compressed; every later token is kept (the paper
  compresses the context once and reuses it).

Before :func:`~velox_kvzip.compress` the cache keeps every token (decoding past ``budget``
uncompressed warns once per process). See :mod:`velox_kvzip.compress` for the deviations
from the paper.
"""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.validation import check_int

from .config import HEADS, PROMPT, PROMPT_NEXT, budget_share, check_prompts, kept_tokens
from .score import chunk_scores

__all__ = ["KVzipPolicy"]

_WARNED: set[str] = set()  # once per process


class KVzipPolicy(RetentionPolicy):
    """KVzip's retention policy for one layer (settings: :class:`~velox_kvzip.KVzipConfig`).

    Args:
        budget: tokens kept per KV head on average (an int), or ``"P%"`` of the context.
        every: None only (KVzip cuts once, in :func:`velox_kvzip.compress`).
        heads, chunk, prompt, prompt_next, overlap, suffix: as in the config.
    """

    name = "kvzip"
    settings = ("heads", "chunk", "prompt", "prompt_next", "overlap", "suffix")

    def __init__(
        self,
        budget: int | str = 1024,
        every: int | None = None,
        heads: str = "global",
        chunk: int = 2048,
        prompt: str = PROMPT,
        prompt_next: str = PROMPT_NEXT,
        overlap: int = 8,
        suffix: str = "\n",
    ):
        if every is not None:
            raise ValueError(f"every={every!r}: KVzip cuts once, in compress; pass None")
        self.share = budget_share(budget)
        super().__init__(None if self.share is not None else budget, None)
        self._given = budget
        if heads not in HEADS:
            raise ValueError(f"heads must be one of {', '.join(map(repr, HEADS))}; got {heads!r}")
        self.heads = heads
        self.chunk = check_int("chunk", chunk, minimum=1)
        check_prompts(prompt, prompt_next, suffix, overlap)
        self.prompt, self.prompt_next, self.suffix = prompt, prompt_next, suffix
        self.overlap = overlap
        self.compressed = False
        self._job: tuple[int, int, int, int] | None = None  # (sink, start, end, context)
        self._part: mx.array | None = None

    def config(self) -> dict[str, Any]:
        return {**super().config(), "budget": self._given}

    def describe(self) -> str:
        """``kvzip(budget=...,heads=...,chunk=...)``, the texts only where they are not the
        defaults (quoted)."""
        defaults = {"prompt": PROMPT, "prompt_next": PROMPT_NEXT, "suffix": "\n"}
        args = [
            f"{k}={v!r}" if k in defaults else f"{k}={v}"
            for k, v in self.config().items()
            if k != "every" and defaults.get(k) != v
        ]
        return f"{self.name}({','.join(args)})"

    def kept(self, context: int) -> int:
        """Tokens per KV head this policy keeps of a ``context``-token context."""
        return kept_tokens(self._given, context)

    # -- the cache's hooks ---------------------------------------------------------------------
    def before_update(self, view, incoming: int) -> None:
        """Never cuts: KVzip cuts in :func:`velox_kvzip.compress`. A decode step over an
        uncompressed cache past its budget warns, once per process."""
        self._chunk_pending = False
        if self.compressed or self._job is not None or incoming != 1 or _WARNED:
            return
        if view.size() > self.kept(view.offset):
            _WARNED.add("decode")
            warnings.warn(
                f"kvzip: decoding over {view.size()} uncompressed tokens (budget "
                f"{self._given}): KVzip cuts only in velox_kvzip.compress(model, caches, "
                "tokens, tokenizer), run after the prefill (velox eval, velox generate and "
                "velox bench run it)",
                UserWarning,
                stacklevel=4,
            )

    def observe(self, view, queries: mx.array, scale: float) -> None:
        """During a reconstruction chunk (:meth:`begin`), score its context pairs (the max
        over this call's queries and the earlier pieces')."""
        if self._job is None:
            return
        keys, _ = view.keys_and_values()  # nothing is evicted yet: index = position
        got = chunk_scores(queries, keys, scale, *self._job)
        self._part = got if self._part is None else mx.maximum(self._part, got)
        # evaluated here, layer by layer: left to the end of the model's call, every layer's
        # decoded keys and weight blocks would be held at once, above fp16's prefill peak
        mx.eval(self._part)

    @staticmethod
    def after_prefill(model, tokenizer, caches: list, tokens) -> None:
        """The step velox's commands take once a prompt is prefilled
        (``velox_cli.evaluate.after_prefill``): :func:`velox_kvzip.compress`."""
        from .compress import compress

        compress(model, caches, tokens, tokenizer)

    # -- driven by velox_kvzip.compress ----------------------------------------------------------
    def begin(self, sink: int, start: int, end: int, context: int) -> None:
        """The next attention calls' queries reconstruct context tokens ``[start, end)`` of a
        ``context``-token context."""
        self._job, self._part = (sink, start, end, context), None

    def pending(self) -> mx.array | None:
        """This chunk's scores so far, float32 ``(B, H, end - start)`` (None: no query)."""
        return self._part

    def take(self) -> mx.array | None:
        """This chunk's scores (as :meth:`pending`); the chunk is over."""
        part, self._job, self._part = self._part, None, None
        return part

    def done(self, budget: int) -> None:
        """The cache was cut to ``budget`` tokens per KV head; nothing more is cut."""
        self.compressed, self.budget = True, budget

    # -- state ---------------------------------------------------------------------------------
    def meta(self) -> Any:
        return {**super().meta(), "compressed": self.compressed, "kept": self.budget}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        super().set_state(state, meta)
        meta = meta or {}
        self.compressed = bool(meta.get("compressed", False))
        if self.compressed:
            kept = meta.get("kept")
            if isinstance(kept, bool) or not isinstance(kept, int) or kept < 1:
                raise ValueError(f"kvzip: a compressed cache's kept tokens must be >= 1: {kept}")
            self.budget = kept
