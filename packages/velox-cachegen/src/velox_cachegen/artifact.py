"""A model's layer steps measured: how finely each layer's keys and values are quantized.

CacheGen's layer-wise quantization rests on a measurement: an error in a shallow layer costs
more output quality than the same error in a deep one (arXiv 2310.07240, Sec. 5.1), and its
public reference code sets the quantization bins per model from it. :func:`fit_cachegen`
measures it for a model: calibration text runs through the model in sequences of
``seq_len`` tokens; each sequence's last ``steps`` tokens are teacher-forced on its cache,
once as it is and once per layer-side with only that layer's keys (or values) coded at the
level ``step`` (every other layer exact). The mean KL divergence of the next-token
distributions is that layer-side's sensitivity ``a``. Errors of a small step cost KL in
proportion to the step squared and save bits in proportion to its logarithm, so the steps
that spend a byte budget best make every layer-side's cost equal: the multiplier of a
layer-side is ``sqrt(median(a) / a)`` (clipped to 1/8 .. 4), the median layer-side keeping
``step`` as it is.

The multipliers are an artifact (:mod:`velox_core.artifacts`), found by the model's
fingerprint; :func:`resolve_steps` picks what an encode uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import (
    ArtifactFile,
    ArtifactKind,
    Fitted,
    calibration_ids,
    fingerprint,
    fitted,
)
from velox_core.validation import check_int

from .chunks import spans as chunk_spans
from .levels import LayerSteps
from .quant import DELTAS, dequantize, quantize, spread_of

__all__ = [
    "HOW_TO_FIT",
    "LayerProfile",
    "fit_cachegen",
    "load_profile",
    "resolve_steps",
    "save_profile",
]

FORMAT = "velox-cachegen"
VERSION = "1"
CLIP = (0.125, 4.0)


@dataclass
class LayerProfile(Fitted):
    """A model's measured layer steps (``fingerprint``, ``model``, ``calibration``:
    :class:`~velox_core.artifacts.Fitted`): ``steps`` the multipliers, ``kl`` each
    layer-side's measured sensitivity (``{"key": [...], "value": [...]}``)."""

    noun = "profile"
    steps: LayerSteps
    kl: dict[str, list[float]]

    @property
    def layers(self) -> list[int]:
        return list(range(len(self.steps.key)))

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays = {
            "key_steps": mx.array(np.array(self.steps.key, np.float32)),
            "value_steps": mx.array(np.array(self.steps.value, np.float32)),
            "key_kl": mx.array(np.array(self.kl["key"], np.float32)),
            "value_kl": mx.array(np.array(self.kl["value"], np.float32)),
        }
        return arrays, {}

    @classmethod
    def decode(cls, f: ArtifactFile) -> LayerProfile:
        a = {k: [float(x) for x in np.array(v)] for k, v in f.arrays.items()}
        n = len(f.layers)
        if any(len(v) != n for v in a.values()):
            raise ValueError(f"arrays of other lengths than its {n} layers")
        steps = LayerSteps(a["key_steps"], a["value_steps"])
        return cls(steps, {"key": a["key_kl"], "value": a["value_kl"]}, **f.provenance())


KIND = ArtifactKind(FORMAT, VERSION, "CacheGen layer steps", "layer_steps", record=LayerProfile)
HOW_TO_FIT = KIND.how_to_fit
# save_profile(p, path) writes ``p`` (``.safetensors``); load_profile(path) reads one
# (``ValueError`` if it is not one): :class:`~velox_core.artifacts.ArtifactKind`.
save_profile, load_profile = KIND.save, KIND.load


def resolve_steps(layer_steps: Any, model: Any, layers: int) -> LayerSteps:
    """The :class:`LayerSteps` an encode of ``layers`` layers uses: ``layer_steps`` as given
    (a :class:`LayerSteps`, ``"reference"``, or a fitted artifact's path, checked against
    ``model`` when given), or for None the model's fitted artifact when one is found, else
    the reference code's groups.

    Raises:
        ValueError, TypeError: steps for another number of layers, an artifact of another
            model, a value of another kind.
    """
    if layer_steps is None:
        found = None if model is None else KIND.find(fingerprint(model))
        steps = LayerSteps.reference(layers) if found is None else load_profile(found).steps
    elif isinstance(layer_steps, LayerSteps):
        steps = layer_steps
    elif isinstance(layer_steps, str) and layer_steps == "reference":
        steps = LayerSteps.reference(layers)
    elif isinstance(layer_steps, (str, os.PathLike)):
        path = KIND.resolve(model, layer_steps) if model is not None else layer_steps
        steps = load_profile(path).steps
    else:
        raise TypeError(
            "cachegen: layer_steps must be a LayerSteps, 'reference', a fitted artifact's path "
            f"or None, got {layer_steps!r}"
        )
    if len(steps.key) != layers:
        raise ValueError(
            f"cachegen: layer_steps for {len(steps.key)} layers, the caches hold {layers}"
        )
    return steps


