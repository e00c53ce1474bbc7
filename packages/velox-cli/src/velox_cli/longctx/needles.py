"""The long-context tasks' names and parameters (:data:`TASKS`, :func:`parse_task`) and their
facts, generated from a seed: the needles of the needle tasks
(pass keys, magic numbers for keys, variable chains) with the question that asks for them,
and the word list of the common-words task (see :mod:`velox_cli.longctx.tasks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__: list[str] = []

# name -> (parameter defaults); parse_task validates against these
TASKS: dict[str, dict[str, Any]] = {
    "passkey": {"digits": 5},
    "multikey": {"keys": 4, "digits": 6},
    "multivalue": {"values": 4, "digits": 6},
    "multiquery": {"keys": 4, "queries": 2, "digits": 6},
    "vartrack": {"hops": 2, "chains": 1, "digits": 5},
    "cwe": {"common": 3, "freq": 12, "rare": 2},
}
_LIMITS = {  # parameter -> (lowest, highest) allowed
    "digits": (3, 9),
    "keys": (1, 32),
    "values": (1, 16),
    "queries": (1, 16),
    "hops": (1, 16),
    "chains": (1, 8),
    "common": (1, 20),
    "freq": (2, 200),
    "rare": (1, 50),
}


@dataclass(frozen=True)
class TaskSpec:
    """A parsed task: its name and every parameter (defaults filled in)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        own = {k: v for k, v in self.params.items() if TASKS[self.name][k] != v}
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in own.items()) if own else "")


def parse_task(text: str) -> TaskSpec:
    """``name`` or ``name:key=value,...``; unknown names, parameters or values raise
    ``ValueError`` naming what is allowed."""
    name, _, rest = text.strip().partition(":")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    params = dict(TASKS[name])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in params:
            allowed = ", ".join(f"{k}=" for k in TASKS[name]) or "none"
            raise ValueError(f"task {name}: bad parameter {item!r}; parameters: {allowed}")
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"task {name}: {key} must be an integer, got {value!r}") from None
        lo, hi = _LIMITS[key]
        if not lo <= v <= hi:
            raise ValueError(f"task {name}: {key} must be in [{lo}, {hi}], got {v}")
        params[key] = v
    if name == "multiquery" and params["queries"] > params["keys"]:
        raise ValueError(
            f"task multiquery: queries ({params['queries']}) cannot exceed keys ({params['keys']})"
        )
    return TaskSpec(name, params)


# Keys and distractor words: short, common, single-token-ish English words.
_WORDS = (  # noqa: SIM905 - a word list reads better as one string
    "apple anchor arrow autumn badge bamboo banner basket beacon berry blanket blossom bottle "
    "breeze bridge bucket butter cabin cactus camera candle canvas canyon carpet castle cedar "
    "chalk cherry circle citrus clover cobalt comet copper coral cotton crystal dagger daisy "
    "desert dolphin dragon eagle ember engine falcon feather fiddle forest fossil garden garlic "
    "ginger glacier hammer harbor hazel helmet honey island ivory jacket jungle kettle ladder "
    "lantern lemon lizard magnet mango maple marble meadow mirror monkey needle nickel oasis "
    "olive orbit otter paddle panda pepper pillow planet pocket quartz rabbit raven ribbon "
    "rocket saddle salmon silver socket spider spring summer sunset tiger timber tomato tunnel "
    "turtle velvet violet walnut whistle willow window winter yellow zebra"
).split()


def _number(rng: np.random.Generator, digits: int, taken: set[str]) -> str:
    while True:
        v = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
        if v not in taken:
            taken.add(v)
            return v


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    picks = rng.choice(len(_WORDS), size=(n, 2), replace=True)
    out: list[str] = []
    for a, b in picks:
        k = f"{_WORDS[a]}-{_WORDS[b]}"
        while k in out or a == b:
            a, b = rng.choice(len(_WORDS), size=2, replace=False)
            k = f"{_WORDS[a]}-{_WORDS[b]}"
        out.append(k)
    return out


def _var_names(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(letters, size=5))
        if name not in out:
            out.append(name)
    return out


_MAGIC = "One of the special magic numbers for {key} is: {value}."


_INTRO = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant "
    "text. Find it and memorize it. I will quiz you about it afterwards.",
    "multikey": "Some special magic numbers are hidden within the following text. Make sure "
    "to memorize them. I will quiz you about the numbers afterwards.",
    "vartrack": "Memorize and track the chain(s) of variable assignment hidden in the "
    "following text.",
}


_INTRO["multivalue"] = _INTRO["multiquery"] = _INTRO["multikey"]


