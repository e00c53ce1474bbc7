"""Chunks of a cache coded into bytes, and back: quantized symbols, their tables, their streams.

A chunk is a span of token positions, coded at one quality *level* and decodable alone
(CacheGen streams a context chunk by chunk, each at the level the bandwidth allows, arXiv
2310.07240 Sec. 5.3). For each layer-side of the chunk (layer 0's keys, layer 0's values,
layer 1's keys...) it holds the per-channel means, the quantization step, the delta flags,
the frequency tables and the range-coded streams. A stream is one layer-side's symbols for
one batch row and ``block`` consecutive tokens, token after token, channel after channel;
every stream of every chunk advances at once in :mod:`velox_cachegen.rangecoder`.

The bytes of a chunk (:func:`encode_chunks` gives them, :func:`decode_chunks` reads them):
a JSON object (``start``, ``stop``, ``level``, ``sections``: the byte length of each binary
section) and its binary sections in order: ``means`` (float16, every channel of every
layer-side), ``steps`` (float32, one per layer-side), ``delta`` (one bit per channel),
``pooled`` (one byte per layer-side: bit 0 the delta/plain tables pooled, bit 1 the anchor
tables pooled), ``tables`` (:mod:`velox_cachegen.tables`), ``lengths`` (varint byte length
of each stream) and ``streams`` (the streams back to back). Framing and checksums are the
container's (:mod:`velox_cachegen.container`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np

from . import rangecoder as rc
from . import tables as tb
from .quant import Quantized, anchors, dequantize, quantize

__all__ = ["SECTIONS", "Settings", "decode_chunks", "encode_chunks", "read_meta", "spans"]

SECTIONS = ("means", "steps", "delta", "pooled", "tables", "lengths", "streams")


def spans(tokens: int, window: int, chunk: int) -> list[tuple[int, int, bool]]:
    """The chunks of ``tokens`` positions: ``chunk`` at a time, then the last ``window``
    positions as a chunk of their own. Each is ``(start, stop, is_window)``."""
    w = min(window, tokens)
    body = tokens - w
    out = [(a, min(a + chunk, body), False) for a in range(0, body, chunk)]
    return out + ([(body, tokens, True)] if w else [])


@dataclass(frozen=True)
class Settings:
    """What every chunk of a file shares: ``group`` (tokens per anchor group),
    ``anchor_step`` (an anchor's step over the deltas'), ``delta`` (``"auto"``,
    ``"anchor"`` or ``"none"``), ``block`` (tokens per stream), ``batch`` and ``channels``
    (``C`` of each layer-side)."""

    group: int
    anchor_step: float
    delta: str
    block: int
    batch: int
    channels: tuple[int, ...]


@dataclass
class _Chunk:
    start: int
    stop: int
    level: float
    q: list[Quantized]  # one per layer-side
    pooled: list[tuple[bool, bool]]

    @property
    def n(self) -> int:
        return self.stop - self.start


def _split(q: Quantized, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(main symbols ``(N, C)`` with the anchors of delta channels masked out as a
    ``(N, C)`` bool, anchor symbols ``(M, C_delta)``)."""
    b, n, c = q.symbols.shape
    is_a = anchors(n, group)
    main = np.ones((b, n, c), bool)
    main[:, is_a] &= ~q.delta
    nd = int(q.delta.sum())
    anchor_syms = q.symbols[:, is_a][:, :, q.delta].reshape(b * int(is_a.sum()), nd)
    return main, anchor_syms


