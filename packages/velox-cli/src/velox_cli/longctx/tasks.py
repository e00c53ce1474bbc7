"""The long-context tasks: RULER-style prompts generated offline from a seed.

Each task hides facts ("needles") in a haystack of ``length`` tokens and asks for them at
the end; a model answers greedily after an answer prefix and is scored by string match, as
RULER scores (arXiv 2404.06654): the share of the expected strings found in the answer (one
string for the single-answer tasks, so 1 or 0: exact match). The haystacks ship with
velox-cli (``haystack/prose.txt.gz``: CPython's documentation prose; ``code.txt.gz``:
standard-library modules; ``tools/make_haystacks.py`` makes them), or are RULER's repeated
"noise" sentences, so every machine builds the same prompts from the same seed and tokenizer.

Tasks (``name`` or ``name:key=value,...``, like method specs):

- ``passkey``: one pass key (``digits`` digits) at a depth, asked at the end (the passkey
  test of Mohtashami and Jaggi, RULER's niah_single).
- ``multikey``: ``keys`` needles "One of the special magic numbers for KEY is: N." with
  distinct keys; one is asked, the others are distractors (niah_multikey).
- ``multivalue``: one key with ``values`` numbers at spread depths; all are asked
  (niah_multivalue).
- ``multiquery``: ``keys`` needles, ``queries`` of them asked at once (niah_multiquery).
- ``vartrack``: a chain of ``hops`` assignments ``VAR B = VAR A`` from ``VAR A = N`` spread
  through the context, plus ``chains - 1`` distractor chains; every variable holding N is
  asked (RULER's variable tracking).
- ``cwe``: aggregation: a numbered list of words in which ``common`` words appear ``freq``
  times and the rest ``rare`` times, after one solved example (RULER's common-words
  extraction, few-shot).

The depth of the asked needle runs evenly from 0 to 1 over a task's prompts; everything else
(haystack offset, keys, values, distractor depths) comes from the seed.

A prompt is cut in two: ``context`` (instruction and haystack with its needles) and
``question`` (the question and the answer prefix). Where the question goes is the
evaluation's choice (:mod:`velox_cli.longctx.run`): after the compressed context (the cache is
compressed without knowing the question, kvpress's protocol) or inside the prompt the cache
compresses (query-aware: a method such as SnapKV votes with the question's queries).
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from .needles import _INTRO, TASKS, TaskSpec, _cwe, _needles, parse_task

__all__ = [
    "HAYSTACKS",
    "TASKS",
    "TEMPLATES",
    "Prompt",
    "TaskSpec",
    "make_prompts",
    "parse_task",
    "score",
]

HAYSTACKS = ("prose", "code", "noise")
TEMPLATES = ("raw", "chat")

_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass
class Prompt:
    """One trial: the context and question as token ids, the expected strings, where the
    asked needle sits (0: start of the haystack, 1: its end) and the haystack's name."""

    task: str
    length: int  # the target length in tokens (context + question)
    context: list[int]
    question: list[int]
    answers: list[str]
    depth: float
    haystack: str
    max_new: int  # greedy tokens to decode for the answer
    text: str = ""  # the whole prompt as text (context + question)

    @property
    def tokens(self) -> int:
        return len(self.context) + len(self.question)

    def score(self, output: str) -> float:
        return score(output, self.answers)


def score(output: str, answers: list[str]) -> float:
    """RULER's ``string_match_all``: the share of ``answers`` found in ``output`` (case
    ignored). Numbers must stand alone (``12345`` is not found in ``123456``)."""
    low = output.lower()
    hits = 0
    for a in answers:
        pat = re.escape(a.lower())
        if a.isdigit():
            pat = rf"(?<!\d){pat}(?!\d)"
        hits += re.search(pat, low) is not None
    return hits / len(answers)


@cache
def haystack_text(name: str) -> str:
    """The text of a shipped haystack (``prose`` or ``code``), or the repeated noise."""
    if name == "noise":
        return _NOISE * 2000
    if name not in HAYSTACKS:
        raise ValueError(f"unknown haystack {name!r}; haystacks: {', '.join(HAYSTACKS)}")
    data = resources.files("velox_cli.longctx").joinpath("haystack", f"{name}.txt.gz")
    return gzip.decompress(data.read_bytes()).decode("utf-8")


def _units(name: str) -> list[str]:
    """The haystack cut where a needle may go: sentences of prose and noise, lines of code."""
    text = haystack_text(name)
    if name == "code":
        return [line + "\n" for line in text.split("\n")]
    return [s for s in re.split(r"(?<=[.!?])(\s+)", text) if s]


class _Builder:
    """Token counts of haystack units, for cutting a haystack of a given token length."""

    def __init__(self, tokenizer, haystack: str):
        self.tok = tokenizer
        self.name = haystack
        self.units = _units(haystack)
        self.counts = np.array(
            [len(self.enc(u)) for u in self.units] if haystack != "noise" else [], dtype=np.int64
        )
        if haystack == "noise":
            n = len(self.enc(self.units[0] + self.units[1])) / 2
            self.counts = np.full(len(self.units), max(1, round(n / 2)), dtype=np.int64)

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def take(self, tokens: int, rng: np.random.Generator) -> list[str]:
        """Consecutive units (wrapping around) from a seeded start, about ``tokens`` long."""
        start = int(rng.integers(0, len(self.units)))
        out, n, i = [], 0, start
        while n < tokens:
            out.append(self.units[i % len(self.units)])
            n += int(self.counts[i % len(self.units)])
            i += 1
        return out


