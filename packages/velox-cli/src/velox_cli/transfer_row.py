"""The transfer row of ``velox bench`` (``--transfer-mapper DIR --transfer-source MODEL``).

The bench's model (the target) decodes from another model's cache (the source) mapped by a
velox-transfer mapper, instead of running its own prefill. For each bench sample, the source
prefills the first ``context - 1`` prefix tokens into mlx-lm ``KVCache``; the mapper turns
that cache into the target's (float16 storage, as the ``fp16`` row's); the target runs the
last prefix token (a cache holds no logits) and the teacher-forced continuation. Its
distributions are compared with the ``fp16`` reference as every other row's are (KL, top-1,
perplexity). Retrieval is the same for each recall prompt, then greedy decoding. Bytes are
the transferred caches' resident bytes; peak memory includes the source model's prefill,
which runs in the same process. Prefill tok/s is the prefix tokens over the time of
the mapping plus the target's last prefix token: the source's own prefill is not timed, since
in the use it serves (a session switching models) the source has already run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from velox_core import routed

from .evaluate import Reference, Row, Tally, greedy, prefill, recall_accuracy, teacher_force
from .specs import StoredKVCache

__all__ = ["TransferRow", "open_transfer"]

PROBE = "def transfer(cache):\n    return {'tokens': 42, 'text': \"Grüße\"}\n"


@dataclass
class TransferRow:
    """A loaded mapper and its source model, ready to measure against the bench's model."""

    mapper: Any  # velox_transfer.Mapper
    source: Any  # the source mlx-lm model
    source_path: str
    mapper_path: str
    store: mx.Dtype | None  # the bench's cache storage dtype (None: the model's)

    @property
    def spec(self) -> str:
        """The row's label: what decodes from what."""
        return f"transfer:source={Path(self.source_path).name}"

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source_path,
            "mapper": self.mapper_path,
            "mapper_version": self.mapper.version,
        }

    def _caches(self, model: Any, prefix: list[int], chunk: int) -> tuple[list, float]:
        """The target's caches of ``prefix[:-1]`` mapped from the source's, and the seconds
        the mapping took."""
        from velox_transfer import transfer_cache

        src = [KVCache() for _ in self.mapper.source.layers]
        prefill(self.source, src, prefix[:-1], chunk)
        t0 = time.perf_counter()
        empty = [
            StoredKVCache(self.store) if self.store is not None else KVCache()
            for _ in self.mapper.target.layers
        ]
        out = transfer_cache(src, self.mapper, empty, model=model, dtype=self.store or mx.float32)
        return out, time.perf_counter() - t0

    def measure(
        self, model: Any, tokenizer: Any, samples, ref: Reference, prompts, chunk: int = 512
    ) -> Row:
        """The row: quality on the bench's samples, retrieval on its recall prompts."""
        context = len(samples[0][0])
        row = Row(
            self.spec,
            "transfer",
            {**self.describe(), "mapped_tokens": context - 1},
            context,
        )
        tally = Tally(row, ref)
        for i, (prefix, cont) in enumerate(samples):
            mx.clear_cache()
            mx.reset_peak_memory()
            caches, t_map = self._caches(model, prefix, chunk)
            t0 = time.perf_counter()
            with routed(model):
                logits = model(mx.array([[int(prefix[-1])]]), cache=caches)[:, -1]
                mx.eval(logits)
                t1 = time.perf_counter()
                lp = teacher_force(model, caches, logits, cont)
            t2 = time.perf_counter()
            if i == 0:
                tally.first(caches, int(mx.get_peak_memory()))
            # its prefill: the mapping and the last prefix token (the source's own prefill is
            # not counted: in use the source has already run it)
            tally.add(i, lp, prefix, cont, t_map + (t1 - t0), t2 - t1)
            del caches
        tally.finish()
        row.retrieval, row.retrieval_by_length = self._retrieval(model, tokenizer, prompts, chunk)
        row.peak_memory = int(mx.get_peak_memory())  # since the last sample (source included)
        return row

    def _retrieval(self, model, tokenizer, prompts, chunk) -> tuple[float, dict[str, float]]:
        """Exact-match recall decoding from each prompt's transferred cache."""

        def answer(p) -> list[int]:
            caches, _ = self._caches(model, p.tokens, chunk)
            with routed(model):
                logits = model(mx.array([[int(p.tokens[-1])]]), cache=caches)[:, -1]
                return greedy(model, caches, logits, p.answer_tokens)

        return recall_accuracy(prompts, tokenizer, answer)


def open_transfer(
    mapper_path: str,
    source_path: str,
    model: Any,
    tokenizer: Any,
    store: mx.Dtype | None,
    load_model: Callable[[str], tuple],
) -> TransferRow:
    """Load the source model (with the bench's ``load_model``) and the mapper, checked against
    both models, before any row runs.

    Raises:
        ValueError: velox-transfer not installed, a mapper that is not for this pair (its
            ``MapperError``), or a source whose tokenizer is not the bench model's.
        FileNotFoundError: no such source model.
    """
    try:
        from velox_transfer import load_mapper
    except ImportError:
        raise ValueError(
            "--transfer-mapper needs velox-transfer: pip install ./packages/velox-transfer"
        ) from None
    source, src_tok, _, resolved = load_model(source_path)
    mapper = load_mapper(mapper_path, source=source, target=model)
    if src_tok.encode(PROBE) != tokenizer.encode(PROBE):
        raise ValueError(
            f"--transfer-source {source_path}: its tokenizer is not the bench model's; a "
            "transferred cache maps token by token, so both must share one"
        )
    return TransferRow(mapper, source, str(resolved), str(mapper_path), store)
