"""The conformance suite every velox cache passes.

A method package subclasses :class:`CacheConformance` in its tests and sets what is its own::

    from velox_core.testing import CacheConformance

    class TestKIVI(CacheConformance):
        def make(self):            # the cache under test (default settings)
            return KIVICache(bits=4)
        def make_precise(self):    # its highest-fidelity settings (model-level checks)
            return KIVICache(bits=8)
        max_memory_ratio = 0.35    # resident bytes vs fp16 at 2,048 tokens
        attention_error = 0.15     # relative error of attention outputs vs fp16

pytest then runs every ``test_*`` below against it: the mlx-lm protocol, trim, state round
trip, save/load, RoPE/offset correctness inside a real mlx-lm model, batch > 1, resident
memory against fp16, the attention error bound, compressed-domain attention against the
decoded path, bad input, and ``mlx_lm.generate``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from ..cache.velox import VeloxCache
from ..io import load_cache, save_cache
from ..mlx_lm import generate, make_cache, routed
from .models import tiny_model, tiny_tokenizer

__all__ = ["CacheConformance", "greedy_agreement", "kv_data", "rel_error"]


def kv_data(
    b: int = 1, h: int = 2, t: int = 256, d: int = 128, seed: int = 0, dtype: mx.Dtype = mx.float16
) -> tuple[mx.array, mx.array]:
    """Keys and values shaped like a real model's: channel-wise scales, a few outlier
    channels in the keys, and a shared direction (so attention is not uniform)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, 0.5, size=d))
    scale[rng.choice(d, size=max(1, d // 32), replace=False)] *= 6.0
    mean = rng.normal(0, 1.0, size=d)
    k = rng.normal(0, 1, size=(b, h, t, d)) * scale + mean
    v = rng.normal(0, 1, size=(b, h, t, d))
    return mx.array(k.astype(np.float32)).astype(dtype), mx.array(v.astype(np.float32)).astype(
        dtype
    )


def rel_error(a: mx.array, b: mx.array) -> float:
    """``||a - b|| / ||b||`` in float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2) / mx.sum(b * b)).item())


def assert_partials_close(got, ref, rel: float) -> None:
    """A fused kernel's partial ``(o, m, l)`` against the reference's: same shapes, each
    array within ``rel`` of the reference's largest magnitude (at least 1)."""
    assert got is not None, "the kernel path declined (returned None)"
    for g, r in zip(got, ref):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape, (g.shape, r.shape)
        assert np.abs(g - r).max() <= rel * max(1.0, np.abs(r).max())


def assert_partials_equivalent(got, ref, rel: float, lazy_bits: float = 8.0) -> None:
    """A kernel's partial ``(o, m, l)`` whose running max is lazy (up to ``lazy_bits`` log2
    units below the true max, as the tensor-core kernels keep it) against the reference's:
    ``m`` within that band, and ``o``, ``l`` moved to the reference's ``m`` within ``rel`` of
    the reference's largest magnitude (at least 1). Any ``m`` gives the same merged softmax."""
    assert got is not None, "the kernel path declined (returned None)"
    (go, gm, gl), (ro, rm, rl) = (tuple(np.asarray(a) for a in x) for x in (got, ref))
    assert go.shape == ro.shape and gm.shape == rm.shape and gl.shape == rl.shape
    band = lazy_bits * math.log(2) + 1e-4 * max(1.0, np.abs(rm).max())
    assert np.all(gm <= rm + 1e-4 * max(1.0, np.abs(rm).max())) and np.all(gm >= rm - band)
    f = np.exp(gm - rm)
    for g, r in ((go * f, ro), (gl * f, rl)):
        assert np.abs(g - r).max() <= rel * max(1.0, np.abs(r).max())


def greedy_agreement(model, prompt: mx.array, spec, steps: int = 32, tie: float = 0.1):
    """Greedy tokens of ``model`` with fp16 caches, and with ``spec`` caches on the same path.

    The velox run is teacher-forced along the fp16 greedy path, so each step's choice is
    compared on the same history. A random-weight model has near-ties in its logits, where
    any rounding (even 8-bit codes) may pick the other token: ``ties[i]`` marks steps whose
    fp16 top-2 logit margin is below ``tie``.

    Returns:
        ``(ref_tokens, velox_tokens, ties)``, lists of length ``steps``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    def run(caches, force=None):
        toks, margins = [], []
        logits = model(prompt, cache=caches)[:, -1]
        for i in range(steps):
            top = mx.sort(logits[0].astype(mx.float32))
            margins.append(float((top[-1] - top[-2]).item()))
            toks.append(int(mx.argmax(logits, -1).item()))
            y = mx.array([toks[-1] if force is None else force[i]])
            logits = model(y[:, None], cache=caches)[:, -1]
        return toks, margins

    ref, margins = run(make_prompt_cache(model))
    with routed(model):
        got, _ = run(make_cache(model, spec), force=ref)
    return ref, got, [m < tie for m in margins]


def _sdpa(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _same(a: mx.array, b: mx.array) -> bool:
    """Equal to a few units of fp16 rounding (attention outputs of about unit size)."""
    return a.shape == b.shape and mx.allclose(a, b, rtol=2e-3, atol=1e-4).item()


def _fill(cache, k, v, chunks=(100, 1, 60, 1, 1)):
    """Feed ``k, v`` in uneven chunks (a prefill, decode steps, another chunk...)."""
    t, start, i = k.shape[2], 0, 0
    while start < t:
        n = min(chunks[i % len(chunks)], t - start)
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
        i += 1
    return cache


class CacheConformance:
    """Subclass in a test module and override :meth:`make` (and the bounds)."""

    max_memory_ratio: float = 1.0
    # bound on attention error against fp16 over *all* tokens; None for evicting settings,
    # where that reference does not apply (test_attend_matches_decoded still checks them)
    attention_error: float | None = 0.25
    model_logit_cosine: float = 0.99
    same_greedy_tokens: int = 0  # with make_precise(): greedy tokens equal to fp16 (tiny llama)
    head_dim: int = 128

    def make(self) -> VeloxCache:
        raise NotImplementedError("a conformance test class must define make()")

    def make_precise(self) -> VeloxCache:
        return self.make()

    # -- protocol ---------------------------------------------------------------------------
    def test_protocol(self):
        c = self.make()
        assert isinstance(c, VeloxCache)
        for attr in (
            "update_and_fetch",
            "keys_and_values",
            "state",
            "from_state",
            "is_trimmable",
            "trim",
            "make_mask",
            "size",
            "empty",
            "nbytes",
            "logical_nbytes",
            "attend",
        ):
            assert hasattr(c, attr), attr
        # mlx-lm would route a cache with `bits` to its own quantized attention
        assert not hasattr(c, "bits") and not hasattr(c, "to_quantized")
        assert c.offset == 0 and c.size() == 0 and c.empty() and c.nbytes == 0
        assert isinstance(c.is_trimmable(), bool)

    def test_offsets_and_fetch(self):
        k, v = kv_data(t=200, d=self.head_dim)
        c = self.make()
        kk, vv = c.update_and_fetch(k[:, :, :150], v[:, :, :150])
        assert c.offset == 150
        assert kk.shape[2] == vv.shape[2] == c.size() <= 150
        assert kk.shape[-1] == self.head_dim and kk.dtype == k.dtype
        for i in range(150, 200):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.offset == 200 and not c.empty()
        assert c.make_mask(1) is None
        assert c.make_mask(7) == "causal"
        m = c.make_mask(7, return_array=True)
        assert m.shape == (7, c.size() + 7)

    def test_fresh_is_independent(self):
        k, v = kv_data(t=40, d=self.head_dim)
        c = self.make()
        c.update_and_fetch(k, v)
        f = c.fresh()
        assert f.offset == 0 and f.empty() and f.config() == c.config()

    # -- trim ---------------------------------------------------------------------------------
    def test_trim(self):
        k, v = kv_data(t=180, d=self.head_dim)
        c = _fill(self.make(), k, v)
        size = c.size()
        assert c.trim(10) == 10
        assert c.offset == 170 and c.size() == size - 10
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(1)).astype(mx.float16)
        out = c.attend(q, scale=self.head_dim**-0.5)
        ref = _sdpa(q, k[:, :, :170], v[:, :, :170], self.head_dim**-0.5)
        if self.attention_error is not None:
            assert rel_error(out, ref) < self.attention_error
        with pytest.raises(ValueError):
            c.trim(c.size() + 1)
        with pytest.raises((ValueError, TypeError)):
            c.trim(-1)

    def test_trim_is_exact_where_the_cache_says_so(self):
        """is_trimmable() promises that trim leaves the cache that never saw the tokens."""
        c = self.make()
        if not c.is_trimmable():
            return  # trim is approximate past the fp16 tokens, and the cache says so
        k, v = kv_data(t=180, d=self.head_dim)
        _fill(c, k, v)
        c.trim(40)
        ref = _fill(self.make(), k[:, :, :140], v[:, :, :140])
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(4)).astype(mx.float16)
        assert c.offset == ref.offset and c.size() == ref.size()
        assert _same(c.attend(q, scale=0.1), ref.attend(q, scale=0.1))

    # -- state and files ------------------------------------------------------------------------
    def test_state_round_trip(self):
        k, v = kv_data(t=150, d=self.head_dim)
        c = _fill(self.make(), k, v)
        c2 = type(c).from_state(c.state)
        assert c2.offset == c.offset and c2.size() == c.size()
        assert c2.config() == c.config()
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(2)).astype(mx.float16)
        # equal to fp16 rounding: the restored stores hold the same values, but may be laid out
        # otherwise (contiguous, or without the live buffers' slack), and a BLAS may sum a
        # product in another order for each (OpenBLAS does at head dim 128)
        assert _same(c.attend(q, scale=0.1), c2.attend(q, scale=0.1))
        # both keep working the same after more tokens
        k2, v2 = kv_data(t=20, d=self.head_dim, seed=5)
        _fill(c, k2, v2, chunks=(1,))
        _fill(c2, k2, v2, chunks=(1,))
        assert _same(c.attend(q, scale=0.1), c2.attend(q, scale=0.1))

    def test_save_load(self, tmp_path):
        k, v = kv_data(t=130, d=self.head_dim)
        caches = [_fill(self.make(), k, v), _fill(KVCache(), k, v)]
        path = tmp_path / "c.safetensors"
        save_cache(path, caches, {"note": "x"})
        loaded, meta = load_cache(path, return_metadata=True)
        assert meta == {"note": "x"}
        assert type(loaded[0]) is type(caches[0]) and type(loaded[1]) is KVCache
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(3)).astype(mx.float16)
        # the loaded arrays are contiguous, the live ones slices of larger buffers (see
        # test_state_round_trip)
        assert _same(loaded[0].attend(q, scale=0.1), caches[0].attend(q, scale=0.1))
        assert loaded[1].offset == 130
        raw = path.read_bytes()
        bad = tmp_path / "truncated.safetensors"
        bad.write_bytes(raw[: len(raw) - 100])
        with pytest.raises(ValueError):
            load_cache(bad)
        flipped = bytearray(raw)
        flipped[-5] ^= 0xFF
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError):
            load_cache(bad)

    # -- correctness inside a real model ----------------------------------------------------------
    def _decode_logits(self, model, caches, prompt, steps):
        out = [model(prompt, cache=caches)[:, -1]]
        for t in steps:
            out.append(model(t[None, None], cache=caches)[:, -1])
        return mx.concatenate(out, axis=0).astype(mx.float32)

    def test_rope_offset_in_model(self):
        model = tiny_model("llama", head_dim=self.head_dim, hidden_size=2 * self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 70), key=mx.random.key(4))
        steps = mx.random.randint(0, 512, (12,), key=mx.random.key(5))
        ref = self._decode_logits(model, [KVCache() for _ in model.layers], prompt, steps)
        caches = make_cache(model, self.make_precise())
        with routed(model):
            got = self._decode_logits(model, caches, prompt, steps)
        assert all(c.offset == 82 for c in caches)
        cos = mx.sum(ref * got, -1) / (mx.linalg.norm(ref, axis=-1) * mx.linalg.norm(got, axis=-1))
        assert float(mx.min(cos).item()) > self.model_logit_cosine
        # a wrong position (an offset off by one) must be caught by the same check
        shifted = make_cache(model, self.make_precise())
        with routed(model):
            model(prompt, cache=shifted)
            for c in shifted:
                c.offset += 1
            bad = self._decode_logits(model, shifted, prompt[:, -1:], steps)
        cos_bad = mx.sum(ref[1:] * bad[1:], -1) / (
            mx.linalg.norm(ref[1:], axis=-1) * mx.linalg.norm(bad[1:], axis=-1)
        )
        assert float(mx.min(cos_bad).item()) < float(mx.min(cos).item())

    def test_routed_equals_unrouted(self):
        model = tiny_model("llama", head_dim=self.head_dim, hidden_size=2 * self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 40), key=mx.random.key(6))
        steps = mx.random.randint(0, 512, (6,), key=mx.random.key(7))
        with routed(model):
            a = self._decode_logits(model, make_cache(model, self.make()), prompt, steps)
        b = self._decode_logits(model, make_cache(model, self.make()), prompt, steps)
        assert rel_error(a, b) < 2e-2

    def test_greedy_tokens_match_fp16(self):
        if not self.same_greedy_tokens:
            pytest.skip("no greedy-token claim for this method")
        model = tiny_model("llama", head_dim=self.head_dim, hidden_size=2 * self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 48), key=mx.random.key(8))
        ref, got, ties = greedy_agreement(
            model, prompt, self.make_precise(), self.same_greedy_tokens
        )
        assert len(set(ref)) > 1, "the reference model should not repeat one token"
        assert all(a == b or t for a, b, t in zip(ref, got, ties)), (ref, got)

    def test_generate_runs(self):
        model = tiny_model("llama", head_dim=self.head_dim, hidden_size=2 * self.head_dim)
        caches = make_cache(model, self.make())
        text = generate(model, tiny_tokenizer(), "def add(a, b):", cache=caches, max_tokens=6)
        assert isinstance(text, str)
        assert caches[0].offset > 6

    # -- batches -------------------------------------------------------------------------------
    def test_batch(self):
        k, v = kv_data(b=2, t=140, d=self.head_dim)
        batched = _fill(self.make(), k, v)
        q = mx.random.normal((2, 4, 1, self.head_dim), key=mx.random.key(9)).astype(mx.float16)
        out = batched.attend(q, scale=0.1)
        for i in range(2):
            single = _fill(self.make(), k[i : i + 1], v[i : i + 1])
            ref = single.attend(q[i : i + 1], scale=0.1)
            assert rel_error(out[i : i + 1], ref) < 1e-2
        one = batched.extract(1)
        assert rel_error(one.attend(q[1:2], scale=0.1), out[1:2]) < 1e-3

    def test_batch_generate_ragged(self):
        """mlx-lm's batch_generate over prompts of different lengths (right-padded prefill in
        chunks, rows finishing at different steps) gives each row the greedy tokens of its
        own single-sequence run with the same prefill chunks."""
        from mlx_lm.generate import batch_generate, generate_step

        model = tiny_model("llama", head_dim=self.head_dim, hidden_size=2 * self.head_dim)
        tok = tiny_tokenizer()
        prompts = [
            mx.random.randint(0, 512, (n,), key=mx.random.key(20 + n)).tolist()
            for n in (45, 18, 31)
        ]
        steps = [7, 3, 5]
        with routed(model):
            singles = []
            for p, n in zip(prompts, steps):
                caches = make_cache(model, self.make())
                gen = generate_step(
                    mx.array(p), model, prompt_cache=caches, max_tokens=n, prefill_step_size=16
                )
                singles.append([int(t) for t, _ in gen])
            out = batch_generate(
                model,
                tok,
                prompts,
                max_tokens=steps,
                prompt_caches=[make_cache(model, self.make()) for _ in prompts],
                prefill_step_size=16,
                return_token_ids=True,
            )
        assert out.token_ids == singles

    # -- memory and accuracy -------------------------------------------------------------------
    def test_memory_vs_fp16(self):
        k, v = kv_data(b=1, h=2, t=2048, d=self.head_dim)
        c = self.make()
        ref = KVCache()
        for start in range(0, 2048, 512):
            c.update_and_fetch(k[:, :, start : start + 512], v[:, :, start : start + 512])
            ref.update_and_fetch(k[:, :, start : start + 512], v[:, :, start : start + 512])
        mx.eval(c.state, ref.state)
        assert c.logical_nbytes <= c.nbytes
        assert c.nbytes <= self.max_memory_ratio * ref.nbytes, (c.nbytes, ref.nbytes)

    def test_attention_error(self):
        if self.attention_error is None:
            pytest.skip("evicting settings: no fp16 reference over all tokens")
        k, v = kv_data(t=512, d=self.head_dim)
        c = _fill(self.make(), k, v, chunks=(300, 1, 1, 210))
        q = (
            mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(10)) + k[:, :1, -1:] / 4
        ).astype(mx.float16)
        scale = 1 / math.sqrt(self.head_dim)
        err = rel_error(
            c.attend(q, scale=scale), _sdpa(q, k[:, :, : c.offset], v[:, :, : c.offset], scale)
        )
        assert err < self.attention_error, err

    def test_attend_matches_decoded(self):
        """Compressed-domain attention equals SDPA over the cache's own decoded tokens."""
        k, v = kv_data(t=300, d=self.head_dim)
        c = _fill(self.make(), k, v)
        kk, vv = c.keys_and_values()
        scale = 1 / math.sqrt(self.head_dim)
        for lq, mask in ((1, None), (3, "causal")):
            q = mx.random.normal((1, 4, lq, self.head_dim), key=mx.random.key(lq)).astype(
                mx.float16
            )
            got = c.attend(q, scale=scale, mask=mask)
            ref = _sdpa(
                q.astype(mx.float32), kk.astype(mx.float32), vv.astype(mx.float32), scale, mask
            )
            assert rel_error(got, ref) < 1e-2

    # -- bad input -----------------------------------------------------------------------------
    def test_bad_input(self):
        c = self.make()
        k, v = kv_data(t=8, d=self.head_dim)
        with pytest.raises((ValueError, TypeError)):
            c.update_and_fetch(k[0], v[0])  # rank 3
        with pytest.raises((ValueError, TypeError)):
            c.update_and_fetch(k.astype(mx.int32), v)
        with pytest.raises(ValueError):
            c.update_and_fetch(k, v[:, :, :4])
        with pytest.raises(TypeError):
            c.update_and_fetch(np.zeros((1, 2, 8, self.head_dim)), v)
        c.update_and_fetch(k, v)
        with pytest.raises(ValueError):
            c.update_and_fetch(k[:, :1], v[:, :1])  # head count changed
        assert c.offset == 8

    def test_dtypes(self):
        for dt in (mx.float16, mx.bfloat16, mx.float32):
            k, v = kv_data(t=40, d=self.head_dim, dtype=dt)
            c = self.make()
            kk, _ = c.update_and_fetch(k, v)
            assert kk.dtype == dt
            q = mx.random.normal((1, 2, 1, self.head_dim)).astype(dt)
            assert c.attend(q, scale=0.1).dtype == dt
