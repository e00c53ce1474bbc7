"""The bad-input sweep: hostile specs, command lines and saved cache files against velox.

    python tools/bad_input_sweep.py [--parts specs cli files] [--per-param 2] [--timeout 60]
                                    [--json OUT]

Three parts, each case run in a worker process (one at a time, restarted after a case that
hangs or kills it), on the tiny llama of ``velox_testing`` (2 layers, 2 KV heads, head dim 64):

* ``specs``: for every installed method, every parameter given values it should refuse (NaN
  and infinities for numbers, negative and huge counts, fractions for whole numbers, text for
  numbers, numbers for names), plus malformed spec strings; each through ``make_cache`` and a
  48-token prefill and 3 decode steps of the model with attention routed to velox.
* ``cli``: ``velox generate``, ``bench`` and ``serve`` with bad specs and bad options, run by
  ``velox_cli.main.main`` (``serve`` stops where it would listen).
* ``files``: caches of nine kinds (velox caches coded per token, per channel group, with a
  retention policy, with per-head budgets; mlx-lm's ``KVCache``, ``QuantizedKVCache`` and
  ``RotatingKVCache``) saved, then altered: header fields changed and the checksum signed
  again (a crafted file), bytes flipped or cut (a damaged one); each loaded by ``load_cache``
  and, where it loads, used (a decode step and attention over what it holds).

Outcomes, counted per part: ``refused`` (a ``ValueError``/``TypeError`` raised by velox with a
message, or exit status 2 with one line); ``accepted`` (ran, finite output: for specs and
options, a value velox takes); ``nonfinite`` (ran, NaN/inf output: a value accepted silently
with a wrong meaning); ``crash`` (an exception raised inside MLX or mlx-lm, or of another
type); ``raw`` (refused with a raw ``KeyError``/``TypeError``/``IndexError`` text); ``hang``
(past the timeout); ``died`` (the worker process died). For files, ``silent`` is an altered
file that loaded and served a decode step (every alteration contradicts the arrays or the
checksum), and ``used-crash`` one that loaded and failed at first use. The targets: 0
``crash``, ``hang``, ``died``, ``nonfinite``, ``silent``, ``used-crash`` and ``raw``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

BAD_OUTCOMES = ("crash", "hang", "died", "nonfinite", "silent", "used-crash", "raw")
_MLX_DIRS = (os.sep + "mlx" + os.sep, os.sep + "mlx_lm" + os.sep)


# --- classification --------------------------------------------------------------------------


def _deepest_frame(tb) -> str:
    frames = traceback.extract_tb(tb)
    return frames[-1].filename if frames else ""


def classify(e: BaseException) -> str:
    """``refused`` for a velox refusal, ``raw`` for a raw lookup/type error text, ``crash`` for
    an error from inside MLX or mlx-lm (or of another type)."""
    text = str(e)
    where = _deepest_frame(e.__traceback__)
    inside = any(d in where for d in _MLX_DIRS) or text.lstrip().startswith("[")
    if isinstance(e, (KeyError, IndexError, AttributeError)):
        return "raw"
    if isinstance(e, (ValueError, TypeError, FileNotFoundError)) and text.strip():
        if inside:
            return "crash"
        if isinstance(e, TypeError) and ("object is not" in text or "unsupported operand" in text):
            return "raw"  # Python's own message for a value of the wrong type, unchecked
        return "refused"
    return "crash"


# --- the worker's cases --------------------------------------------------------------------------

_STATE: dict = {}


def _model():
    if "model" not in _STATE:
        from velox_testing import tiny_model

        _STATE["model"] = tiny_model("llama", head_dim=64, hidden_size=128, vocab_size=512)
    return _STATE["model"]


def _finite(logits) -> bool:
    import mlx.core as mx

    return bool(mx.all(mx.isfinite(logits)).item())


def spec_case(spec: str) -> tuple[str, str]:
    """A spec through make_cache and a short prefill and decode of the tiny model."""
    import mlx.core as mx

    import velox_core

    model = _model()
    try:
        caches = velox_core.make_cache(model, spec)
        tokens = mx.array([[(7 * i + 3) % 500 for i in range(48)]])
        ok = True
        with velox_core.routed(model):
            logits = model(tokens, cache=caches)
            ok &= _finite(logits)
            for _ in range(3):
                nxt = mx.argmax(logits[:, -1:], axis=-1)
                logits = model(nxt, cache=caches)
                ok &= _finite(logits)
        return ("accepted" if ok else "nonfinite"), ""
    except Exception as e:
        return classify(e), f"{type(e).__name__}: {str(e)[:160]}"


class _WouldListen(Exception):
    pass


def cli_case(argv: list[str]) -> tuple[str, str]:
    """One ``velox`` command line, in this process; ``velox serve`` stops where it would
    listen (that is an acceptance)."""
    import mlx_lm.server as server

    from velox_cli import serve as vs
    from velox_cli.main import main

    def would_listen(host, port, response_generator, *a, **k):
        response_generator.stop_and_join()
        raise _WouldListen

    vs._ORIGINALS[(server, "_run_http_server")] = would_listen
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    except _WouldListen:
        return "accepted", "listened"
    except SystemExit as e:
        rc = e.code
    except Exception as e:
        return classify(e), f"{type(e).__name__}: {str(e)[:160]}"
    lines = [x for x in err.getvalue().splitlines() if x.strip() and "preloading" not in x]
    if rc == 2 and lines and lines[-1].startswith(("velox: error:", "usage:")) is False:
        return "refused", lines[-1][:160]
    if rc == 2:
        tail = lines[-1] if lines else ""
        raw = any(w in tail for w in ("KeyError", "IndexError", "Traceback"))
        return ("raw" if raw else "refused"), tail[:160]
    return ("accepted" if rc == 0 else "crash"), f"exit {rc}"


def file_case(path: str) -> tuple[str, str]:
    """Load an altered file; where it loads, use every layer (a decode step of new tokens and
    attention over what the cache holds)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    from velox_core import VeloxCache, load_cache

    try:
        caches = load_cache(path)
    except Exception as e:
        return classify(e), f"{type(e).__name__}: {str(e)[:160]}"
    try:
        for c in caches:
            if isinstance(c, VeloxCache):
                b, h, dk, dv = c._dims or (1, 2, 64, 64)
                k = mx.random.normal((b, h, 1, dk)).astype(mx.float16)
                v = mx.random.normal((b, h, 1, dv)).astype(mx.float16)
                c.routed = True
                c.update_and_fetch(k, v)
                q = mx.random.normal((b, 2 * h, 1, dk)).astype(mx.float16)
                out = c.attend(q, dk**-0.5)
                if not _finite(out):
                    return "used-crash", "non-finite attention"
            elif isinstance(c, (KVCache, RotatingKVCache, QuantizedKVCache)):
                keys = c.keys[0] if isinstance(c, QuantizedKVCache) else c.keys
                if keys is None:
                    continue
                b, h = keys.shape[:2]
                d = 64
                k = mx.random.normal((b, h, 1, d)).astype(mx.float16)
                out = c.update_and_fetch(k, k)
                mx.eval(out)
    except Exception as e:
        return "used-crash", f"{type(e).__name__}: {str(e)[:160]}"
    return "silent", "loaded and used"