def _tables(q: Quantized, group: int) -> tuple[tuple[bool, bool], list, list]:
    """The tables of one layer-side: granularity chosen by estimated bytes."""
    main, anc = _split(q, group)
    syms = q.symbols
    c = syms.shape[2]
    per_channel = [syms[..., i][main[..., i]] for i in range(c)]

    def cost(lo, counts) -> float:
        bits = 0.0
        for x in counts:
            x = x[x > 0].astype(np.float64)
            bits -= float((x * np.log2(x / x.sum())).sum())
        return bits / 8 + len(tb.pack(lo, counts))

    span_lo = [int(x.min()) for x in per_channel]
    counts_c = [np.bincount(x - m) for x, m in zip(per_channel, span_lo)]
    lo_c = np.array(span_lo, dtype=np.int64)
    if max(len(x) for x in counts_c) > tb.MAX_SPAN:
        raise ValueError("a table spans too many symbols: the step is too fine for these values")
    lo_p, counts_p = tb.count(np.concatenate(per_channel)[:, None], False)
    pool_main = cost(lo_p, counts_p) < cost(lo_c, counts_c)
    lo_m, counts_m = (lo_p, counts_p) if pool_main else (lo_c, counts_c)
    pool_anchor = False
    lo_a, counts_a = np.zeros(0, np.int64), []
    if anc.size:
        lo_ac, counts_ac = tb.count(anc, True)
        lo_ap, counts_ap = tb.count(anc, False)
        pool_anchor = cost(lo_ap, counts_ap) < cost(lo_ac, counts_ac)
        lo_a, counts_a = (lo_ap, counts_ap) if pool_anchor else (lo_ac, counts_ac)
    return (pool_main, pool_anchor), [*lo_m, *lo_a], [*counts_m, *counts_a]


def _table_map(delta: np.ndarray, pooled: tuple[bool, bool], base: int) -> tuple[np.ndarray, int]:
    """``(2, C)`` table ids (row 0: delta/plain symbols, row 1: anchors; -1 where none) of one
    layer-side whose tables start at ``base``, and the number of its tables."""
    c = delta.size
    tm = np.full((2, c), -1, dtype=np.int64)
    n_main = 1 if pooled[0] else c
    tm[0] = base if pooled[0] else base + np.arange(c)
    nd = int(delta.sum())
    n_anchor = 0 if nd == 0 else (1 if pooled[1] else nd)
    if nd:
        tm[1, delta] = base + n_main + (0 if pooled[1] else np.arange(nd))
    return tm, n_main + n_anchor


@dataclass
class _Layout:
    """Every stream of a set of chunks with one channel count ``c``: where its tokens are in
    the flat ``(tokens, c)`` symbol array, its length, its layer-side's table-map row and its
    anchor phase (streams sorted longest first; ``order`` maps them back)."""

    c: int
    order: np.ndarray
    row0: np.ndarray  # first token row of each stream in the flat array
    tokens: np.ndarray
    row: np.ndarray
    phase: np.ndarray
    tm: np.ndarray  # (layer-sides, 2, c)
    delta: np.ndarray  # (layer-sides, c)
    group: int
    _at: tuple = (None, 0, None)  # the token _token last worked out: (j, k, table ids)

    def steps(self) -> tuple[int, np.ndarray]:
        n = self.tokens * self.c
        steps = int(n.max()) if n.size else 0
        active = np.searchsorted(-n, -np.arange(steps), side="left")
        return steps, active

    def _token(self, j: int) -> tuple[int, np.ndarray]:
        """Streams that hold a ``j``-th token, and each one's table ids ``(c, k)`` there."""
        if self._at[0] != j:
            k = int(np.searchsorted(-self.tokens, -j, side="left"))
            rows = self.row[:k]
            anchor = (self.phase[:k] + j) % self.group == 0
            use = anchor[:, None] & self.delta[rows]
            ids = np.ascontiguousarray(np.where(use, self.tm[rows, 1], self.tm[rows, 0]).T)
            self._at = (j, k, ids)
        return self._at[1], self._at[2]

    def table_ids(self, s: int, k: int) -> np.ndarray:
        j, ch = divmod(s, self.c)
        return self._token(j)[1][ch, :k]

    def reader(self, flat: np.ndarray):
        """``fetch(step, k)`` for :func:`velox_cachegen.rangecoder.encode` over ``flat``
        ``(tokens, c)``."""
        cache = {}

        def fetch(s: int, k: int):
            j, ch = divmod(s, self.c)
            if cache.get("j") != j:
                kj = self._token(j)[0]
                cache["j"], cache["rows"] = j, np.ascontiguousarray(flat[self.row0[:kj] + j].T)
            return self.table_ids(s, k), cache["rows"][ch, :k]

        return fetch

    def writer(self, flat: np.ndarray):
        """``(store, flush)`` for :func:`velox_cachegen.rangecoder.decode` into ``flat``."""
        state = {"j": None}

        def flush() -> None:
            if state["j"] is not None:
                k = state["buf"].shape[1]
                flat[self.row0[:k] + state["j"]] = state["buf"].T

        def store(s: int, k: int, v: np.ndarray) -> None:
            j, ch = divmod(s, self.c)
            if state["j"] != j:
                flush()
                state["j"], state["buf"] = j, np.empty((self.c, k), dtype=np.int64)
            state["buf"][ch] = v

        return store, flush


