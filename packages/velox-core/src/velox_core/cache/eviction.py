"""``EvictionCache``: the preset of an eviction method, and the settings such presets share.

An eviction preset (StreamingLLM, SnapKV, Q-Filters, NestedKV, Ada-KV) is a
:class:`~velox_core.cache.VeloxCache` with the method's retention policy, ``sinks`` and a
``window`` kept as given around the body the policy keeps, and optionally ``Uniform`` codes
of the kept tokens (:func:`~velox_core.cache.preset.kept_codecs`). Its config subclasses
:class:`EvictionConfig`, which holds and validates the settings they share, and its package
registers it with :func:`eviction_method`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..codec.uniform import Uniform
from ..policy.base import PREFILLS
from ..registry import Method
from ..validation import check_choice, check_counts, check_float, check_int
from .preset import PresetCache, check_kept_codes, kept_codecs

__all__ = ["EvictionCache", "EvictionConfig", "eviction_method", "recent_tokens"]

# what ``velox bench`` runs by default: the kept tokens in fp16, and in 4-bit codes of
# 32-channel groups
RECOMMENDED = ({"budget": 1024}, {"budget": 1024, "bits": 4, "group": 32})
# the same with the codes' default groups (``EvictionConfig.group``)
RECOMMENDED_DEFAULT_GROUP = ({"budget": 1024}, {"budget": 1024, "bits": 4})
# the observation-window votes' (SnapKV and the methods built on its votes): the settings
# the long-context suite supports (docs/long-context.md): a 15-token pooling kernel, the kept
# tokens in fp16 or in 8-bit codes (4-bit per-token keys lose the needle there)
RECOMMENDED_VOTED = ({"budget": 1024, "kernel": 15}, {"budget": 1024, "kernel": 15, "bits": 8})


def recent_tokens(
    recent: Any, budget: int, scored: str = "scored tokens", name: str = "recent"
) -> int:
    """A share of the budget given as ``recent`` (H2O's and Keyformer's recent window, CaM's
    sinks: ``name`` names the parameter) in tokens: a whole number of tokens as given, a
    fraction in ``[0, 1)`` of ``budget`` rounded down (the authors' ``int(ratio * length)``);
    ``scored`` names what the rest of the budget holds, for the error."""
    if isinstance(recent, bool) or not isinstance(recent, (int, float)):
        raise TypeError(
            f"{name} must be a whole number of tokens or a fraction of the budget in [0, 1), "
            f"got {type(recent).__name__} {recent!r}"
        )
    if isinstance(recent, int):
        return check_int(name, recent, minimum=0)
    share = check_float(name, recent, minimum=0.0)
    if share >= 1.0:
        raise ValueError(
            f"{name}={recent}: a fraction of the budget must be below 1 (some of the budget "
            f"goes to the {scored}); give a whole number for a count of tokens"
        )
    return int(share * budget)


@dataclass
class EvictionConfig:
    """The settings every eviction preset shares. A method's config subclasses it, adds its
    own fields (after these) and declares a shared field again to give it its own default.

    Attributes:
        budget: tokens kept per KV head: the sinks, the body the policy keeps and the window.
        sinks: first tokens always kept, as given (attention sinks).
        window: most recent tokens always kept, as given (fp16 when ``bits`` is set).
        every: during decode, evict again once ``budget`` is exceeded by ``every`` tokens
            (None, where :attr:`every_none` allows it: evict only after prefill chunks).
        bits, key_bits, value_bits: code the kept tokens with ``velox_core.Uniform`` at these
            widths (None keeps them in fp16, as the papers do).
        group: group size of those codes.
        prefill: when a prompt prefilled in chunks is cut (:data:`velox_core.policy.base.PREFILLS`):
            ``"chunks"``, as each next chunk arrives (peak memory: ``budget`` plus one chunk),
            or ``"prompt"``, once at its end, voted by its last queries (the papers' and
            kvpress's compression of a whole prompt; the whole prompt is held until then).
    """

    every_none: ClassVar[bool] = True  # whether ``every=None`` is allowed

    budget: int = 1024
    sinks: int = 0
    window: int = 0
    every: int | None = None
    bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    prefill: str = "chunks"

    def __post_init__(self):
        check_int("budget", self.budget, minimum=1)
        check_choice("prefill", self.prefill, PREFILLS)
        check_counts(self, "sinks", "window")
        if self.every is not None or not self.every_none:
            check_int("every", self.every, minimum=1)
        check_kept_codes(self)
        if self.budget <= self.sinks + self.window:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + window = {self.sinks + self.window} "
                "(those tokens are always kept)"
            )


@dataclass
class RecentConfig(EvictionConfig):
    """:class:`EvictionConfig` with a recent window (H2O, Keyformer): ``recent``, the newest
    tokens always kept, a whole number of tokens or a fraction in ``[0, 1)`` of ``budget``
    (:func:`recent_tokens`); the cache's ``window`` counts among them. ``scored`` names, one
    and several, what the rest of the budget holds. A subclass declares ``recent`` again with
    its default and calls :meth:`check_recent` at the end of its ``__post_init__``."""

    scored: ClassVar[tuple[str, str]] = ("scored token", "scored tokens")

    recent: int | float = 0

    @property
    def recent_tokens(self) -> int:
        """``recent`` in tokens (a fraction taken of ``budget``)."""
        return recent_tokens(self.recent, self.budget, self.scored[1])

    def check_recent(self) -> None:
        """``ValueError`` unless ``budget`` exceeds the tokens always kept (``sinks`` and
        the larger of ``window`` and the recent tokens) by at least one scored token."""
        always = self.sinks + max(self.window, self.recent_tokens)
        if self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, recent) = {always} "
                f"(recent={self.recent} is {self.recent_tokens} tokens; those tokens are "
                f"always kept, and at least one {self.scored[0]} must fit)"
            )


class EvictionCache(PresetCache):
    """Base of the eviction presets: ``Policy`` built from the config fields named in
    ``policy_params`` (or by :meth:`make_policy`), cutting a chunked prompt as the config's
    ``prefill`` says, the config's ``sinks`` and ``window``, and the kept tokens' codecs."""

    Policy: ClassVar[type]
    policy_params: ClassVar[tuple[str, ...]] = ("budget", "every")

    def make_policy(self, cfg: Any) -> Any:
        """The retention policy of ``cfg``; a preset whose policy takes other arguments than
        config fields of the same names overrides this, never :meth:`build` (which sets the
        settings every eviction preset shares)."""
        return self.Policy(**{name: getattr(cfg, name) for name in self.policy_params})

    def build(self, cfg: Any) -> dict[str, Any]:
        policy = self.make_policy(cfg)
        policy.prefill = cfg.prefill
        return {**kept_codecs(cfg), "policy": policy}


def eviction_method(
    cache_class: type[EvictionCache],
    summary: str,
    paper: str,
    recommended: tuple[dict[str, Any], ...] = RECOMMENDED,
) -> Method:
    """The registration (``METHOD``) of an eviction preset: named after its cache class, it
    brings the class's policy and the ``Uniform`` codes of the kept tokens."""
    return Method(
        name=cache_class.method,
        cache_class=cache_class,
        summary=summary,
        paper=paper,
        codecs=(Uniform,),
        policies=(cache_class.Policy,),
        recommended=recommended,
    )
