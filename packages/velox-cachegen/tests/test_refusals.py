"""What CacheGen refuses: truncated, altered and crafted files, and bad arguments, each with a
``ValueError`` (or ``TypeError``) that names what is wrong."""

import json

import pytest
from _cg_util import TMP, prefilled
from mlx_lm.models.cache import RotatingKVCache

import velox_cachegen as cg
from velox_cachegen.chunks import SECTIONS, read_meta
from velox_cachegen.container import frame, head, split
from velox_cachegen.header import chunk_count
from velox_core import save_cache

STEPS = cg.LayerSteps((1.0, 1.0), (1.0, 1.0))


def _data():
    return cg.encode(prefilled(150), chunk=64, window=16, layer_steps=STEPS)


def _craft(data, header=None, chunk=None, which=0):
    """``data`` with its header or one chunk edited, every checksum made right again."""
    h, frames = split(data, chunk_count)
    if header:
        header(h)
    if chunk:
        meta, sec = read_meta(frames[which])
        chunk(meta, sec)
        meta["sections"] = [len(sec[k]) for k in SECTIONS]
        text = json.dumps(meta).encode()
        frames[which] = len(text).to_bytes(4, "little") + text + b"".join(sec[k] for k in SECTIONS)
    return head(h) + b"".join(frame(f) for f in frames)


def test_truncated_altered_and_foreign_files_are_refused(tmp_path):
    data = _data()
    last = split(data, chunk_count)[1][-1]
    cases = {
        "empty": (b"", "no VXCGEN01 magic"),
        "magic": (b"VXCGEN02" + data[8:], "no VXCGEN01 magic"),
        "header cut": (data[:40], "truncated: the header"),
        "one chunk cut": (data[:-10], r"truncated: chunk 3 of 4"),
        "a chunk gone": (data[: len(data) - len(last) - 36], "chunk 3 of 4 missing"),
        "flipped header": (
            data[:20] + bytes([data[20] ^ 1]) + data[21:],
            "checksum mismatch in the header",
        ),
        "flipped chunk": (data[:-100] + bytes([data[-100] ^ 4]) + data[-99:], "in chunk 3 of 4"),
        "appended": (data + b"\0", "1 bytes after the last chunk"),
    }
    for name, (blob, match) in cases.items():
        path = tmp_path / f"{name}.cgen"
        path.write_bytes(blob)
        with pytest.raises(ValueError, match=match):
            cg.load(path)
        with pytest.raises(ValueError, match=match):
            cg.decode(blob)
    for n in range(0, len(data), max(1, len(data) // 37)):  # every cut point is refused
        with pytest.raises(ValueError):
            cg.decode(data[:n])
    save_cache(tmp_path / "plain.safetensors", prefilled(20))
    with pytest.raises(ValueError, match="magic"):
        cg.load(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="no such file"):
        cg.load(tmp_path / "missing.cgen")
    with pytest.raises(TypeError, match="takes bytes"):
        cg.decode("not bytes")


def _set(key, value):
    return lambda h: h.__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(header=_set("format", "other")), "format 'other'"),
        (dict(header=_set("version", 2)), "version 2"),
        (dict(header=_set("tokens", 151)), "cover 150 tokens, the header 151"),
        (dict(header=_set("batch", 0)), "batch must be an int >= 1"),
        (dict(header=_set("group", 1)), "group must be an int >= 2"),
        (dict(header=_set("delta", "sideways")), "delta 'sideways'"),
        (dict(header=_set("anchor_step", -1)), "anchor_step must be a positive number"),
        (dict(header=_set("extra", 1)), "fields"),
        (dict(header=_set("geometry", [[2, 32, 32]])), "geometry"),
        (dict(header=_set("chunks", [[0, 64], [60, 128], [128, 134], [134, 150]])), "back to"),
        (dict(header=lambda h: h["layers"][0].__setitem__("kind", "pickle")), "unknown kind"),
        (dict(header=lambda h: h["layers"][1].__setitem__("dtype", "int8")), "dtype"),
        (dict(header=lambda h: h["quality"]["layer_steps"].__setitem__("key", [1])), "layer_steps"),
        (dict(header=_set("user", {"a": 1})), "map str to str"),
        (dict(chunk=lambda m, s: m.__setitem__("start", 1)), "tokens 1..64, expected"),
        (dict(chunk=lambda m, s: m.__setitem__("level", 0)), "level of 0"),
        (dict(chunk=lambda m, s: s.__setitem__("means", s["means"][:-2])), "means of"),
        (dict(chunk=lambda m, s: s.__setitem__("steps", b"\0" * len(s["steps"]))), "steps <= 0"),
        (
            dict(chunk=lambda m, s: s.__setitem__("means", b"\xff" * len(s["means"]))),
            "not finite",
        ),
        (dict(chunk=lambda m, s: s.__setitem__("pooled", b"\x07" * len(s["pooled"]))), "above 3"),
        (dict(chunk=lambda m, s: s.__setitem__("tables", b"junk")), "not DEFLATE"),
        (dict(chunk=lambda m, s: s.__setitem__("streams", s["streams"][:-1])), "add up"),
        (dict(chunk=lambda m, s: s.__setitem__("lengths", s["lengths"] + b"\1")), "add up"),
    ],
)
def test_crafted_files_are_refused(edit, match):
    data = _data()
    cg.decode(_craft(data))  # the crafting itself keeps a file valid
    with pytest.raises(ValueError, match=match):
        cg.decode(_craft(data, **edit))