def _layouts(chunks: list[_Chunk], st: Settings, table_base: list[int]) -> list[_Layout]:
    """Stream layouts, one per channel count. Streams are numbered chunk by chunk, then by
    layer-side, batch row and block (the order of their bytes in the chunks); a layer-side's
    symbols sit in its channel count's flat array in the same order."""
    keys = ("sid", "base", "tok", "row", "ph", "tm", "d")
    per_c: dict[int, dict[str, list]] = {}
    filled: dict[int, int] = {}
    sid = 0
    for ci, ch in enumerate(chunks):
        tbase = table_base[ci]
        for li, (q, c) in enumerate(zip(ch.q, st.channels)):
            d = per_c.setdefault(c, {k: [] for k in keys})
            tm, n_tables = _table_map(q.delta, ch.pooled[li], tbase)
            tbase += n_tables
            row = len(d["tm"])
            d["tm"].append(tm)
            d["d"].append(q.delta)
            flat0 = filled.get(c, 0)
            for b in range(st.batch):
                for t0 in range(0, ch.n, st.block):
                    d["sid"].append(sid)
                    d["base"].append(flat0 + b * ch.n + t0)
                    d["tok"].append(min(st.block, ch.n - t0))
                    d["row"].append(row)
                    d["ph"].append(t0 % st.group)
                    sid += 1
            filled[c] = flat0 + st.batch * ch.n
    layouts = []
    for c, d in per_c.items():
        tok = np.array(d["tok"], dtype=np.int64)
        order = np.argsort(-tok, kind="stable")
        sid, base, row, ph = (
            np.array(d[k], dtype=np.int64)[order] for k in ("sid", "base", "row", "ph")
        )
        layouts.append(
            _Layout(
                c,
                sid,
                base,
                tok[order],
                row,
                ph,
                np.stack(d["tm"]),
                np.stack(d["d"]),
                st.group,
            )
        )
    return layouts


def _coder_tables(blobs: list[tuple[np.ndarray, list[np.ndarray]]]) -> rc.Tables:
    lo = np.concatenate([np.asarray(lo, np.int64) for lo, _ in blobs])
    return rc.Tables.from_freqs(lo, rc.normalize_each([c for _, cs in blobs for c in cs]))


def _table_bases(blobs) -> list[int]:
    return np.cumsum([0] + [len(lo) for lo, _ in blobs[:-1]]).astype(int).tolist()


def _flats(chunks: list[_Chunk], st: Settings) -> dict[int, list[np.ndarray]]:
    flats: dict[int, list[np.ndarray]] = {}
    for ch in chunks:
        for q, c in zip(ch.q, st.channels):
            flats.setdefault(c, []).append(q.symbols.reshape(-1))
    return flats