def _run(kind: str, payload) -> tuple[str, str]:
    import warnings

    warnings.simplefilter("ignore")
    return {"spec": spec_case, "cli": cli_case, "file": file_case}[kind](payload)


def _init_worker() -> None:
    import resource

    try:  # a case that asks for absurd memory fails in the worker, not on the machine
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
    except (ValueError, OSError):
        pass


# --- the cases ---------------------------------------------------------------------------------


def _bad_values(default) -> list[str]:
    if isinstance(default, bool):
        return ["2", "maybe"]
    if isinstance(default, int):
        return ["-1", "2.5", "abc", "1000000000000"]
    if isinstance(default, float):
        return ["nan", "inf", "-1", "abc"]
    if isinstance(default, str):
        return ["bogus", "5"]
    if isinstance(default, tuple):
        return ["nan", "abc"]
    return ["nan", "-3", "abc", "-inf"]  # None: an optional number, name or path


def spec_cases(per_param: int) -> list[str]:
    from velox_core.registry import method_params, methods

    out = []
    for name in methods():
        for param, default in method_params(name).items():
            for value in _bad_values(default)[:per_param]:
                out.append(f"{name}:{param}={value}")
        out.append(f"{name}:nosuch=1")
    out += [
        "",
        ":",
        "uniform:",
        "uniform:bits",
        "uniform:=4",
        "uniform:bits=4,,",
        "uniform:bits=4,bits=2",
        "uniform bits=4",
        "nosuch",
        "UNIFORM:bits=4",
        "uniform:bits=4+",
        "+uniform",
        "snapkv:budget=64+nosuch",
        "snapkv:budget=64+snapkv:budget=64",
        "uniform:bits=4+turboquant:bits=3",
        "uniform:bits=nan",
        "uniform:group=48",
        "uniform:bits=4,group=0",
        "uniform:clip=nan",
        "skvq:clip_min=nan",
        "turboquant:bits=3.3",
        "turboquant:bits=3.5,group=0",
        "kivi:bits=2,window=-1",
        "snapkv:budget=0",
        "snapkv:budget=-5",
        "snapkv:budget=10",
        "h2o:budget=64,recent=2.0",
        "uniform:bits=4,flush=0",
        "uniform:bits=4,flush=nan",
        "uniform:bits=4,check_finite=2",
    ]
    return out


