"""Evaluation data: the reference model and its held-out text, the user's text, recall prompts.

The held-out split of the reference corpus (Python standard-library files never seen in
training) ships in ``shared/data/heldout.jsonl.gz``; ``--data FILE`` evaluates on any text.
Recall prompts are drawn like the reference model's training pairs
(``tools/train_reference_model.py``): a line ``NAME = 12345`` at some depth of a code context
and ``assert NAME ==`` at its end; the model must produce the value.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from velox_core import environment
from velox_core.artifacts import token_stream

__all__ = ["RecallPrompt", "find_shared", "load_text", "recall_prompts", "token_stream"]

_FALLBACK_WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "lamp",
    "garden",
    "silver",
    "orbit",
    "maple",
    "candle",
    "harbor",
    "pepper",
    "copper",
    "meadow",
    "tiger",
    "violet",
    "anchor",
    "canyon",
    "ember",
    "falcon",
    "glacier",
    "hazel",
    "island",
    "jungle",
    "kettle",
    "lemon",
    "marble",
    "nickel",
    "olive",
    "pillow",
    "quartz",
    "rocket",
    "saddle",
    "tunnel",
    "velvet",
    "walnut",
    "yellow",
)


def find_shared(*parts: str) -> Path | None:
    """A path under the repository's ``shared/`` (searched from the working directory up),
    or under ``$VELOX_SHARED``; None if absent."""
    roots = environment.paths("VELOX_SHARED")
    here = Path.cwd().resolve()
    roots += [p / "shared" for p in (here, *here.parents)]
    roots.append(Path(__file__).resolve().parents[4] / "shared")  # a source checkout
    for r in roots:
        p = r.joinpath(*parts)
        if p.exists():
            return p
    return None


def load_text(data: str | None) -> list[str]:
    """Documents to evaluate on: the lines of ``heldout.jsonl.gz`` or a user's text file."""
    if data is not None:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"--data: no such file {data!r}")
        if path.suffix == ".gz" or path.name.endswith(".jsonl"):
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                return [json.loads(line)["text"] for line in f if line.strip()]
        return [path.read_text(encoding="utf-8", errors="replace")]
    path = find_shared("data", "heldout.jsonl.gz")
    if path is None:
        raise FileNotFoundError(
            "held-out data not found (shared/data/heldout.jsonl.gz); pass --data FILE"
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _words(tokenizer) -> list[str]:
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    words = sorted(
        w[1:]
        for w in vocab
        if w[:1] in ("Ġ", "▁") and w[1:].isalpha() and w[1:].islower() and 4 <= len(w) - 1 <= 8
    )
    return words[:2000] if len(words) >= 50 else list(_FALLBACK_WORDS)


@dataclass
class RecallPrompt:
    """One retrieval trial: prompt tokens, the expected value, the context length and depth."""

    tokens: list[int]
    value: str
    answer_tokens: int
    length: int
    depth: float

    def correct(self, text: str) -> bool:
        m = re.search(r"\d+", text)
        return m is not None and m.group(0) == self.value


def recall_prompts(
    tokenizer,
    stream: np.ndarray,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int = 1234,
) -> list[RecallPrompt]:
    """Recall trials: for each length and depth, ``trials`` prompts cut from ``stream``."""
    rng = np.random.default_rng(seed)
    words = _words(tokenizer)
    out = []
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    for n in lengths:
        for depth in depths:
            for _ in range(trials):
                a, b = rng.choice(len(words), size=2, replace=False)
                name = f"{words[a]}_{words[b]}".upper()
                value = str(int(rng.integers(10000, 100000)))
                d, q = enc(f"\n{name} = {value}\n"), enc(f"\nassert {name} ==")
                body = n - len(d) - len(q)
                if body < 8 or len(stream) <= body:
                    raise ValueError(f"recall length {n} is too short or longer than the data")
                start = int(rng.integers(0, len(stream) - body))
                ctx = [int(t) for t in stream[start : start + body]]
                at = int(depth * len(ctx))
                out.append(
                    RecallPrompt(
                        ctx[:at] + d + ctx[at:] + q, value, len(enc(f" {value}\n")), n, depth
                    )
                )
    return out