def encode_chunks(
    spans: list[tuple[int, int, float]],
    xs: list[list[np.ndarray]],
    steps: list[list[float]],
    st: Settings,
) -> list[bytes]:
    """The bytes of each chunk (module docstring).

    Args:
        spans: each chunk's ``(start, stop, level)``.
        xs: each chunk's layer-sides, ``(B, n, C)`` float32 each.
        steps: each chunk's quantization step per layer-side.
    """
    chunks, blobs = [], []
    for (a, b, level), x_ls, s_ls in zip(spans, xs, steps):
        qs = [quantize(x, s, st.anchor_step, st.group, st.delta) for x, s in zip(x_ls, s_ls)]
        pooled, lo, counts = [], [], []
        for q in qs:
            p, lo_i, counts_i = _tables(q, st.group)
            pooled.append(p)
            lo.extend(lo_i)
            counts.extend(counts_i)
        chunks.append(_Chunk(a, b, level, qs, pooled))
        blobs.append((np.array(lo, np.int64), counts))
    tables = _coder_tables(blobs)
    flats = _flats(chunks, st)
    streams: dict[int, bytes] = {}
    for lay in _layouts(chunks, st, _table_bases(blobs)):
        flat = np.concatenate(flats[lay.c]).astype(np.int64).reshape(-1, lay.c)
        n_steps, active = lay.steps()
        coded = rc.encode(tables, n_steps, active, lay.reader(flat))
        streams.update(zip(lay.order.tolist(), coded))
    frames, sid = [], 0
    for ch, (lo, counts) in zip(chunks, blobs):
        n_streams = len(st.channels) * st.batch * -(-ch.n // st.block)
        frames.append(_frame(ch, lo, counts, [streams[i] for i in range(sid, sid + n_streams)]))
        sid += n_streams
    return frames


def _frame(ch: _Chunk, lo: np.ndarray, counts: list, streams: list[bytes]) -> bytes:
    delta = np.concatenate([q.delta for q in ch.q])
    sections = {
        "means": np.concatenate([q.mean for q in ch.q]).astype("<f2").tobytes(),
        "steps": np.array([q.step for q in ch.q], dtype="<f4").tobytes(),
        "delta": np.packbits(delta).tobytes(),
        "pooled": bytes(int(p[0]) | int(p[1]) << 1 for p in ch.pooled),
        "tables": tb.pack(lo, counts),
        "lengths": tb.varints(np.array([len(s) for s in streams])),
        "streams": b"".join(streams),
    }
    meta = {
        "start": ch.start,
        "stop": ch.stop,
        "level": ch.level,
        "sections": [len(sections[k]) for k in SECTIONS],
    }
    text = json.dumps(meta, separators=(",", ":")).encode()
    return len(text).to_bytes(4, "little") + text + b"".join(sections[k] for k in SECTIONS)


def read_meta(data: bytes) -> tuple[dict, dict[str, bytes]]:
    """A chunk's JSON object and its sections, their lengths checked.

    Raises:
        ValueError: not such a chunk.
    """
    if len(data) < 4:
        raise ValueError("a chunk shorter than its own length field")
    n = int.from_bytes(data[:4], "little")
    if n > len(data) - 4:
        raise ValueError(f"a chunk header of {n} bytes in {len(data)} bytes")
    try:
        meta = json.loads(data[4 : 4 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"a chunk header that is not JSON ({e})") from None
    want = {"start", "stop", "level", "sections"}
    if not isinstance(meta, dict) or set(meta) != want:
        raise ValueError(
            f"a chunk header with fields {sorted(meta) if isinstance(meta, dict) else meta!r}"
        )
    for k in ("start", "stop"):
        if isinstance(meta[k], bool) or not isinstance(meta[k], int) or meta[k] < 0:
            raise ValueError(f"a chunk {k} of {meta[k]!r}")
    lv = meta["level"]
    if isinstance(lv, bool) or not isinstance(lv, (int, float)) or not 0 < lv < float("inf"):
        raise ValueError(f"a chunk level of {lv!r}")
    sizes = meta["sections"]
    if (
        not isinstance(sizes, list)
        or len(sizes) != len(SECTIONS)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes)
    ):
        raise ValueError(f"chunk section sizes {sizes!r}")
    at = 4 + n
    if at + sum(sizes) != len(data):
        raise ValueError(f"chunk sections of {sum(sizes)} bytes in {len(data) - at}")
    sections = {}
    for k, size in zip(SECTIONS, sizes):
        sections[k] = data[at : at + size]
        at += size
    return meta, sections


def _parse(data: bytes, st: Settings, span: tuple[int, int]) -> tuple[_Chunk, tuple, list]:
    meta, sec = read_meta(data)
    if (meta["start"], meta["stop"]) != span:
        raise ValueError(f"a chunk of tokens {meta['start']}..{meta['stop']}, expected {span}")
    n_ls, total_c = len(st.channels), sum(st.channels)
    n = span[1] - span[0]
    want = {
        "means": 2 * total_c,
        "steps": 4 * n_ls,
        "delta": -(-total_c // 8),
        "pooled": n_ls,
    }
    for k, size in want.items():
        if len(sec[k]) != size:
            raise ValueError(f"chunk section {k} of {len(sec[k])} bytes, expected {size}")
    means = np.frombuffer(sec["means"], dtype="<f2")
    steps = np.frombuffer(sec["steps"], dtype="<f4")
    if not (np.all(np.isfinite(means)) and np.all(np.isfinite(steps)) and np.all(steps > 0)):
        raise ValueError("chunk means or steps that are not finite (or steps <= 0)")
    delta = np.unpackbits(np.frombuffer(sec["delta"], np.uint8))[:total_c].astype(bool)
    pooled_b = np.frombuffer(sec["pooled"], np.uint8)
    if np.any(pooled_b > 3):
        raise ValueError("chunk pooled flags above 3")
    bounds = np.concatenate([[0], np.cumsum(st.channels)])
    qs, pooled, n_tables = [], [], 0
    for i in range(n_ls):
        d = delta[bounds[i] : bounds[i + 1]]
        if n < 2 and d.any():
            raise ValueError("delta channels in a chunk of one token")
        p = (bool(pooled_b[i] & 1), bool(pooled_b[i] & 2))
        n_tables += _table_map(d, p, 0)[1]
        empty = np.zeros((st.batch, n, st.channels[i]), np.int32)
        qs.append(Quantized(means[bounds[i] : bounds[i + 1]], steps[i], d, empty))
        pooled.append(p)
    lo, counts = tb.unpack(sec["tables"], n_tables)
    n_streams = n_ls * st.batch * -(-n // st.block)
    lengths, end = tb.unvarints(sec["lengths"], n_streams)
    if end != len(sec["lengths"]) or lengths.sum() != len(sec["streams"]):
        raise ValueError("chunk stream lengths that do not add up to its streams")
    at = np.concatenate([[0], np.cumsum(lengths)])
    streams = [sec["streams"][a:b] for a, b in itertools.pairwise(at)]
    return _Chunk(span[0], span[1], float(meta["level"]), qs, pooled), (lo, counts), streams


def decode_chunks(frames: list[bytes], spans: list[tuple[int, int]], st: Settings) -> list[list]:
    """Each chunk's layer-sides, ``(B, n, C)`` float32, from :func:`encode_chunks`'s bytes
    (``spans``: each chunk's ``(start, stop)``, as the file's header gives them).

    Raises:
        ValueError: a chunk whose fields disagree with ``spans`` and ``st``.
    """
    parsed = [_parse(f, st, sp) for f, sp in zip(frames, spans)]
    chunks = [p[0] for p in parsed]
    blobs = [p[1] for p in parsed]
    streams = [s for p in parsed for s in p[2]]
    tables = _coder_tables(blobs)
    tokens = sum(ch.n for ch in chunks)
    flats = {
        c: np.zeros((st.batch * tokens * st.channels.count(c), c), np.int64) for c in st.channels
    }
    for lay in _layouts(chunks, st, _table_bases(blobs)):
        n_steps, active = lay.steps()
        store, flush = lay.writer(flats[lay.c])
        rc.decode(tables, n_steps, active, lay.table_ids, [streams[i] for i in lay.order], store)
        flush()
    out, used = [], dict.fromkeys(flats, 0)
    for ch in chunks:
        sides = []
        for q, c in zip(ch.q, st.channels):
            size = st.batch * ch.n
            sym = flats[c][used[c] : used[c] + size].reshape(st.batch, ch.n, c)
            used[c] += size
            q = Quantized(q.mean, q.step, q.delta, sym.astype(np.int32))
            sides.append(dequantize(q, st.anchor_step, st.group))
        out.append(sides)
    return out