def cli_cases(model: str, text: str) -> list[list[str]]:
    gen = ["generate", "--model", model, "--max-tokens", "2", "--prompt", "def f():"]
    bench = ["bench", "--model", model, "--data", text, "--quick", "--context", "32"]
    bench += ["--jobs", "1", "--chart", ""]
    serve = ["serve", "--model", model, "--port", "0"]
    out: list[list[str]] = []
    for spec in (
        "nosuch",
        "uniform:bits=nan",
        "uniform:group=48",
        "uniform:clip=nan",
        "skvq:clip_min=nan",
        "snapkv:budget=-1",
        "turboquant:bits=9",
        "kivi:bits=2,window=abc",
        "uniform:bits=4+nosuch",
        "",
    ):
        out.append([*gen, "--method", spec])
        out.append([*bench, "--methods", spec])
        out.append([*serve, "--method", spec])
    for opt in (
        ["--max-tokens", "0"],
        ["--max-tokens", "-3"],
        ["--max-tokens", "abc"],
        ["--temp", "nan"],
        ["--temp", "-1"],
        ["--temp", "inf"],
        ["--model", "/no/such/model"],
        ["--model", text],
        ["--save-cache", "out.bin"],
        ["--pipeline"],
    ):
        out.append([*gen, *opt])
    for opt in (
        ["--context", "0"],
        ["--context", "-5"],
        ["--samples", "0"],
        ["--continuation", "0"],
        ["--chunk", "0"],
        ["--jobs", "-1"],
        ["--recall-trials", "0"],
        ["--data", "/no/such/file.txt"],
        ["--context", "100000"],
        ["--all", "--methods", "fp16"],
        ["--transfer-mapper", "/no/such"],
        ["--methods", "mlx-q4:group=48"],
        ["--methods", "fp16:bits=4"],
    ):
        out.append([*bench, *opt])
    for opt in (
        ["--method", "uniform:bits=4", "--kv-bits", "4"],
        ["--method", "uniform:bits=4", "--model", "/no/such/model"],
        ["--method", "uniform:bits=4", "--prompt-cache-bytes", "10K"],
        ["--method", "uniform:bits=4", "--port", "abc"],
        ["--method", "uniform:bits=4", "--storage-dtype", "int8"],
    ):
        out.append(["serve", "--model", model, *opt] if "--model" not in opt else ["serve", *opt])
    out += [
        ["inspect", "/no/such.safetensors"],
        ["inspect", text],
        ["fit", "nosuch"],
        ["methods", "--bogus"],
        ["nosuch-command"],
        ["plan", "--memory", "abc", "--context", "4k", "--shape", "llama3-8b"],
        ["plan", "--memory", "24GB", "--context", "-4k", "--shape", "llama3-8b"],
        ["plan", "--memory", "24GB", "--context", "4k", "--shape", "nosuch"],
    ]
    return out