def _needles(task: TaskSpec, depth: float, rng: np.random.Generator):
    """The needles ``[(depth, text)]``, the question, the expected strings and their length
    in characters (for the decode budget) of one prompt."""
    p = task.params
    taken: set[str] = set()
    if task.name == "passkey":
        v = _number(rng, p["digits"], taken)
        needle = f"The pass key is {v}. Remember it. {v} is the pass key."
        return [(depth, needle)], ("What is the pass key?", "The pass key is"), [v]
    if task.name in ("multikey", "multiquery"):
        keys = _keys(rng, p["keys"])
        values = [_number(rng, p["digits"], taken) for _ in keys]
        asked = 1 if task.name == "multikey" else p["queries"]
        depths = [depth] + [float(d) for d in rng.uniform(0, 1, size=len(keys) - 1)]
        if asked > 1:  # the asked needles: the first at `depth`, the others spread from it
            depths[:asked] = [(depth + i / asked) % 1.0 for i in range(asked)]
        needles = [(d, _MAGIC.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
        if task.name == "multikey":
            k = keys[0]
            q = (
                f"What is the special magic number for {k} mentioned in the provided text?",
                f"The special magic number for {k} mentioned in the provided text is",
            )
            return needles, q, [values[0]]
        ks = " and ".join(keys[:asked]) if asked <= 2 else ", ".join(keys[:asked])
        q = (
            f"What are the special magic numbers for {ks} mentioned in the provided text?",
            f"The special magic numbers for {ks} mentioned in the provided text are",
        )
        return needles, q, values[:asked]
    if task.name == "multivalue":
        (k,) = _keys(rng, 1)
        values = [_number(rng, p["digits"], taken) for _ in range(p["values"])]
        n = p["values"]
        depths = [(depth + i / n) % 1.0 for i in range(n)]
        needles = [(d, _MAGIC.format(key=k, value=v)) for d, v in zip(depths, values)]
        q = (
            f"What are all the special magic numbers for {k} mentioned in the provided text?",
            f"The special magic numbers for {k} mentioned in the provided text are",
        )
        return needles, q, values
    if task.name == "vartrack":
        hops, chains = p["hops"], p["chains"]
        names = _var_names(rng, (hops + 1) * chains)
        values = [_number(rng, p["digits"], taken) for _ in range(chains)]
        needles = []
        for c in range(chains):
            chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
            start = depth if c == 0 else float(rng.uniform(0, 1))
            span = (1.0 - start) if start < 1.0 else 0.0
            for j, name in enumerate(chain):
                d = start + span * j / (hops + 1)
                text = (
                    f"VAR {name} = {values[c]}." if j == 0 else f"VAR {name} = VAR {chain[j - 1]}."
                )
                needles.append((d, text))
        asked = names[: hops + 1]
        q = (
            f"Question: Find all variables that are assigned the value {values[0]} in the text "
            "above.",
            f"Answer: According to the chain(s) of variable assignment in the text above, "
            f"{hops + 1} variables are assigned the value {values[0]}, they are:",
        )
        return needles, q, asked
    raise AssertionError(task.name)


def _cwe(tokenizer, task: TaskSpec, length: int, rng: np.random.Generator):
    """The common-words prompt: one solved example, then a list of words whose rare words
    fill the prompt to about ``length`` tokens (bisection over their count)."""
    p = task.params
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often."
    )
    order_seed = int(rng.integers(0, 2**31))

    def listing(rare: list[str], common: list[str], seed: int) -> str:
        items = [w for w in common for _ in range(p["freq"])]
        items += [w for w in rare for _ in range(p["rare"])]
        order = np.random.default_rng(seed).permutation(len(items))
        return "\n".join(f"{i + 1}. {items[j]}" for i, j in enumerate(order))

    def question(n: int) -> tuple[str, str]:
        return (
            f"Question: What are the {n} most common words in the above list?",
            f"Answer: The top {n} words that appear most often in the list are:",
        )

    k = p["common"]
    perm = [_WORDS[i] for i in rng.permutation(len(_WORDS))]
    ex_common, ex_rare, common = perm[:k], perm[k : k + 8], perm[k + 8 : 2 * k + 8]
    example = f"{intro}\n{listing(ex_rare, ex_common, order_seed + 1)}\n{' '.join(question(k))} "
    example += ", ".join(ex_common) + ".\n\n"
    pool = [w for w in _WORDS if w not in common and w not in ex_common]
    pool = [pool[i] for i in rng.permutation(len(pool))]

    def context(n: int) -> str:
        rare = [
            pool[i % len(pool)] + ("" if i < len(pool) else str(i // len(pool))) for i in range(n)
        ]
        return f"{example}{intro}\n{listing(rare, common, order_seed)}\n"

    budget = length - len(enc("\n\n" + " ".join(question(k))))
    lo, hi = 0, max(1, length // max(1, p["rare"]))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(enc(context(mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if len(enc(context(lo))) > budget:
        raise ValueError(
            f"task {task.label}: {length} tokens cannot hold its example and common words; "
            "give a longer length or fewer common words (common=, freq=)"
        )
    return context(lo), question(k), common