def _join(units: list[str], needles: list[tuple[float, str]], sep: str) -> str:
    """Units with each needle inserted at its depth (a fraction of the unit boundaries)."""
    slots: dict[int, list[str]] = {}
    for depth, text in needles:
        at = min(len(units), max(0, round(depth * len(units))))
        slots.setdefault(at, []).append(text)
    out = []
    for i in range(len(units) + 1):
        for text in slots.get(i, []):
            out.append(sep + text + sep)
        if i < len(units):
            out.append(units[i])
    return "".join(out)


def make_prompts(
    tokenizer,
    task: TaskSpec | str,
    length: int,
    n: int,
    *,
    haystack: str = "prose",
    seed: int = 0,
    template: str = "raw",
) -> list[Prompt]:
    """``n`` prompts of about ``length`` tokens (context and question together, BOS
    included), the asked needle's depth running evenly over ``[0, 1]``.

    ``template``: ``"raw"`` writes the question and its answer prefix after the context as
    plain text; ``"chat"`` makes context and question the user's turn of the tokenizer's
    chat template and the answer prefix the start of the assistant's (an instruct model's
    format; the tokenizer must have a template)."""
    if isinstance(task, str):
        task = parse_task(task)
    if n < 1:
        raise ValueError(f"prompts per cell must be positive, got {n}")
    if length < 256:
        raise ValueError(f"length must be at least 256 tokens, got {length}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; haystacks: {', '.join(HAYSTACKS)}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; templates: {', '.join(TEMPLATES)}")
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    bos = [] if getattr(tokenizer, "bos_token_id", None) is None else [tokenizer.bos_token_id]
    if bos and not _adds_bos(tokenizer):
        bos = []
    head, tail = _chat(tokenizer) if template == "chat" else ("", " ")
    if head.startswith(tokenizer.bos_token or "\0"):
        bos = []  # the template writes its own BOS
    rng = np.random.default_rng([seed, length, sum(map(ord, task.label))])
    builder = None if task.name == "cwe" else _Builder(tokenizer, haystack)
    out = []
    for i in range(n):
        depth = i / (n - 1) if n > 1 else 0.5
        if task.name == "cwe":
            ctx_text, (q_text, prefix), answers = _cwe(tokenizer, task, length, rng)
            source = "words"
        else:
            needles, (q_text, prefix), answers = _needles(task, depth, rng)
            intro = _INTRO[task.name]
            fixed = len(enc(head + intro + "\n\n" + "\n\n" + q_text + tail + prefix))
            fixed += len(bos)
            fixed += sum(len(enc(" " + t + " ")) for _, t in needles)
            if fixed >= length - 32:
                raise ValueError(
                    f"task {task.label}: {length} tokens cannot hold its needles and question "
                    f"({fixed} tokens); give a longer length"
                )
            units = builder.take(max(1, (length - fixed) * 5 // 4 + 64), rng)
            units = _fit(builder, units, length - fixed)
            sep = "\n" if haystack == "code" else " "
            body = _join(units, needles, sep)
            ctx_text = intro + "\n\n" + body
            source = haystack
        context = bos + enc(head + ctx_text)
        question = enc("\n\n" + q_text + tail + prefix)
        answer_chars = sum(len(a) + 2 for a in answers)
        max_new = len(enc(" " + ", ".join(answers) + ".")) + 4 + answer_chars // 16
        out.append(
            Prompt(
                task.label,
                length,
                context,
                question,
                list(answers),
                depth,
                source,
                max_new,
                head + ctx_text + "\n\n" + q_text + tail + prefix,
            )
        )
    return out


def _chat(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after a user message (the latter ending where the
    assistant's answer starts)."""
    mark = "\x00VELOX\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # no template, or one that refuses a lone user turn
        raise ValueError(
            f"template 'chat': the tokenizer has no usable chat template ({e})"
        ) from None
    if not isinstance(text, str) or text.count(mark) != 1:
        raise ValueError("template 'chat': the chat template does not render the message once")
    head, tail = text.split(mark)
    return head, tail


def _fit(builder: _Builder, units: list[str], tokens: int) -> list[str]:
    """The longest run ``units[:k]`` whose joined text holds at most ``tokens`` tokens
    (bisection: a unit's tokens alone differ from its tokens in context)."""
    lo, hi = 1, len(units)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(builder.enc("".join(units[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return units[:lo]


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer adds BOS to an encoded text (the model was trained so)."""
    try:
        ids = tokenizer.encode("a")
    except Exception:  # a tokenizer that cannot tell: add none
        return False
    return bool(ids) and ids[0] == tokenizer.bos_token_id
