"""LatentCache: velox codes for multi-head latent attention (mlx-lm's deepseek_v3).

A tiny random DeepSeek-V3 (2 layers, kv_lora_rank 128, qk_rope_head_dim 32) stores a latent
and a RoPE key per token; make_cache gives those layers a LatentCache for uniform specs. Under
routing its decode steps attend from the latent's codes (velox_core.cache.absorbed), which
must give what the model's attention over the decoded latent gives.
"""

from __future__ import annotations

import copy
import json
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import velox_core
from velox_core import LatentCache, Uniform, VeloxCache, make_cache, routed
from velox_testing import tiny_model

RANK, PE = 128, 32
PROMPT, STEPS = 200, 32


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3", kv_lora_rank=RANK, qk_rope_head_dim=PE)


@pytest.fixture(scope="module")
def prompt():
    return mx.random.randint(0, 512, (1, PROMPT), key=mx.random.key(1))


def _logprobs(logits: mx.array) -> mx.array:
    x = logits[:, -1].astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _fp16_bytes(tokens: int, layers: int) -> int:
    """mlx-lm's fp16 cache of an MLA layer, counted by its tokens (not allocated slots)."""
    return layers * tokens * (RANK + PE) * 2


def test_uniform_specs_give_latent_layers_a_latent_cache(model):
    caches = make_cache(model, "uniform:bits=4,key_bits=8")
    assert [type(c) for c in caches] == [LatentCache, LatentCache]
    c = caches[0]
    assert (c.latent_bits, c.pe_bits, c.group, c.dims) == (4, 8, 64, (RANK, PE))
    assert not hasattr(c, "bits")  # mlx-lm's attention would take it for its quantized cache
    template = make_cache(model, velox_core.UniformCache(bits=2, group=32))
    assert [(t.latent_bits, t.group, t.flush) for t in template] == [(2, 32, 1)] * 2


# the latent and k_pe as a pair of records (the tiny model's 32-channel k_pe takes a group of
# 32, the latent 64) and as one record a token (both in groups of 32: JointLatent)
PAIR, JOINT = "", ",group=32"


def test_one_record_where_both_arrays_are_coded_alike(model):
    from velox_core.cache.latent_joint import JointLatent

    def store(spec):
        caches = make_cache(model, spec)
        model(mx.array([[1, 2, 3]]), cache=caches)
        return type(caches[0]._store)

    assert store("uniform:bits=4,group=32") is JointLatent
    assert store("uniform:bits=8,group=32") is JointLatent
    for spec in (
        "uniform:bits=4",  # k_pe in groups of 32, the latent of 64
        "uniform:bits=4,group=32,key_bits=8",
        "uniform:bits=4,group=32,window=8",
        "uniform:bits=4,group=32,sinks=4",
        "uniform:bits=4,group=32,flush=16",
    ):
        assert store(spec) is VeloxCache, spec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_a_joint_records_parts_are_the_records_of_each_part(bits):
    """JointLatent.part slices a record of [latent | k_pe] into what coding each alone
    gives (per-token groups never straddle the two), in every code width's layout."""
    from velox_core.cache.latent_joint import JointLatent
    from velox_core.codec.uniform import MLXGrid

    codec = MLXGrid(bits, 32)
    joint = JointLatent(codec, (128, 32))
    lat, pe = (mx.random.normal((2, 1, 5, d), key=mx.random.key(d)) for d in (128, 32))
    whole = codec.encode(mx.concatenate([lat, pe], axis=-1))
    for part, x in (("latent", lat), ("pe", pe)):
        alone = codec.encode(x)
        got = joint.part(whole, part)
        assert set(got.data) == set(alone.data) and got.tokens == 5
        for k in alone.data:
            assert mx.array_equal(got.data[k], alone.data[k]).item(), (bits, part, k)


