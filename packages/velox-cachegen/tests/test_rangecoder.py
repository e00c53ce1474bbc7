"""The range coder, its frequency tables and their storage: exact, near the entropy, strict."""

import zlib

import numpy as np
import pytest

from velox_cachegen import tables as tb
from velox_cachegen.rangecoder import PRECISION, Tables, _resolve, decode, encode, normalize


def _run(freqs, lo, ids, syms, lengths):
    """Encode then decode streams whose step-``s`` table and symbol are ``ids[s]``,
    ``syms[s]``; stream ``n`` holds ``lengths[n]`` symbols (lengths sorted, longest first)."""
    tables = Tables.from_freqs(np.asarray(lo), freqs)
    steps = int(lengths[0])
    active = (lengths[None, :] > np.arange(steps)[:, None]).sum(axis=1)
    streams = encode(tables, steps, active, lambda s, k: (ids[s, :k], syms[s, :k]))
    out = np.full(syms.shape, -99, dtype=np.int64)

    def store(s, k, v):
        out[s, :k] = v

    decode(tables, steps, active, lambda s, k: ids[s, :k], streams, store)
    return streams, out


def test_many_streams_of_different_lengths_decode_exactly_near_the_entropy():
    rng = np.random.default_rng(0)
    n_tab, n_str, steps = 40, 300, 400
    counts = []
    for t in range(n_tab):
        span = [1, 2, 3, 9, 60, 700][t % 6]
        c = rng.integers(0, 50, span) + (t % 5 == 0) * np.eye(1, span, span // 2)[0] * 10**6
        c[span // 2] += 1  # never an empty table
        counts.append(c.astype(np.int64))
    freqs = [normalize(c[None])[0] for c in counts]
    lo = rng.integers(-300, 300, n_tab)
    ids = rng.integers(0, n_tab, (steps, n_str))
    p = [f / f.sum() for f in freqs]
    syms = np.zeros((steps, n_str), dtype=np.int64)
    for t in range(n_tab):
        where = ids == t
        syms[where] = lo[t] + rng.choice(len(p[t]), size=int(where.sum()), p=p[t])
    lengths = np.sort(rng.integers(1, steps + 1, n_str))[::-1]
    lengths[0] = steps
    streams, out = _run(freqs, lo, ids, syms, lengths)
    valid = np.arange(steps)[:, None] < lengths[None, :]
    assert np.array_equal(out[valid], syms[valid])
    bits = -sum(
        np.log2(freqs[t][s - lo[t]] / 2**PRECISION)
        for t, s in zip(ids[valid].tolist(), syms[valid].tolist())
    )
    total = sum(len(s) for s in streams)
    # within 0.1% of the ideal code length, plus at most 2 bytes of flush per stream
    assert bits / 8 <= total <= bits / 8 * 1.001 + 2 * n_str


def test_a_certain_symbol_costs_nothing_and_a_zero_frequency_one_is_refused():
    freqs = [np.array([2**PRECISION])]
    ids = np.zeros((1000, 3), np.int64)
    syms = np.full((1000, 3), 7)
    streams, out = _run(freqs, [7], ids, syms, np.array([1000, 1000, 1000]))
    assert np.array_equal(out, syms) and sum(len(s) for s in streams) <= 3
    tables = Tables.from_freqs(np.array([0]), [np.array([0, 2**PRECISION])])
    with pytest.raises(ValueError, match="zero frequency"):
        encode(tables, 1, np.array([1]), lambda s, k: (np.zeros(k, int), np.zeros(k, int)))
    with pytest.raises(ValueError, match="outside"):
        encode(tables, 1, np.array([1]), lambda s, k: (np.zeros(k, int), np.full(k, 5)))


def test_carries_run_back_through_ff_bytes_and_stay_in_their_stream():
    # stream 0 emits 0x12, 0xFF, 0xFF, then 0x105 (a carry): 0x13 00 00 05; stream 1 is 0x01
    who = [np.array([0, 1]), np.array([0]), np.array([0]), np.array([0])]
    what = [np.array([0x12, 0x01]), np.array([0xFF]), np.array([0xFF]), np.array([0x105])]
    assert _resolve(2, who, what) == [bytes([0x13, 0, 0, 5]), b"\x01"]


def test_normalize_sums_to_the_total_and_keeps_every_occurring_symbol():
    c = np.array([[10**9, 1, 0, 1, 5], [0, 0, 3, 0, 0], [1, 1, 1, 1, 1]])
    f = normalize(c)
    assert np.all(f.sum(axis=1) == 2**PRECISION)
    assert np.array_equal(f > 0, c > 0)
    assert np.array_equal(normalize(c), f)
    with pytest.raises(ValueError, match="no counts"):
        normalize(np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="non-negative"):
        normalize(np.array([[1, -1]]))


def test_varints_round_trip_and_refuse_short_data():
    v = np.array([0, 1, 127, 128, 300, 2**21, 2**35, 2**62])
    data = tb.varints(v)
    out, at = tb.unvarints(data, v.size)
    assert np.array_equal(out, v) and at == len(data)
    with pytest.raises(ValueError, match="varints expected"):
        tb.unvarints(data[:-1], v.size)


def test_tables_pack_and_unpack_exactly_and_refuse_a_wrong_blob():
    lo = np.array([-5, 0, 1000])
    counts = [np.array([1, 0, 4]), np.array([7]), np.array([0, 2, 300, 1])]
    blob = tb.pack(lo, counts)
    lo2, counts2 = tb.unpack(blob, 3)
    assert np.array_equal(lo2, lo) and all(np.array_equal(a, b) for a, b in zip(counts, counts2))
    with pytest.raises(ValueError, match="varints expected|span"):
        tb.unpack(blob, 4)
    extra = zlib.compress(zlib.decompress(blob) + b"\x05")
    with pytest.raises(ValueError, match="after the frequency tables"):
        tb.unpack(extra, 3)
    with pytest.raises(ValueError, match="not DEFLATE"):
        tb.unpack(b"junk", 3)
    empty = zlib.compress(tb.varints([0]) + tb.varints([2]) + tb.varints([0, 0]))
    with pytest.raises(ValueError, match="no counts"):
        tb.unpack(empty, 1)
