"""``PreRope``: the RoPE of a key codec that codes keys before RoPE.

Keys reach a cache post-RoPE. A pre-RoPE key codec (several method packages have one) turns each
key back at its absolute position before coding it, and turns the keys it rebuilds forward
again, so it must know the layer's RoPE (:class:`~velox_core.ops.rope.RopeSpec`). It comes
from one of three places:

- the model: ``make_cache`` calls the codec's ``bind(model, layer)``, which reads the layer's
  RoPE module (:func:`~velox_core.ops.rope.find_rope`);
- the settings of a standalone codec, ``mlx.nn.RoPE``'s: ``rope_base``, ``rope_traditional``,
  ``rope_scale`` and ``rope_dims`` (default: the head dim), used when no model is bound;
  with a model they must agree with the model's RoPE;
- the codec's state: once known, the RoPE is saved with the cache as ``rope_theta`` and
  ``rope_layout``, so copies and loaded caches need no model.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import mlx.core as mx

from ..ops.rope import RopeSpec, find_rope, rope_spec, rotate
from ..validation import check_bool, check_float, check_int

__all__ = ["ROPE_SETTINGS", "PreRope", "check_rope_settings", "rope_fields", "rope_settings"]

ROPE_SETTINGS = ("rope_base", "rope_traditional", "rope_scale", "rope_dims")

# the standalone RoPE settings as config fields: (annotation, default), mlx.nn.RoPE's defaults
_ROPE_FIELDS = {
    "rope_base": ("float | None", None),
    "rope_traditional": ("bool", False),
    "rope_scale": ("float", 1.0),
    "rope_dims": ("int | None", None),
}


def check_rope_settings(
    rope_base: Any, rope_traditional: Any, rope_scale: Any, rope_dims: Any, pre_rope: bool = True
) -> tuple[float | None, bool, float, int | None]:
    """The standalone RoPE settings, checked: ``(rope_base, rope_traditional, rope_scale,
    rope_dims)`` with the base a float > 1 (or None: the model's RoPE), the scale > 0 and the
    rotated dims an even int >= 2 (or None: the head dim).

    Raises:
        TypeError / ValueError: naming the setting; also when ``rope_traditional``,
            ``rope_scale`` or ``rope_dims`` is set without ``rope_base``, or any of them
            with ``pre_rope=False`` (a codec of post-RoPE keys has no RoPE to set).
    """
    check_bool("pre_rope", pre_rope)
    base = None if rope_base is None else check_float("rope_base", rope_base)
    if base is not None and base <= 1.0:
        raise ValueError(f"rope_base must be > 1, got {rope_base}")
    traditional = check_bool("rope_traditional", rope_traditional)
    scale = check_float("rope_scale", rope_scale, minimum=0.0, open_min=True)
    dims = None if rope_dims is None else check_int("rope_dims", rope_dims, minimum=2)
    if dims is not None and dims % 2:
        raise ValueError(f"rope_dims must be even, got {rope_dims}")
    custom = traditional or scale != 1.0 or dims is not None
    if not pre_rope and (base is not None or custom):
        raise ValueError("rope_base/rope_traditional/rope_scale/rope_dims need pre_rope=True")
    if base is None and custom:
        raise ValueError("rope_traditional/rope_scale/rope_dims need rope_base")
    return base, traditional, scale, dims


def rope_fields(cls: type) -> type:
    """Class decorator, applied under ``@dataclass``: appends the fields :data:`ROPE_SETTINGS`
    (``rope_base: float | None = None``, ``rope_traditional: bool = False``,
    ``rope_scale: float = 1.0``, ``rope_dims: int | None = None``) after the class's own, so
    a pre-RoPE method's config declares them once; check them with
    ``check_rope_settings(**rope_settings(self))`` in ``__post_init__``.

    Raises:
        TypeError: ``cls`` already declares one of them.
    """
    own = inspect.get_annotations(cls)  # the class's own, not its bases'
    taken = sorted(set(own) & set(_ROPE_FIELDS))
    if taken:
        raise TypeError(f"rope_fields: {cls.__name__} already declares {', '.join(taken)}")
    cls.__annotations__ = {**own, **{name: kind for name, (kind, _) in _ROPE_FIELDS.items()}}
    for name, (_, default) in _ROPE_FIELDS.items():
        setattr(cls, name, default)
    return cls


def rope_settings(cfg: Any) -> dict[str, Any]:
    """A config's RoPE settings (and ``pre_rope`` where it has one), as key-codec keywords."""
    names = ("pre_rope", *ROPE_SETTINGS) if hasattr(cfg, "pre_rope") else ROPE_SETTINGS
    return {name: getattr(cfg, name) for name in names}


class PreRope:
    """Mixin of a :class:`~velox_core.Codec` of pre-RoPE keys: its RoPE settings, the
    RoPE read from the model at ``bind``, saved in and restored from the state, and the
    rotations at the keys' positions.

    A subclass sets ``rope_method`` (its name in errors) and calls :meth:`init_rope` from
    ``__init__``. A codec that can also code post-RoPE keys sets ``rope_optional = True`` and
    an instance attribute ``pre_rope`` before calling :meth:`init_rope`; with
    ``pre_rope=False`` every method here is a no-op.
    """

    rope_method: ClassVar[str] = "velox"
    rope_optional: ClassVar[bool] = False
    pre_rope: bool = True

    def init_rope(
        self,
        rope_base: float | None,
        rope_traditional: bool,
        rope_scale: float,
        rope_dims: int | None,
    ) -> None:
        """Check and keep the standalone settings; the RoPE itself is not known yet."""
        self.rope_base, self.rope_traditional, self.rope_scale, self.rope_dims = (
            check_rope_settings(rope_base, rope_traditional, rope_scale, rope_dims, self.pre_rope)
        )
        self._rope: RopeSpec | None = None  # from the model (bind), the settings or the state

    def rope_config(self) -> dict[str, Any]:
        """The settings for :meth:`Codec.config` (with ``pre_rope`` where it is optional)."""
        out = {"pre_rope": self.pre_rope} if self.rope_optional else {}
        return {**out, **{name: getattr(self, name) for name in ROPE_SETTINGS}}

    def _hint(self) -> str:
        return "pass rope_base=... for a standalone cache" + (
            ", or pre_rope=False" if self.rope_optional else ""
        )

    def _settings_rope(self, dims: int) -> RopeSpec:
        return RopeSpec.from_base(self.rope_base, dims, self.rope_traditional, self.rope_scale)

    def bind_rope(self, model: Any, layer: int) -> None:
        """Read the RoPE of ``model.layers[layer]``.

        Raises:
            ValueError: the layer has no RoPE module that velox reads, or ``rope_base`` (and
                the other settings) disagree with it.
        """
        if not self.pre_rope:
            return
        m, hint = self.rope_method, self._hint()
        spec = rope_spec(find_rope(model, layer, m, hint), m, hint)
        if self.rope_base is not None:
            mine = self._settings_rope(spec.dims if self.rope_dims is None else self.rope_dims)
            if not mine.same_as(spec):
                raise ValueError(
                    f"{m}: rope_base={self.rope_base} (and rope_traditional/rope_scale/"
                    f"rope_dims) disagree with layer {layer}'s RoPE ({spec.describe()}); "
                    "leave rope_base unset to use the model's"
                )
        self._rope = spec

    def rope_for(self, dim: int) -> RopeSpec:
        """The RoPE of heads of ``dim`` channels: the bound one, else the settings'.

        Raises:
            ValueError: no model was bound and no ``rope_base`` given, or the RoPE rotates
                more channels than a head has.
        """
        m = self.rope_method
        if self._rope is None:
            if self.rope_base is None:
                raise ValueError(
                    f"{m}: pre-RoPE keys need the model's RoPE: build the caches with "
                    f"velox_core.make_cache(model, ...), or {self._hint()}"
                )
            self._rope = self._settings_rope(dim if self.rope_dims is None else self.rope_dims)
        if self._rope.dims > dim:
            raise ValueError(
                f"{m}: the RoPE rotates {self._rope.dims} channels, more than a head's {dim}"
            )
        return self._rope

    # -- state -------------------------------------------------------------------------------
    def rope_state(self) -> dict[str, mx.array]:
        """``rope_theta`` and ``rope_layout`` once the RoPE is known (else nothing)."""
        return self._rope.arrays() if self.pre_rope and self._rope is not None else {}

    def pop_rope_state(self, state: dict[str, mx.array]) -> dict[str, mx.array]:
        """Restore the RoPE from a state; returns the rest of the state."""
        state = dict(state)
        theta, layout = state.pop("rope_theta", None), state.pop("rope_layout", None)
        if (theta is None) != (layout is None) or (theta is not None and not self.pre_rope):
            raise ValueError(
                f"{self.rope_method}: rope_theta and rope_layout go together, pre-RoPE only"
            )
        if theta is not None:
            self._rope = RopeSpec.from_arrays(theta, layout)
        return state

    # -- positions and rotations -----------------------------------------------------------
    def key_positions(self, positions: mx.array | None, batch: int, tokens: int) -> mx.array:
        """The absolute positions of a block of keys, once per token for all heads.

        Shapes: positions ``(T,)`` integer; returns int32 ``(B, 1, T)``.
        """
        if positions is None or positions.shape != (tokens,):
            raise ValueError(
                f"{self.rope_method}: pre-RoPE keys need positions of shape ({tokens},), got "
                f"{None if positions is None else tuple(positions.shape)}"
            )
        pos = positions.astype(mx.int32).reshape(1, 1, tokens)
        return mx.broadcast_to(pos, (batch, 1, tokens))

    def unrotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """Post-RoPE keys turned back to pre-RoPE.

        Shapes: x ``(B, H, T, D)``; positions broadcastable to ``(B, H, T)``; returns float32
        ``(B, H, T, D)``.
        """
        return rotate(x, positions, self.rope_for(x.shape[-1]), inverse=True)

    def rerotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rebuilt pre-RoPE keys turned forward to post-RoPE (shapes as :meth:`unrotate`)."""
        return rotate(x, positions, self.rope_for(x.shape[-1]))