def _coded(x: np.ndarray, spans, setting: dict) -> np.ndarray:
    """``x`` ``(B, T, C)`` as a cache coded at ``setting["step"]`` (multiplier 1) gives it
    back (the entropy coding is lossless: the same values)."""
    out = np.empty_like(x)
    group, anchor_step = setting["group"], setting["anchor_step"]
    for a, b, is_window in spans:
        part = x[:, a:b]
        lv = setting["step"] * (setting["window_step"] if is_window else 1.0)
        spread = spread_of(part)
        q = quantize(part, lv * spread if spread > 0 else lv, anchor_step, group, setting["delta"])
        out[:, a:b] = dequantize(q, anchor_step, group)
    return out


def _logprobs(model, caches, tokens: mx.array) -> mx.array:
    logits = model(tokens[None], cache=caches)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _sensitivity(model, caches, tail: mx.array, setting: dict) -> np.ndarray:
    """``(layers, 2)``: the KL each layer-side's coding alone costs on ``tail``."""
    from mlx_lm.models.cache import KVCache

    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    t = caches[0].offset

    def fresh(layer: int = -1, side: int = 0, coded: mx.array | None = None) -> list:
        out = []
        for i, pair in enumerate(kv):
            k, v = pair
            if i == layer:
                k, v = (coded, v) if side == 0 else (k, coded)
            c = KVCache()
            c.state = (k, v, t)
            out.append(c)
        return out

    ref = _logprobs(model, fresh(), tail)
    sp = chunk_spans(t, setting["window"], setting["chunk"])
    out = np.zeros((len(kv), 2))
    for i, pair in enumerate(kv):
        for side, a in enumerate(pair):
            b, h, _, d = a.shape
            x = np.array(a.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(b, t, h * d)
            y = _coded(x, sp, setting)
            y = mx.array(y.reshape(b, t, h, d).transpose(0, 2, 1, 3)).astype(a.dtype)
            lp = _logprobs(model, fresh(i, side, y), tail)
            out[i, side] = float(mx.mean(mx.sum(mx.exp(ref) * (ref - lp), axis=-1)))
    return out


def fit_cachegen(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = None,
    seq_len: int = 2048,
    source: str | None = None,
    step: float = 2.75,
    steps: int = 32,
    window: int = 128,
    window_step: float = 0.125,
    chunk: int = 2048,
    group: int = 10,
    anchor_step: float = 0.5,
    delta: str = "auto",
) -> LayerProfile:
    """Measure ``model``'s layer steps on calibration tokens (module docstring).

    Args:
        step, window, window_step, chunk, group, anchor_step, delta: the coding each
            layer-side is measured under (:func:`velox_cachegen.encode`'s).
        steps: teacher-forced tokens at the end of each sequence.
        model, tokenizer_or_token_ids, text, max_tokens, seq_len, source: the model and its
            calibration, as :func:`velox_core.artifacts.calibration_ids` and
            :func:`~velox_core.artifacts.fitted` take them.

    Raises:
        ValueError, TypeError: too few calibration tokens, a model whose caches are not
            mlx-lm ``KVCache``, bad arguments.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    ids, how = calibration_ids(tokenizer_or_token_ids, text, "fit_cachegen", max_tokens)
    seq_len = check_int("seq_len", seq_len, minimum=2)
    steps = check_int("steps", steps, minimum=1)
    window, chunk = check_int("window", window, minimum=0), check_int("chunk", chunk, minimum=1)
    group = check_int("group", group, minimum=2)
    if delta not in DELTAS:
        raise ValueError(f"fit_cachegen: delta must be one of {', '.join(DELTAS)}, got {delta!r}")
    for name, v in (("step", step), ("window_step", window_step), ("anchor_step", anchor_step)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"fit_cachegen: {name} must be a positive number, got {v!r}")
    setting = {
        "step": step,
        "window": window,
        "window_step": window_step,
        "chunk": chunk,
        "group": group,
        "anchor_step": anchor_step,
        "delta": delta,
    }
    if seq_len <= steps:
        raise ValueError(f"fit_cachegen: seq_len {seq_len} must exceed steps {steps}")
    n_seq = ids.size // seq_len
    if n_seq < 1:
        raise ValueError(f"fit_cachegen: {ids.size} tokens, fewer than one sequence of {seq_len}")
    sums = None
    for s in range(n_seq):
        seq = mx.array(ids[s * seq_len : (s + 1) * seq_len])
        caches = make_prompt_cache(model)
        if not all(type(c) is KVCache for c in caches):
            raise ValueError("fit_cachegen: the model's caches must all be mlx-lm KVCache")
        model(seq[None, : seq_len - steps], cache=caches)
        kl = _sensitivity(model, caches, seq[seq_len - steps :], setting)
        sums = kl if sums is None else sums + kl
    kl = (sums / n_seq).astype(np.float32).astype(np.float64)  # as the artifact stores them
    med = float(np.median(kl))
    mult = np.clip(np.sqrt(med / np.maximum(kl, 1e-12)), *CLIP) if med > 0 else np.ones_like(kl)
    mult = mult.astype(np.float32).astype(np.float64)  # as the artifact stores them
    return LayerProfile(
        LayerSteps(tuple(mult[:, 0]), tuple(mult[:, 1])),
        {"key": kl[:, 0].tolist(), "value": kl[:, 1].tolist()},
        **fitted(
            model, how, source, tokens=n_seq * seq_len, seq_len=seq_len, steps=steps, **setting
        ),
    )