def _saved_kinds(folder: Path) -> dict[str, Path]:
    """One saved file per kind of cache, filled by the tiny model."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    import velox_core
    from velox_core import make_cache, save_cache

    model = _model()
    tokens = mx.array([[(5 * i + 1) % 500 for i in range(100)]])
    out = {}
    for name, spec in (
        ("uniform", "uniform:bits=4"),
        ("kivi", "kivi:bits=2,group=32,window=16"),
        ("turboquant", "turboquant:bits=3"),
        ("snapkv", "snapkv:budget=48,bits=4,group=32"),
        ("adakv", "adakv:budget=48"),
        ("mlx-kv", lambda i: KVCache()),
        ("mlx-q4", lambda i: QuantizedKVCache(group_size=64, bits=4)),
        ("mlx-rot", lambda i: RotatingKVCache(max_size=64)),
    ):
        caches = make_cache(model, spec)
        with velox_core.routed(model):
            model(tokens, cache=caches)
            for t in (3, 4, 5):
                model(mx.array([[t]]), cache=caches)
        path = folder / f"{name}.safetensors"
        save_cache(path, caches)
        out[name] = path
    return out


def _resign(src: Path, dst: Path, edit) -> None:
    import mlx.core as mx

    from velox_core.io import _digest

    arrays, header = mx.load(str(src), return_metadata=True)
    layers = json.loads(header["layers"])
    arrays = edit(arrays, header, layers) or arrays
    header["layers"] = json.dumps(layers)
    header["sha256"] = _digest(arrays, header)
    mx.save_safetensors(str(dst), arrays, header)


def _other(method: str) -> str:
    return "kivi" if method != "kivi" else "uniform"


def _other_class(name: str) -> str:
    return "QuantizedKVCache" if name != "QuantizedKVCache" else "KVCache"


# Alterations a kind of cache cannot tell from a state it may hold, left out for it: a larger
# offset of an evicting cache (tokens seen and evicted), a group its uncoded tokens never use,
# a smaller offset of mlx-lm's KVCache (a trimmed cache: its slots past the offset are free),
# the write index of a full rotating cache (any slot may be next)
NOT_CONTRADICTIONS = {
    "snapkv": ("offset larger",),
    "adakv": ("offset larger", "config group"),
    "mlx-kv": ("last number",),
    "mlx-rot": ("last number",),
}


def _velox_edits() -> list[tuple[str, object]]:
    """Header and array alterations of a velox layer, each contradicting the arrays."""
    import mlx.core as mx

    def meta(f):
        def edit(arrays, header, layers):
            f(layers[0]["meta"], arrays, layers[0])

        return edit

    def first_store(m):
        return next(iter(m["stores"]))

    def arr(arrays, pred):
        return next(k for k in arrays if k.startswith("layer0.") and pred(k))

    def scale_nan(m, arrays, layer):
        k = arr(arrays, lambda k: arrays[k].dtype in (mx.float16, mx.float32))
        a = arrays[k]
        arrays[k] = mx.where(mx.arange(a.size).reshape(a.shape) == 0, float("nan"), a)

    def shrink_array(m, arrays, layer):
        k = arr(arrays, lambda k: ".store." in k and arrays[k].shape[2] > 1)
        arrays[k] = arrays[k][:, :, :-1]

    def grow_dtype(m, arrays, layer):
        k = arr(arrays, lambda k: ".store." in k)
        arrays[k] = arrays[k].astype(mx.float32 if arrays[k].dtype != mx.float32 else mx.int32)

    def extra_array(m, arrays, layer):
        arrays["layer0.store.win.k.evil"] = mx.zeros((1, 2, 1, 4))

    def drop_array(m, arrays, layer):
        del arrays[arr(arrays, lambda k: ".store." in k)]

    def config_bits(m, arrays, layer):
        c = m["config"]
        if "bits" in c:
            c["bits"] = 2 if c["bits"] != 2 else 8
        elif c.get("tiers"):
            c["tiers"][0]["key"]["bits"] = 2

    def config_group(m, arrays, layer):
        m["config"]["group"] = 16 if m["config"].get("group") != 16 else 32

    def wipe_config(m, arrays, layer):
        m["config"] = {"bogus": 1}

    edits = [
        ("offset huge", meta(lambda m, a, l: m.update(offset=10**15))),
        ("offset 2**40", meta(lambda m, a, l: m.update(offset=2**40))),
        ("offset float", meta(lambda m, a, l: m.update(offset=1.5))),
        ("offset string", meta(lambda m, a, l: m.update(offset="12"))),
        ("offset smaller", meta(lambda m, a, l: m.update(offset=3))),
        ("offset larger", meta(lambda m, a, l: m.update(offset=m["offset"] + 50))),
        ("offset missing", meta(lambda m, a, l: m.pop("offset"))),
        ("dims missing", meta(lambda m, a, l: m.pop("dims"))),
        ("dims short", meta(lambda m, a, l: m.update(dims=[1, 2]))),
        ("dims heads", meta(lambda m, a, l: m.update(dims=[1, 3, 64, 64]))),
        ("dims batch", meta(lambda m, a, l: m.update(dims=[4, 2, 64, 64]))),
        ("dims keydim", meta(lambda m, a, l: m.update(dims=[1, 2, 32, 64]))),
        ("dims huge", meta(lambda m, a, l: m.update(dims=[1, 2, 10**9, 64]))),
        ("dtype int", meta(lambda m, a, l: m.update(dtype="int32"))),
        ("dtype evil", meta(lambda m, a, l: m.update(dtype="__class__"))),
        ("ragged 10**8", meta(lambda m, a, l: m.update(ragged=10**8))),
        ("ragged -1", meta(lambda m, a, l: m.update(ragged=-1))),
        ("ragged string", meta(lambda m, a, l: m.update(ragged="2"))),
        ("version", meta(lambda m, a, l: m.update(version=99))),
        ("method other", meta(lambda m, a, l: m.update(method=_other(m["method"])))),
        ("layer method", meta(lambda m, a, l: l.update(method=_other(l["method"])))),
        ("stores not dict", meta(lambda m, a, l: m.update(stores=[]))),
        (
            "store tokens +1",
            meta(
                lambda m, a, l: m["stores"][first_store(m)].update(
                    tokens=m["stores"][first_store(m)]["tokens"] + 1
                )
            ),
        ),
        (
            "store tokens huge",
            meta(lambda m, a, l: m["stores"][first_store(m)].update(tokens=10**12)),
        ),
        ("store tokens -1", meta(lambda m, a, l: m["stores"][first_store(m)].update(tokens=-1))),
        ("store block 0", meta(lambda m, a, l: m["stores"][first_store(m)].update(block=0))),
        ("store block 3", meta(lambda m, a, l: m["stores"][first_store(m)].update(block=3))),
        ("store fields none", meta(lambda m, a, l: m["stores"][first_store(m)].update(fields=[]))),
        (
            "store field evil",
            meta(lambda m, a, l: m["stores"][first_store(m)]["fields"].append("evil")),
        ),
        (
            "store per_block",
            meta(lambda m, a, l: m["stores"][first_store(m)].update(per_block=["nosuch"])),
        ),
        (
            "store unknown",
            meta(
                lambda m, a, l: m["stores"].update(
                    {"evil.k": dict(next(iter(m["stores"].values())))}
                )
            ),
        ),
        ("store dropped", meta(lambda m, a, l: m["stores"].pop(first_store(m)))),
        ("arrays missing", meta(lambda m, a, l: m.update(arrays=m["arrays"][1:]))),
        ("arrays extra", meta(lambda m, a, l: m["arrays"].append("store.evil.x"))),
        ("arrays dup", meta(lambda m, a, l: m["arrays"].append(m["arrays"][0]))),
        ("arrays not list", meta(lambda m, a, l: m.update(arrays="x"))),
        ("meta not dict", meta(lambda m, a, l: l.update(meta=[1, 2]))),
        ("kind evil", meta(lambda m, a, l: l.update(kind="pickle"))),
        ("config bits", meta(config_bits)),
        ("config group", meta(config_group)),
        ("config wiped", meta(wipe_config)),
        ("NaN in an array", meta(scale_nan)),
        ("array cut", meta(shrink_array)),
        ("array dtype", meta(grow_dtype)),
        ("array extra", meta(extra_array)),
        ("array dropped", meta(drop_array)),
        ("policy_meta junk", meta(lambda m, a, l: m.update(policy_meta={"window": "x"}))),
        ("storage dtype", meta(lambda m, a, l: m.update(storage_dtype="uint8"))),
    ]
    return edits


def _mlx_edits() -> list[tuple[str, object]]:
    import mlx.core as mx

    def items(f):
        def edit(arrays, header, layers):
            f(layers[0], arrays)

        return edit

    def number(layer, i, v):
        nums = [j for j, it in enumerate(layer["items"]) if it["type"] == "number"]
        layer["items"][nums[min(i, len(nums) - 1)]]["value"] = v

    def nan_array(layer, arrays):
        k = next(k for k in arrays if k.startswith("layer0.") and arrays[k].dtype != mx.uint32)
        a = arrays[k]
        arrays[k] = mx.where(mx.arange(a.size).reshape(a.shape) == 0, float("nan"), a)

    def cut(layer, arrays):
        k = next(k for k in arrays if k.startswith("layer0."))
        arrays[k] = arrays[k][..., :-1, :]

    return [
        ("offset huge", items(lambda l, a: number(l, 0, 10**12))),
        ("offset negative", items(lambda l, a: number(l, 0, -1))),
        ("offset float", items(lambda l, a: number(l, 0, 2.5))),
        ("last number", items(lambda l, a: number(l, 9, 3))),
        ("class other", items(lambda l, a: l.update({"class": _other_class(l["class"])}))),
        ("class evil", items(lambda l, a: l.update({"class": "os.system"}))),
        ("nested wrong", items(lambda l, a: l.update(nested=[5]))),
        ("items cut", items(lambda l, a: l.update(items=l["items"][:-1]))),
        ("item type", items(lambda l, a: l["items"][0].update(type="pickle"))),
        ("item name", items(lambda l, a: l["items"][0].update(name="layer1.0"))),
        ("item missing", items(lambda l, a: l["items"][0].update(name="nosuch"))),
        ("NaN array", items(nan_array)),
        ("array cut", items(cut)),
    ]


def _damaged(src: Path, folder: Path) -> list[tuple[str, Path]]:
    """Bytes flipped in the header, in the data, the file cut, zeroed, or foreign."""
    raw = src.read_bytes()
    out = []
    head = int.from_bytes(raw[:8], "little") + 8
    for name, data in (
        ("flip header", raw[:20] + bytes([raw[20] ^ 1]) + raw[21:]),
        ("flip data", raw[: head + 5] + bytes([raw[head + 5] ^ 0xFF]) + raw[head + 6 :]),
        ("flip last", raw[:-1] + bytes([raw[-1] ^ 0x40])),
        ("cut half", raw[: len(raw) // 2]),
        ("cut header", raw[: head - 3]),
        ("empty", b""),
        ("zeros", b"\0" * len(raw)),
        ("size huge", (2**62).to_bytes(8, "little") + raw[8:]),
        ("size 0", (0).to_bytes(8, "little") + raw[8:]),
    ):
        p = folder / f"{src.stem}-{name.replace(' ', '_')}.safetensors"
        p.write_bytes(data)
        out.append((name, p))
    return out


def file_cases(folder: Path) -> list[tuple[str, str]]:
    kinds = _saved_kinds(folder)
    out = []
    for kind, path in kinds.items():
        edits = _mlx_edits() if kind.startswith("mlx-") else _velox_edits()
        for name, edit in edits:
            if name in NOT_CONTRADICTIONS.get(kind, ()):
                continue
            dst = folder / f"{kind}-{name.replace(' ', '_')}.safetensors"
            try:
                _resign(path, dst, edit)
            except (StopIteration, KeyError, IndexError, TypeError, ValueError):
                continue  # the alteration does not apply to this kind
            out.append((f"{kind}: {name}", str(dst)))
        for name, p in _damaged(path, folder):
            out.append((f"{kind}: {name}", str(p)))
    return out


# --- running -------------------------------------------------------------------------------


class Runner:
    """Cases run one at a time in a worker process, restarted after a hang or a death."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.pool = None

    def _start(self):
        self.pool = self.ctx.Pool(1, initializer=_init_worker)

    def run(self, kind: str, payload) -> tuple[str, str]:
        if self.pool is None:
            self._start()
        job = self.pool.apply_async(_run, (kind, payload))
        try:
            return job.get(self.timeout)
        except multiprocessing.TimeoutError:
            self.close()
            return "hang", f"past {self.timeout:.0f} s"
        except Exception as e:  # the worker died (its pool breaks) or the result failed
            self.close()
            return "died", f"{type(e).__name__}: {e}"[:160]

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


