"""``PyramidKVPolicy``: SnapKV's selection under a per-layer pyramid budget (arXiv 2406.02069).

PyramidKV (Cai et al.) observes that attention funnels with depth: bottom layers spread
their attention over the whole prompt, top layers concentrate it on a few tokens. So it
gives each layer its own budget, falling linearly from the bottom layer to the top one
(:func:`velox_pyramidkv.layer_budget`: the average stays ``budget``, so the whole model keeps
as many tokens as a uniform budget would), and inside each layer keeps the tokens SnapKV
keeps: the observation window's votes (:func:`velox_core.policy.window_votes`), pooled
(:func:`velox_core.policy.pool_votes`), top ``layer budget - protected`` per KV head, plus the
window itself (scored ``+inf``).

How it runs in velox: exactly as velox-snapkv's policy (both are velox-core's
:class:`~velox_core.policy.WindowVotePolicy`), with the layer's budget in place of the
uniform one. :meth:`PyramidKVPolicy.observe` keeps the newest ``observe`` post-RoPE
queries (through ``VeloxCache.attend``: routed attention only); ``before_update`` cuts the
layer to its budget after each prefill chunk (and, with ``every``, during decode), the
budget computed from ``view.offset`` (the prompt seen so far, the same in every layer).

The layer's place in the pyramid (``layer``, ``n_layers``) comes from ``make_cache``:
``bind(model, i)`` places it among the model's layers, and ``PyramidKVCache.link_layers``
then among the layers that hold a PyramidKV cache (so layers left to the model's own cache,
sliding-window ones say, take no share). A cache made without a model must be given
``layer`` and ``n_layers``; otherwise the first cut that needs them (once the prompt exceeds
``budget``) raises ``ValueError`` naming ``make_cache(model, ...)``, and so does
``bind(None, i)``. A layer never keeps fewer than ``sinks + max(window, observe)`` tokens:
the pyramid shares out only the tokens beyond those (the top layer's share may round to 0).

Deviations from the paper (also in docs/pyramidkv.md): SnapKV's in velox (chunked prefill,
GQA votes averaged per KV head, optional decode cuts, a cut refused without routing), and the
schedule's (:mod:`velox_pyramidkv.schedule`).
"""

from __future__ import annotations

from typing import Any

from velox_core.policy import WindowVotePolicy
from velox_core.policy.base import layer_cut_target, warn_layer_unbounded
from velox_core.validation import check_int

from .config import check_beta, check_place
from .schedule import layer_budget

__all__ = ["PyramidKVPolicy"]

_WARNED = [False]


class PyramidKVPolicy(WindowVotePolicy):
    """PyramidKV's retention policy.

    Args:
        budget: tokens kept per KV head, averaged over the pyramid's layers, or None.
        every: during decode, cut again once the layer holds its budget + ``every`` tokens
            (None: only after prefill chunks, as the paper).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel size along tokens (1: no pooling).
        pooling: ``"max"`` or ``"avg"``.
        beta: the pyramid's steepness (>= 1; 1 is SnapKV's uniform budget).
        layer, n_layers: the place in the pyramid (set by ``bind`` / ``link_layers``).
    """

    name = "pyramidkv"
    settings = ("beta", "layer", "n_layers")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        observe: int = 32,
        kernel: int = 7,
        pooling: str = "max",
        beta: float = 20.0,
        layer: int | None = None,
        n_layers: int | None = None,
    ):
        super().__init__(budget, every, observe, kernel, pooling)
        self.beta = check_beta(beta)
        self.layer, self.n_layers = check_place(layer, n_layers)
        self.always = observe  # sinks + max(window, observe), set at attach
        self._memo: tuple[Any, int] | None = None

    def attach(self, view) -> None:
        self.always = view.sinks + max(view.window, self.vote.observe)
        if self.budget is not None and self.budget <= self.always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.always} (every layer keeps those tokens; the pyramid shares out the rest)"
            )
        super().attach(view)  # the same condition, checked by parts (none can fail here)

    # -- the place in the pyramid -----------------------------------------------------------
    def place(self, layer: int, n_layers: int) -> None:
        """Set the layer's place: ``0 <= layer < n_layers`` (0: the bottom, most tokens)."""
        self.layer, self.n_layers = check_place(layer, n_layers)
        self._memo = None

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Place the layer among ``model``'s layers (``PyramidKVCache.link_layers`` refines it
        to the layers holding a PyramidKV cache). Without a model, ``n_layers`` must be set."""
        if layer is None:
            return
        check_int("layer", layer, minimum=0)
        if model is not None:
            self.place(layer, len(model.layers))
        elif self.n_layers is None:
            raise ValueError(
                f"pyramidkv: bind(None, {layer}) cannot tell how many layers share the pyramid; "
                "make the caches with velox_core.make_cache(model, ...) or give n_layers"
            )
        else:
            self.place(layer, self.n_layers)

    def layer_budget(self, seen: int) -> int:
        """Tokens this layer keeps per KV head once ``seen`` tokens have arrived."""
        if seen <= self.budget:
            return max(seen, self.always)  # below the average: no layer evicts, any place
        if self.layer is None:
            raise ValueError(
                "pyramidkv: this cache does not know its place in the pyramid (its budget "
                "depends on its layer); make the caches with velox_core.make_cache(model, ...), "
                "or give layer=i and n_layers=L to a cache made by hand"
            )
        key = (seen, self.layer, self.n_layers, self.always)
        if self._memo is None or self._memo[0] != key:
            b = layer_budget(self.budget, self.always, self.n_layers, self.beta, seen, self.layer)
            self._memo = (key, b)
        return self._memo[1]

    # -- when to cut ------------------------------------------------------------------------
    def before_update(self, view, incoming: int) -> None:
        """Cut to the layer's budget after a prefill chunk, or with ``every`` during decode."""

        def unbounded(size: int) -> None:
            if not _WARNED[0] and size >= 2 * self.budget and self.layer is not None:
                where = f", layer {self.layer} of {self.n_layers}"
                kept = self.layer_budget(view.offset)
                warn_layer_unbounded("pyramidkv", _WARNED, size, kept, where)

        target = layer_cut_target(self, view, incoming, self.layer_budget, unbounded)
        if target is not None:
            view.evict(self.select(view, max(target - view.protected_count(), 0)))
