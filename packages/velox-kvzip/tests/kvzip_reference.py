"""The tests' reference for KVzip: the tiny llama's attention recorded (and masked) in numpy,
float64, and the authors' scoring (``attention/score.py``, ``KVScore._get_score``) on it."""

from unittest import mock

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_kvzip.config import PROMPT, PROMPT_NEXT
from velox_testing.kv import softmax_reference

ORIGINAL = llama.scaled_dot_product_attention


class Recorder:
    """Stands in for mlx-lm's attention in the llama module: records every call's queries and
    keys (float64), and with ``keep`` (per layer, ``(H, n)`` bool over the ``n``-token
    context) attends only to the kept context tokens of each KV head and every token after
    the context (one decode query at a time)."""

    def __init__(self, layers: int, n: int, keep=None):
        self.layers, self.n, self.keep, self.calls = layers, n, keep, []

    def __call__(self, queries, keys, values, cache, scale, mask=None, sinks=None):
        layer = len(self.calls) % self.layers
        self.calls.append((np.array(queries, np.float64), np.array(keys, np.float64), scale))
        if self.keep is None:
            return ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask)
        q, k, v = (np.array(x, np.float64)[0] for x in (queries, keys, values))
        r, s = q.shape[0] // k.shape[0], k.shape[1]
        out = []
        for i in range(q.shape[0]):
            seen = np.ones(s, dtype=bool)
            seen[: self.n] = self.keep[layer][i // r]
            w = q[i] @ k[i // r, seen].T * scale  # one decode query (L = 1)
            out.append(softmax_reference(w) @ v[i // r, seen])
        return mx.array(np.stack(out)[None].astype(np.float32))

    def patched(self):
        """The llama module's attention replaced by this recorder, for a ``with`` block."""
        return mock.patch.object(llama, "scaled_dot_product_attention", self)


def reference_scores(model, tokenizer, context: list[int], chunk: int, sinks: int, start=0):
    """Per layer ``(H, n)``: each context pair's largest weight over every reconstruction query
    and query head of its group, each chunk's input built from the paper's instructions, run
    on mlx-lm's fp32 KVCache (inf before ``start``)."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    n, layers = len(context), len(model.layers)
    caches = [KVCache() for _ in model.layers]
    model(mx.array([context]), cache=caches)
    out = [None] * layers
    for s in range(start, n, chunk):
        e = min(s + chunk, n)
        lead = enc(PROMPT) if s == start else enc(PROMPT_NEXT) + context[s - 8 : s]
        x = lead + enc("\n") + context[s:e]
        rec = Recorder(layers, n)
        with rec.patched():
            model(mx.array([x]), cache=caches)
        sink, m = min(max(sinks, start), s), len(x)
        for layer, (q, k, scale) in enumerate(rec.calls):
            if out[layer] is None:
                out[layer] = np.full((k.shape[1], n), np.inf)
            r = q.shape[1] // k.shape[1]
            idx = [*range(sink), *range(s, e), *range(n, n + m)]
            for h in range(k.shape[1]):
                w = q[0, h * r : (h + 1) * r] @ k[0, h, idx].T * scale  # (r, m, keys)
                fixed = sink + e - s
                w[:, np.arange(m)[:, None] < np.arange(len(idx))[None] - fixed] = -np.inf
                out[layer][h, s:e] = softmax_reference(w)[..., sink:fixed].max(axis=(0, 1))
        for c in caches:
            c.trim(m)
    return out


def gemma3_reference(model, tokenizer, context: list[int], chunk: int, sinks: int, layers):
    """Per global layer of a Gemma 3 model, ``(H, n)``: the authors' scores, computed from each
    layer's input alone: its projections, query and key norms, RoPE at the tokens' absolute
    positions (the layer's own base) and the model's ``query_pre_attn_scalar``. Each chunk's
    input follows the whole context in one forward without a cache, so the sliding-window
    layers see the context's tail and the chunk, as after a prefill (float64)."""
    from mlx_lm.models import gemma3_text

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    args, n = model.args, len(context)
    original = gemma3_text.Attention.__call__
    out = {i: np.zeros((args.num_key_value_heads, n)) for i in layers}
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        x = (enc(PROMPT) if s == 0 else enc(PROMPT_NEXT) + context[s - 8 : s]) + enc("\n")
        x += context[s:e]
        seen = {}

        def spy(self, h, mask=None, cache=None, seen=seen):
            seen[self.layer_idx] = np.array(h.astype(mx.float32), np.float64)[0]
            return original(self, h, mask, cache)

        with mock.patch.object(gemma3_text.Attention, "__call__", spy):
            mx.eval(model.model(mx.array([context + x])))
        sink, m = min(sinks, s), len(x)
        idx = np.r_[np.arange(sink), np.arange(s, e), np.arange(n, n + m)]
        visible = (idx[None] < n) | (idx[None] <= n + np.arange(m)[:, None])  # (m, keys)
        for i in layers:
            at = model.model.layers[i].self_attn
            q = _project(seen[i], at.q_proj, at.q_norm, at.n_heads, args)
            k = _project(seen[i], at.k_proj, at.k_norm, at.n_kv_heads, args)
            r = at.n_heads // at.n_kv_heads
            for h in range(at.n_kv_heads):
                w = q[h * r : (h + 1) * r, n:] @ k[h, idx].T * args.query_pre_attn_scalar**-0.5
                w = np.where(visible, w, -np.inf)
                out[i][h, s:e] = softmax_reference(w)[..., sink : sink + e - s].max(axis=(0, 1))
    return [out[i] for i in layers]


def _project(x, linear, norm, heads: int, args):
    """A global layer's post-RoPE queries or keys ``(heads, T, D)`` from its input ``(T, dim)``:
    projection, Gemma's RMSNorm (scale ``1 + w``), RoPE over the two halves of each head at
    positions ``0 .. T - 1`` with base ``rope_theta``."""
    w = np.array(linear.weight.astype(mx.float32), np.float64)
    y = (x @ w.T).reshape(len(x), heads, -1).transpose(1, 0, 2)
    g = 1 + np.array(norm.weight.astype(mx.float32), np.float64)
    y = y / np.sqrt((y * y).mean(-1, keepdims=True) + args.rms_norm_eps) * g
    d = y.shape[-1]
    angle = np.arange(len(x))[:, None] * args.rope_theta ** (-np.arange(0, d, 2) / d)[None]
    a, b = y[..., : d // 2], y[..., d // 2 :]
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