def _tiny_model_dir(folder: Path) -> tuple[str, str]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from velox_testing.models import _tokenizer, tiny_config

    path = folder / "tiny-model"
    path.mkdir()
    params = dict(tree_flatten(_model().parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), params, {"format": "mlx"})
    cfg = tiny_config("llama", tie_word_embeddings=True)
    (path / "config.json").write_text(json.dumps(cfg))
    _tokenizer().save_pretrained(str(path))
    text = folder / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    return str(path), str(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["specs", "cli", "files"])
    p.add_argument(
        "--per-param", type=int, default=2, help="bad values per method parameter (default 2)"
    )
    p.add_argument("--timeout", type=float, default=60, help="seconds a case may take")
    p.add_argument("--json", help="write every case and its outcome here")
    a = p.parse_args(argv)
    results: dict[str, list[dict]] = {}
    runner = Runner(a.timeout)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="velox-sweep-") as tmp:
        folder = Path(tmp)
        plan: list[tuple[str, str, object, str]] = []
        if "specs" in a.parts:
            plan += [("specs", "spec", s, s) for s in spec_cases(a.per_param)]
        if "cli" in a.parts:
            model, text = _tiny_model_dir(folder)
            plan += [("cli", "cli", c, " ".join(c)) for c in cli_cases(model, text)]
        if "files" in a.parts:
            plan += [("files", "file", path, name) for name, path in file_cases(folder)]
        cwd = os.getcwd()
        os.chdir(folder)  # a command that writes (a chart, a cache) writes here
        try:
            for part, kind, payload, label in plan:
                outcome, detail = runner.run(kind, payload)
                results.setdefault(part, []).append(
                    {"case": label, "outcome": outcome, "detail": detail}
                )
        finally:
            os.chdir(cwd)
            runner.close()
    total = Counter()
    for part, rows in results.items():
        counts = Counter(r["outcome"] for r in rows)
        total.update(counts)
        print(
            f"{part}: {len(rows)} cases: "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
        for r in rows:
            if r["outcome"] in BAD_OUTCOMES:
                print(f"  {r['outcome']}: {r['case']!r}: {r['detail']}")
    n = sum(total.values())
    bad = sum(total[k] for k in BAD_OUTCOMES)
    print(
        f"all: {n} cases in {time.time() - t0:.0f} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(total.items()))
        + f"; {bad} against the targets ({', '.join(BAD_OUTCOMES)}: 0 each)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