@pytest.mark.parametrize("layout", [PAIR, JOINT])
def test_the_fetched_latent_is_attended_by_every_head_without_a_copy_each(model, layout):
    """The model's decode attention broadcasts the one latent head over every query head;
    MLX copies a strided operand once per head there, so the latent and k_pe a cache hands
    back must be whole arrays (a channel slice of one record a token is strided)."""
    tokens, heads = 4096, 64
    cache = make_cache(model, "uniform:bits=4" + layout)[0]
    keys = (mx.random.normal((1, 1, tokens, d), key=mx.random.key(d)) for d in (RANK, PE))
    latent, k_pe = cache.update_and_fetch(*(k.astype(mx.float16) for k in keys))
    mx.eval(latent, k_pe)
    q_lat, q_pe = (mx.ones((1, heads, 1, d), mx.float16) for d in (RANK, PE))
    mx.eval(q_lat, q_pe)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    scores = q_pe @ k_pe.swapaxes(-1, -2)
    out = mx.fast.scaled_dot_product_attention(q_lat, latent, latent, scale=0.1, mask=scores)
    mx.eval(out)
    per_head_copies = heads * tokens * RANK * 2
    assert mx.get_peak_memory() - before < per_head_copies // 4


@pytest.mark.parametrize("layout", [PAIR, JOINT])
def test_eight_bits_give_the_fp16_greedy_tokens(model, prompt, layout):
    caches, ref = make_cache(model, "uniform:bits=8" + layout), [KVCache() for _ in model.layers]
    got, want = [], []
    with routed(model):  # decode steps attend from the latent's codes
        a, b = model(prompt, cache=caches), model(prompt, cache=ref)
        for _ in range(STEPS):
            got.append(a[:, -1].argmax(-1).item())
            want.append(b[:, -1].argmax(-1).item())
            a = model(mx.array([[got[-1]]]), cache=caches)
            b = model(mx.array([[want[-1]]]), cache=ref)
    assert got == want
    assert len(set(want)) > 4  # not a collapsed repetition
    assert caches[0].offset == ref[0].offset == PROMPT + STEPS


@pytest.mark.parametrize("layout", [PAIR, JOINT])
def test_four_bits_keep_the_next_token_distribution(model, prompt, layout):
    """Teacher-forced: both caches read the same tokens; KL(fp16 || 4-bit) per step, the
    4-bit decode steps routed (from the codes)."""
    caches, ref = make_cache(model, "uniform:bits=4" + layout), [KVCache() for _ in model.layers]
    forced = mx.random.randint(0, 512, (STEPS,), key=mx.random.key(2)).tolist()
    with routed(model):
        a, b = model(prompt, cache=caches), model(prompt, cache=ref)
        kls = []
        for t in forced:
            pa, pb = _logprobs(a), _logprobs(b)
            kls.append(mx.sum(mx.exp(pb) * (pb - pa)).item())
            a, b = model(mx.array([[t]]), cache=caches), model(mx.array([[t]]), cache=ref)
    assert caches[0].decode_path == "codes"
    mean = sum(kls) / len(kls)
    print(f"mean KL {mean:.4f} (max {max(kls):.4f})")
    assert mean < 0.05, f"mean KL {mean:.4f} (max {max(kls):.4f})"


# per token and layer: latent 128 ch x 4 b = 64 B + its groups' fp16 scale and zero (2 of 64
# ch: 8 B; 4 of 32: 16 B); k_pe 32 ch x 4 b = 16 B + one group's 4 B; against 320 B of fp16
@pytest.mark.parametrize("layout, per_token, most", [(PAIR, 92, 0.3), (JOINT, 100, 0.33)])
def test_four_bit_bytes(model, prompt, layout, per_token, most):
    caches = make_cache(model, "uniform:bits=4" + layout)
    model(prompt, cache=caches)
    for t in range(STEPS):
        model(mx.array([[t]]), cache=caches)
    n = PROMPT + STEPS
    fp16 = _fp16_bytes(n, len(caches))
    assert sum(c.logical_nbytes for c in caches) == len(caches) * n * per_token
    ratio = sum(c.nbytes for c in caches) / fp16  # capacity included
    assert ratio <= most, ratio  # pair: 0.297 (logical 0.2875); joint: logical 0.3125
    assert caches[0].nbytes == caches[0]._store.nbytes