def test_a_chunk_header_that_is_not_its_own_is_refused():
    data = _data()
    h, frames = split(data, chunk_count)
    swapped = head(h) + b"".join(frame(f) for f in (frames[1], frames[0], *frames[2:]))
    with pytest.raises(ValueError, match="tokens 64..128, expected"):
        cg.decode(swapped)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(step=0), ValueError, "step must be a finite number > 0"),
        (dict(step="2"), TypeError, "step must be a number"),
        (dict(window_step=float("inf")), ValueError, "window_step"),
        (dict(anchor_step=0), ValueError, "anchor_step"),
        (dict(window=-1), ValueError, "window must be >= 0"),
        (dict(chunk=0), ValueError, "chunk must be >= 1"),
        (dict(group=1), ValueError, "group must be >= 2"),
        (dict(delta="both"), ValueError, "delta must be one of auto, anchor, none"),
        (dict(metadata={"a": 1}), TypeError, "metadata"),
        (dict(layer_steps=cg.LayerSteps((1.0,), (1.0,))), ValueError, "for 1 layers"),
        (dict(layer_steps=3), TypeError, "layer_steps must be"),
        (dict(layer_steps="missing.safetensors"), ValueError, "missing.safetensors"),
    ],
)
def test_encode_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        cg.encode(prefilled(40), **kwargs)


def test_encode_refuses_caches_it_cannot_read():
    caches = prefilled(40)
    k, v = caches[1].keys_and_values()
    caches[1].state = (k.at[0, 0, 3, 1].add(float("nan")), v, 40)
    with pytest.raises(ValueError, match="layer 1 holds NaN or inf"):
        cg.encode(caches)
    with pytest.raises(ValueError, match="RotatingKVCache"):
        cg.encode([RotatingKVCache(max_size=8)])
    with pytest.raises(ValueError, match="non-empty list"):
        cg.encode([])
    with pytest.raises(TypeError, match="unexpected arguments"):
        cg.save(TMP / "x.cgen", prefilled(40), ratio=3)
    with pytest.raises(TypeError, match="unexpected arguments"):
        cg.encode_levels(prefilled(40), step=2.0)
    with pytest.raises(ValueError, match="levels"):
        cg.encode_levels(prefilled(40), levels=())


def test_layer_steps_refuse_bad_values():
    with pytest.raises(ValueError, match="positive finite"):
        cg.LayerSteps((1.0, 0.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="2 entries for 1 layers"):
        cg.LayerSteps((1.0,), (1.0, 1.0))
    with pytest.raises(TypeError, match="sequence of numbers"):
        cg.LayerSteps("ab", (1.0, 1.0))
    assert cg.LayerSteps.reference(6).key == (1.0, 1.0, 2.0, 2.0, 2.0, 2.0)
    assert cg.LayerSteps.reference(32).value[:3] == (1.0, 1.0, 2.0)
