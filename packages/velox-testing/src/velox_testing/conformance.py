"""The conformance suite every velox cache passes.

A method package subclasses :class:`CacheConformance` in its tests and sets what is its own::

    from velox_testing import CacheConformance

    class TestKIVI(CacheConformance):
        spec = "kivi:bits=4"            # the cache under test (or def make(self): ...)
        precise_spec = "kivi:bits=8"    # its highest-fidelity settings (model-level checks)
        max_memory_ratio = 0.35         # resident bytes vs fp16 at 2,048 tokens
        attention_error = 0.15          # relative error of attention outputs vs fp16
        bad_settings = ({"bits": 1},)   # settings its class refuses

pytest then runs every ``test_*`` below against it: the mlx-lm protocol, trim, state round
trip, save/load, RoPE/offset correctness inside a real mlx-lm model, batch > 1, resident
memory against fp16, the attention error bound, compressed-domain attention against the
decoded path, bad input, and ``mlx_lm.generate``.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from velox_core import VeloxCache, generate, load_cache, make_cache, routed, save_cache
from velox_core import make as make_spec

from .kv import decode_logits, feed, greedy_agreement, kv_data, rel_error
from .models import conformance_model, tiny_tokenizer
from .refusals import SHARED_BAD, Refusal

__all__ = ["CacheConformance"]


def _sdpa(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _same(a: mx.array, b: mx.array) -> bool:
    """Equal to a few units of fp16 rounding (attention outputs of about unit size)."""
    return a.shape == b.shape and mx.allclose(a, b, rtol=2e-3, atol=1e-4).item()


class CacheConformance:
    """Subclass in a test module and override :meth:`make` (and the bounds)."""

    max_memory_ratio: float = 1.0
    # bound on attention error against fp16 over *all* tokens; None for evicting settings,
    # where that reference does not apply (test_attend_matches_decoded still checks them)
    attention_error: float | None = 0.25
    model_logit_cosine: float = 0.99
    same_greedy_tokens: int = 0  # with make_precise(): greedy tokens equal to fp16 (tiny llama)
    head_dim: int = 128
    # settings of the method's own that its cache class must refuse (ValueError or TypeError):
    # each a dict of keyword arguments, or (dict, regex the message must match), as
    # named_refusals and int_refusals of velox_testing.refusals write them; the shared
    # settings' bad values are tried as well (shared_bad_settings)
    bad_settings: ClassVar[tuple[dict[str, Any] | Refusal, ...]] = ()

    # the cache under test as a spec (``velox_core.make``), unless the class defines make()
    spec: ClassVar[str | None] = None
    precise_spec: ClassVar[str | None] = None  # make_precise()'s spec (default: make())

    def make(self) -> VeloxCache:
        if self.spec is None:
            raise NotImplementedError("a conformance test class must define spec or make()")
        return make_spec(self.spec)

    def make_precise(self) -> VeloxCache:
        return self.make() if self.precise_spec is None else make_spec(self.precise_spec)

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
        c = feed(self.make(), k, v)
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
        feed(c, k, v)
        c.trim(40)
        ref = feed(self.make(), k[:, :, :140], v[:, :, :140])
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(4)).astype(mx.float16)
        assert c.offset == ref.offset and c.size() == ref.size()
        assert _same(c.attend(q, scale=0.1), ref.attend(q, scale=0.1))

    def test_trim_keeps_the_prefix_where_the_cache_reuses_it(self):
        """reuses_prefix() promises that trim keeps the first tokens as the cache holds them
        (a prompt cache may then serve a shorter prompt's prefix from a longer entry): a
        coded block the trim splits is decoded back into the window by another order of
        float16 work: to one unit of float16 at the largest value's scale."""
        c = self.make()
        reuses = c.reuses_prefix()
        assert isinstance(reuses, bool) and (reuses or not c.is_trimmable())
        if not reuses:
            return
        k, v = kv_data(t=180, d=self.head_dim)
        feed(c, k, v)
        held_k, held_v = c.keys_and_values()
        c.trim(110)  # past any window: coded tokens are cut
        kept_k, kept_v = c.keys_and_values()
        assert c.offset == c.size() == 70
        for kept, held in ((kept_k, held_k), (kept_v, held_v)):
            unit = 2**-10 * mx.abs(held).max().item()
            assert mx.allclose(kept, held[:, :, :70], rtol=0, atol=unit).item()
        feed(c, k[:, :, 70:], v[:, :, 70:])  # the rest again, as a reusing request does
        assert c.offset == 180
        # it attends as a cache that stored the 180 tokens at once, up to where the tokens
        # sit (coded or as given): within the suite's bound, or a quarter over its error
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(5)).astype(mx.float16)
        scale = self.head_dim**-0.5
        ref = _sdpa(q, k, v, scale)
        once = rel_error(feed(self.make(), k, v).attend(q, scale=scale), ref)
        bound = max(1.25 * once, self.attention_error or 0.0)
        assert rel_error(c.attend(q, scale=scale), ref) <= bound

    # -- state and files ------------------------------------------------------------------------
    def test_state_round_trip(self):
        k, v = kv_data(t=150, d=self.head_dim)
        c = feed(self.make(), k, v)
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
        feed(c, k2, v2, chunks=(1,))
        feed(c2, k2, v2, chunks=(1,))
        assert _same(c.attend(q, scale=0.1), c2.attend(q, scale=0.1))

    def test_save_load(self, tmp_path):
        k, v = kv_data(t=130, d=self.head_dim)
        caches = [feed(self.make(), k, v), feed(KVCache(), k, v)]
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
    def test_rope_offset_in_model(self):
        model = conformance_model(self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 70), key=mx.random.key(4))
        steps = mx.random.randint(0, 512, (12,), key=mx.random.key(5))
        ref = decode_logits(model, [KVCache() for _ in model.layers], steps, prompt)
        caches = make_cache(model, self.make_precise())
        with routed(model):
            got = decode_logits(model, caches, steps, prompt)
        assert all(c.offset == 82 for c in caches)
        cos = mx.sum(ref * got, -1) / (mx.linalg.norm(ref, axis=-1) * mx.linalg.norm(got, axis=-1))
        assert float(mx.min(cos).item()) > self.model_logit_cosine
        # a wrong position (an offset off by one) must be caught by the same check
        shifted = make_cache(model, self.make_precise())
        with routed(model):
            model(prompt, cache=shifted)
            for c in shifted:
                c.offset += 1
            bad = decode_logits(model, shifted, steps, prompt[:, -1:])
        cos_bad = mx.sum(ref[1:] * bad[1:], -1) / (
            mx.linalg.norm(ref[1:], axis=-1) * mx.linalg.norm(bad[1:], axis=-1)
        )
        assert float(mx.min(cos_bad).item()) < float(mx.min(cos).item())

    def test_routed_equals_unrouted(self):
        model = conformance_model(self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 40), key=mx.random.key(6))
        steps = mx.random.randint(0, 512, (6,), key=mx.random.key(7))
        with routed(model):
            a = decode_logits(model, make_cache(model, self.make()), steps, prompt)
        b = decode_logits(model, make_cache(model, self.make()), steps, prompt)
        assert rel_error(a, b) < 2e-2

    def test_greedy_tokens_match_fp16(self):
        if not self.same_greedy_tokens:
            pytest.skip("no greedy-token claim for this method")
        model = conformance_model(self.head_dim)
        prompt = mx.random.randint(0, 512, (1, 48), key=mx.random.key(8))
        ref, got, ties = greedy_agreement(
            model, prompt, self.make_precise(), self.same_greedy_tokens
        )
        assert len(set(ref)) > 1, "the reference model should not repeat one token"
        assert all(a == b or t for a, b, t in zip(ref, got, ties)), (ref, got)

    def test_generate_runs(self):
        model = conformance_model(self.head_dim)
        caches = make_cache(model, self.make())
        text = generate(model, tiny_tokenizer(), "def add(a, b):", cache=caches, max_tokens=6)
        assert isinstance(text, str)
        assert caches[0].offset > 6

    # -- batches -------------------------------------------------------------------------------
    def test_batch(self):
        k, v = kv_data(b=2, t=140, d=self.head_dim)
        batched = feed(self.make(), k, v)
        q = mx.random.normal((2, 4, 1, self.head_dim), key=mx.random.key(9)).astype(mx.float16)
        out = batched.attend(q, scale=0.1)
        for i in range(2):
            single = feed(self.make(), k[i : i + 1], v[i : i + 1])
            ref = single.attend(q[i : i + 1], scale=0.1)
            assert rel_error(out[i : i + 1], ref) < 1e-2
        one = batched.extract(1)
        assert rel_error(one.attend(q[1:2], scale=0.1), out[1:2]) < 1e-3

    def test_batch_generate_ragged(self):
        """mlx-lm's batch_generate over prompts of different lengths (right-padded prefill in
        chunks, rows finishing at different steps) gives each row the greedy tokens of its
        own single-sequence run with the same prefill chunks."""
        from mlx_lm.generate import batch_generate, generate_step

        model = conformance_model(self.head_dim)
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
        c = feed(self.make(), k, v, chunks=(300, 1, 1, 210))
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
        c = feed(self.make(), k, v)
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

    def shared_bad_settings(self, cls: type) -> list[Refusal]:
        """The bad settings every class of this kind refuses, as ``(settings, match)``: by
        default those of :data:`SHARED_BAD` whose parameters ``cls`` has."""
        if hasattr(cls, "defaults"):
            names = set(cls.defaults()) | {"no_such_parameter"}
        else:
            names = set(inspect.signature(cls).parameters) | {"no_such_parameter"}
        return [(bad, m) for bad, m in SHARED_BAD if set(bad) <= names]

    def test_bad_settings(self):
        """The class refuses each of ``bad_settings`` and of :meth:`shared_bad_settings`."""
        cls = type(self.make())
        for bad in [*self.shared_bad_settings(cls), *self.bad_settings]:
            settings, match = bad if isinstance(bad, tuple) else (bad, None)
            try:
                cls(**settings)
            except (ValueError, TypeError) as e:
                if match is not None and not re.search(match, str(e)):
                    pytest.fail(f"{cls.__name__}(**{settings!r}): {e!r} does not match {match!r}")
                continue
            pytest.fail(f"{cls.__name__}(**{settings!r}) was accepted")

    def test_dtypes(self):
        for dt in (mx.float16, mx.bfloat16, mx.float32):
            k, v = kv_data(t=40, d=self.head_dim, dtype=dt)
            c = self.make()
            kk, _ = c.update_and_fetch(k, v)
            assert kk.dtype == dt
            q = mx.random.normal((1, 2, 1, self.head_dim)).astype(dt)
            assert c.attend(q, scale=0.1).dtype == dt