@pytest.mark.parametrize("spec", ["uniform:bits=4,window=8,sinks=4", "uniform:bits=4" + JOINT])
def test_state_round_trip_through_a_file_gives_the_same_next_logits(model, prompt, tmp_path, spec):
    caches = make_cache(model, spec)
    model(prompt, cache=caches)
    model(mx.array([[7]]), cache=caches)
    path = str(tmp_path / "latent.safetensors")
    arrays, meta = {}, {}
    for i, c in enumerate(caches):
        state = c.state
        assert state[0] == c.meta_state[0]
        meta[f"layer{i}"] = json.dumps([state[0], len(state) - 1])
        arrays.update({f"layer{i}.{j}": a for j, a in enumerate(state[1:])})
    mx.save_safetensors(path, arrays, meta)
    loaded_arrays, loaded_meta = mx.load(path, return_metadata=True)
    loaded = []
    for i in range(len(caches)):
        head, n = json.loads(loaded_meta[f"layer{i}"])
        loaded.append(
            LatentCache.from_state([head, *(loaded_arrays[f"layer{i}.{j}"] for j in range(n))])
        )
    copies = [copy.deepcopy(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    assert loaded[0].describe() == caches[0].describe()
    x = mx.array([[11]])
    want = model(x, cache=caches)
    assert mx.array_equal(model(x, cache=loaded), want).item()
    assert mx.array_equal(model(x, cache=copies), want).item()
    empty = LatentCache.from_state(LatentCache(bits=3).state)
    assert empty.empty() and empty.latent_bits == 3


def test_a_joint_state_that_does_not_match_its_arrays_is_refused(model, prompt):
    caches = make_cache(model, "uniform:bits=4" + JOINT)
    model(prompt, cache=caches)
    head, *arrays = caches[0].state
    meta = json.loads(head)
    meta["store"]["tokens"] += 1
    with pytest.raises(ValueError, match="rows on axis 2"):
        LatentCache.from_state([json.dumps(meta), *arrays])
    with pytest.raises(ValueError, match="not a joint latent state"):
        LatentCache.from_state([head, *arrays[:2]])


@pytest.mark.parametrize("layout", [PAIR, JOINT])
def test_trim_equals_the_cache_that_never_saw_the_tokens(model, prompt, layout):
    full = make_cache(model, "uniform:bits=4" + layout)
    assert all(c.is_trimmable() for c in full)  # flush=1, window=0: coded on arrival
    model(prompt, cache=full)
    short = make_cache(model, "uniform:bits=4" + layout)
    model(prompt[:, :-5], cache=short)
    assert [c.trim(5) for c in full] == [5, 5]
    assert full[0].offset == full[0].size() == PROMPT - 5
    x = mx.array([[3]])
    assert mx.array_equal(model(x, cache=full), model(x, cache=short)).item()
    with pytest.raises(ValueError, match="cannot trim"):
        full[0].trim(PROMPT)
    # a window keeps the newest tokens as given: not exactly trimmable, trimmed all the same
    windowed = make_cache(model, "uniform:bits=4,window=16")
    model(prompt, cache=windowed)
    assert not windowed[0].is_trimmable() and windowed[0].reuses_prefix()
    held = windowed[0]._store.keys_and_values()  # (k_pe, latent), decoded
    assert windowed[0].trim(30) == 30 and windowed[0].offset == PROMPT - 30
    for kept, was in zip(windowed[0]._store.keys_and_values(), held):
        assert mx.allclose(kept, was[:, :, : PROMPT - 30], rtol=0, atol=1e-2).item()
    with pytest.raises(ValueError, match="cannot trim"):
        windowed[0].trim(PROMPT)


def test_mask_is_the_kv_caches(model, prompt):
    caches, ref = make_cache(model, "uniform:bits=4"), [KVCache() for _ in model.layers]
    model(prompt[:, :20], cache=caches), model(prompt[:, :20], cache=ref)
    for n, arr in ((1, False), (1, True), (5, False), (5, True)):
        kw = {"return_array": arr, "window_size": None}  # as create_attention_mask calls it
        got, want = caches[0].make_mask(n, **kw), ref[0].make_mask(n, **kw)
        if isinstance(want, mx.array):
            assert mx.array_equal(got, want).item()
        else:
            assert got == want


def test_bad_latent_specs_are_refused_naming_the_layer(model):
    with pytest.raises(ValueError, match=r"layer 0 .*group=48 must divide the latent width"):
        make_cache(model, "uniform:bits=4,group=48")
    with pytest.raises(ValueError, match=r"layer 1 .*key_axis='channel' is not supported"):
        make_cache(model, "fp16", layers={1: "uniform:key_axis=channel"})
    with pytest.raises(ValueError, match="only multi-head latent attention"):
        make_cache(tiny_model("llama"), LatentCache())
    with pytest.raises(ValueError, match="not implemented"):
        LatentCache().merge([LatentCache()])


def test_other_methods_keep_the_fp16_cache_with_the_warning(model):
    template = VeloxCache(Uniform(4), Uniform(4))
    with pytest.warns(UserWarning, match=r"layers 0, 1 keep the model's own cache.*only uniform"):
        caches = make_cache(model, template)
    assert [type(c) for c in caches] == [KVCache, KVCache]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a uniform spec warns of nothing
        assert type(make_cache(model, "uniform")[0]) is LatentCache


@pytest.mark.parametrize("layout", [PAIR, JOINT])
def test_batch_rows(model, prompt, layout):
    spec = "uniform:bits=4" + layout
    a, b = make_cache(model, spec), make_cache(model, spec)
    model(prompt, cache=a)
    model(prompt[:, ::-1], cache=b)
    joined = [x.copy() for x in a]
    for j, y in zip(joined, b):
        j.extend(y)
    back = [j.extract(1) for j in joined]
    x = mx.array([[5]])
    assert mx.array_equal(model(x, cache=back), model(x, cache=b)).item()
    kept = [j.copy() for j in joined]
    for k in kept:
        k.filter([0])
    assert mx.array_equal(model(x, cache=kept), model(x, cache=a)).item()
    with pytest.raises(ValueError, match="extend"):
        short = make_cache(model, spec)
        model(prompt[:, :7], cache=short)
        joined[0].extend(short[0])
    emptied = make_cache(model, spec)
    model(prompt[:, :7], cache=emptied)
    emptied[0].trim(7)
    with pytest.raises(ValueError, match="extend"):
        emptied[0].extend(short[0])


@pytest.mark.parametrize("spec", ["uniform:bits=4,window=8", "uniform:bits=4" + JOINT])
def test_save_cache_and_load_cache_keep_a_latent_cache(model, prompt, tmp_path, spec):
    """velox's own files hold latent layers: the same next logits after a reload, and
    ``inspect_cache_file`` counts their tokens and bytes."""
    caches = make_cache(model, spec)
    model(prompt, cache=caches)
    path = tmp_path / "latent.safetensors"
    velox_core.save_cache(path, caches)
    loaded = velox_core.load_cache(path, model=model)
    assert all(isinstance(c, LatentCache) for c in loaded)
    x = mx.array([[11]])
    assert mx.array_equal(model(x, cache=loaded), model(x, cache=caches)).item()
    rows = velox_core.inspect_cache_file(path)["layers"]
    assert [r["offset"] for r in rows] == [PROMPT] * len(caches)
    assert [r["tokens"] for r in rows] == [PROMPT] * len(caches)  # codes and window
    assert all(r["bytes"] > 0 for r in rows)


# -- decode steps under routing read the latent's codes ---------------------------------------


def _decode_both(model, spec: str, prompt: mx.array, steps: int):
    """Two caches of ``spec`` filled with ``prompt``; ``steps`` teacher-forced decode steps, the
    first cache's under routing (from the codes), the second's without (the decoded latent).
    Yields ``(step, routed caches, reference caches, routed logits, reference logits)``."""
    a, b = make_cache(model, spec), make_cache(model, spec)
    model(prompt, cache=a), model(prompt, cache=b)
    forced = mx.random.randint(0, 512, (prompt.shape[0], steps), key=mx.random.key(3))
    for i in range(steps):
        x = forced[:, i : i + 1]
        with routed(model):
            la = model(x, cache=a)
        lb = model(x, cache=b)
        yield i, a, b, la, lb


# KL(decoded || codes) of the next token within float tolerance: the two paths round
# differently (the decoded latent is rounded to the model's dtype, the codes path sums
# scale * code + zero unrounded), measured up to 4e-6 in float16 and 4e-4 in bfloat16, where
# either path is as far from a float32 run of the same model
KL_TOLERANCE = {mx.float16: 1e-4, mx.bfloat16: 2e-3}
# the greedy tokens must agree wherever the decoded path's best two are this far apart
# (bfloat16 logits of this model move by a few 1/64ths between the paths)
MARGIN = 0.1


def _check_close(la: mx.array, lb: mx.array, where: str) -> None:
    """The same greedy tokens (but for near ties) and next-token distributions within float
    tolerance of the decoded path's."""
    pa, pb = _logprobs(la), _logprobs(lb)
    kl = mx.max(mx.sum(mx.exp(pb) * (pb - pa), axis=-1)).item()
    assert kl < KL_TOLERANCE[la.dtype], f"{where}: KL {kl:.2e}"
    top2 = mx.sort(pb, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > MARGIN
    same = pa.argmax(-1) == pb.argmax(-1)
    assert mx.all(same | ~clear).item(), where


@pytest.mark.parametrize(
    "spec, dtype, prompt_len, steps",
    [
        ("uniform:bits=4", mx.float16, 200, 64),  # the codes grow past 256 tokens
        ("uniform:bits=4,window=8,sinks=4", mx.float16, 250, 12),  # fp16 tokens both sides
        ("uniform:bits=4,flush=16", mx.float16, 100, 20),  # tokens waiting as given
        ("uniform:bits=8", mx.bfloat16, 120, 8),
        ("uniform:bits=4,group=32,window=4", mx.bfloat16, 1100, 4),  # the mix in chunks
        ("uniform:bits=4" + JOINT, mx.float16, 200, 64),  # one record a token
        ("uniform:bits=3" + JOINT, mx.bfloat16, 120, 8),
        ("uniform:bits=8" + JOINT, mx.bfloat16, 1100, 4),
    ],
)
def test_routed_decode_reads_the_codes_as_the_decoded_latent_gives(spec, dtype, prompt_len, steps):
    model = tiny_model("deepseek_v3", dtype=dtype, kv_lora_rank=RANK, qk_rope_head_dim=PE)
    prompt = mx.random.randint(0, 512, (1, prompt_len), key=mx.random.key(1))
    for i, a, b, la, lb in _decode_both(model, spec, prompt, steps):
        assert [c.decode_path for c in a] == ["codes"] * len(a), i
        assert all(c.decode_path is None for c in b)  # never routed
        _check_close(la, lb, f"{spec} step {i}")
    assert [c.nbytes for c in a] == [c.nbytes for c in b]  # nothing resident added
    assert a[0].offset == prompt_len + steps


def test_routed_decode_of_a_batch_reads_each_rows_codes(model, prompt):
    both = mx.concatenate([prompt, prompt[:, ::-1]])
    for i, a, _, la, lb in _decode_both(model, "uniform:bits=4,window=4", both, 6):
        assert a[0].decode_path == "codes"
        _check_close(la, lb, f"batch step {i}")


def test_calls_the_codes_cannot_serve_take_the_model_attention_exactly(model, prompt):
    """Prefill chunks (the latent's projections are attended) and codes outside MLX's layout
    (7 bits) run the model's attention over the decoded latent: the very logits of an
    unrouted run."""
    a, b = make_cache(model, "uniform:bits=7"), make_cache(model, "uniform:bits=7")
    with routed(model):
        got = model(prompt, cache=a)
    assert mx.array_equal(got, model(prompt, cache=b)).item()
    assert a[0].decode_path == "decoded: attention is given other arrays than the latent"
    x = mx.array([[9]])
    with routed(model):
        got = model(x, cache=a)
    assert mx.array_equal(got, model(x, cache=b)).item()
    assert "7 bits in groups of 64 are not MLX's layout" in a[0].decode_path


def test_readable_on_cuda_only_where_turned_on_and_one_row(monkeypatch):
    import velox_core.kernels as vk
    from velox_core.cache import absorbed
    from velox_core.kernels.config import configured

    codec = Uniform(4, 64)
    rows = codec.encode(mx.random.normal((2, 1, 8, RANK)))
    one = codec.encode(mx.random.normal((1, 1, 8, RANK)))
    assert absorbed.readable([(codec, rows)]) == ""
    with configured(latent_codes=False):  # off everywhere
        assert "turned off" in absorbed.readable([(codec, one)])
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    assert "measures no faster" in absorbed.readable([(codec, one)])  # the default: off there
    with configured(latent_codes=True):
        assert "several rows on MLX's CUDA backend" in absorbed.readable([(codec, rows)])
        assert absorbed.readable([(codec, one)]) == ""
    # one record a token: the latent's codes are a slice of each record, which CUDA's
    # quantized_matmul cannot read in place; a pair's single row can
    q = mx.random.normal((1, 4, 1, RANK))
    for group, why in ((32, "one record a token on MLX's CUDA backend"), (64, "")):
        c = LatentCache(bits=4, group=group)
        latent, _ = c.update_and_fetch(
            mx.random.normal((1, 1, 8, RANK)), mx.random.normal((1, 1, 8, PE))
        )
        got = c._unreadable(q, latent, None, None)
        assert (why in got) if why else got == "", (group, got)


def test_latent_codes_setting_from_the_environment():
    from velox_core.kernels.config import KernelConfig

    assert KernelConfig.from_environ({}).latent_codes is None
    assert KernelConfig.from_environ({"VELOX_LATENT_CODES": "1"}).latent_codes is True
    assert KernelConfig.from_environ({"VELOX_LATENT_CODES": "0"}).latent_codes is False
    with pytest.raises(ValueError, match="VELOX_LATENT_CODES must be 0 or 1"):
        KernelConfig.from_environ({"VELOX_LATENT_CODES": "yes"})


@pytest.mark.parametrize("tokens", [1, 700, 1024, 1100, 5000, 17000])
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_absorbed_attention_equals_dense_attention_over_the_decoded_latent(tokens, mask_kind):
    """Sinks, codes and window of ``tokens`` coded latents: the codes path (chunks of the mix,
    their tail, the fp16 tokens' scores joined in order) against float32 attention over the
    same latents decoded."""
    from velox_core.cache import absorbed
    from velox_core.codec.identity import Identity

    b, hq, r = 2, 8, 64
    key = mx.random.key(tokens)
    ks = mx.random.split(key, 6)
    codec, ident = Uniform(4, 32), Identity()
    sink, win = mx.random.normal((b, 1, 3, r), key=ks[0]), mx.random.normal((b, 1, 5, r), key=ks[1])
    coded = codec.encode(mx.random.normal((b, 1, tokens, r), key=ks[2]))
    segments = [(ident, ident.encode(sink)), (codec, coded), (ident, ident.encode(win))]
    t = tokens + 8
    q = mx.random.normal((b, hq, 1, r), key=ks[3])
    if mask_kind == "additive":
        mask = mx.random.normal((b, hq, 1, t), key=ks[4])
    else:
        mask = mx.random.uniform(shape=(b, 1, 1, t), key=ks[4]) > 0.3
    latents = mx.concatenate([sink, codec.decode(coded).astype(mx.float32), win], axis=2)
    s = (q * 0.125) @ mx.swapaxes(latents, -1, -2)
    s = s + mask if mask_kind == "additive" else mx.where(mask, s, -mx.inf)
    want = mx.softmax(s, axis=-1) @ latents
    got = absorbed.attention(q, segments, 0.125, mask)
    assert got.shape == (b, hq, 1, r) and got.dtype == mx.float32
    err = mx.max(mx.abs(got - want)).item()
    assert err < 1e-4 * max(1.0, mx.max(mx.abs(want)).item()), err


def test_chunks_of_the_mix():
    from velox_core.cache.absorbed import CHUNK, CHUNKS, chunk_tokens

    assert chunk_tokens(2 * CHUNK - 1) == 0  # one product
    assert chunk_tokens(2 * CHUNK) == CHUNK
    assert chunk_tokens(CHUNKS * CHUNK + CHUNK - 1) == CHUNK
    assert chunk_tokens((CHUNKS + 1) * CHUNK) == 2 * CHUNK  # at most CHUNKS chunks
    assert chunk_tokens(32768) == 1024
