"""A bounded concurrent load on ``velox serve`` and on mlx-lm's own server, over HTTP.

Each server runs as a subprocess on 127.0.0.1, one after another, with the same model,
prompt cache settings and load: ``velox serve --method SPEC`` per ``--velox`` spec, and
``mlx_lm.server`` with its fp16 cache (``fp16``) and with ``--kv-bits 4`` (``kv4``:
``--quantized-kv-start 0``, so that the cache is quantized from the first token, where mlx-lm
would wait for 5,000). ``--clients`` threads send ``--requests`` streamed completions between
them, each with a prompt of about ``--prompt-tokens`` tokens, distinct per request, of which a
``--shared`` fraction starts with one common prefix of ``--prefix-tokens``; every answer runs
``--max-tokens`` tokens (the end-of-sequence tokens are given a -100 logit bias, so that no
answer stops early; ``--allow-eos`` lets them stop). One short request before the load warms
each server up (kernels built on first use are not timed).

Per server:

- ``decode_tok_s``: generated tokens of all requests together over the load's wall time
  (first request sent to last answer received; prefill included, as a client sees it);
  ``request_decode_tok_s_median``: per request, tokens after its first over the time after
  its first token.
- ``ttft_s_median``, ``ttft_s_p90``: time to first token, from sending a request to the first
  streamed event holding text (the prefill and any wait for a batch slot).
- ``mlx_peak_bytes``: MLX's peak memory in the server process (weights, caches, transients;
  ``mx.get_peak_memory``), from ``GET /v1/velox`` for velox and from ``GET /v1/stats`` for
  mlx-lm's server. mlx-lm's server has no such endpoint: the benchmark starts it through
  this script (``--stock-server``), which adds that one read-only endpoint and runs
  ``mlx_lm.server.main()`` unchanged.
- ``rss_peak_bytes``: the server process's peak resident set (``VmHWM`` on Linux, else the
  largest RSS polled): all of its memory on a CPU, its host memory only on a GPU.
- ``cache_bytes_max``: the most bytes the prompt cache held at a poll (every ``--poll``
  seconds and after the load): velox's measured ``resident_bytes``, mlx-lm's own count
  (``LRUPromptCache.nbytes``, its caches' ``nbytes`` when each entry was stored); velox also
  reports its own high-water mark after every insertion (``cache_peak_bytes``).
- ``sessions_held_max``: the most sessions the prompt cache held at a poll while it was within
  ``--prompt-cache-bytes``: entries that are no prefix of another, each a sequence a later
  request resumes (mlx-lm stores a batched request's prompt and then the prompt with its
  answer: one session, two entries where the cache cannot be trimmed, ``cache_entries_max``
  counts entries); ``polls_over_budget`` counts the polls that found the cache over its
  budget (mlx-lm 0.32 applies the budget only when it adds a request to a running batch,
  never in its one-at-a-time path, which ``--kv-bits`` takes).
- ``streams_concurrent_max``: the most requests streaming tokens at once (between their first
  and last token, as the clients saw them): the batch the server decoded together, at most.
- ``cached_tokens``: prompt tokens the requests reused from the prompt cache (mlx-lm's
  ``usage.prompt_tokens_details.cached_tokens``).

``--malformed N`` sends N hostile requests among the load (by the same clients, interleaved:
bodies that are no JSON or no object, empty, wrong-typed or out-of-range fields, unknown
token ids, another model's path, unknown routes; :data:`MALFORMED`, cycled) and reports
``malformed_sent``, ``malformed_errors`` (answered with an HTTP error or an error event),
``malformed_leaks`` (answers holding a Python traceback or a path of this machine: the
repository's, the home directory, the Python installation, the model's) with the first
leaking answer, and ``server_alive`` (the process running and ``/health`` answering after
the load). A server that dies fails the row.

``--shape NAME`` serves a model of one of ``benchmarks/e2e.py``'s shapes (``llama3-8b``,
``qwen2.5-7b``, ``small``, ...) where no real model can be had: before the servers start,
the script writes an mlx-lm model directory with random weights seeded by ``--seed``, built
by ``e2e.build_model`` in ``--weights`` (``4bit`` by default, its ``quantization`` block in
config.json; ``fp32`` for a CPU), and the embedded reference model's tokenizer files. It
goes to ``--model-dir`` (a later run with the same shape, weights, seed and tokenizer reuses
it; a marker file says what it was built from) or to a temporary directory removed at exit.
Prompts are made and counted with that tokenizer; where the shape's vocabulary is smaller
than the tokenizer's (``small``: 2,048 of 8,192), they are made only of words whose tokens
are below it (every prompt is checked; the run is refused otherwise), and ``--malformed``
is refused.

Every server gets ``--prompt-cache-size`` (default 1000, so that the byte budget decides) and
``--prompt-cache-bytes`` when given. On Linux, where MLX's CPU wheel bundles a slow reference
BLAS, every server runs with the same OpenBLAS preloaded (``velox_cli.blas``).

    python3 benchmarks/serve_load.py --shape llama3-8b --weights 4bit --model-dir out/llama3-8b \\
        --velox uniform:bits=4 --clients 8 --requests 32 --prompt-tokens 32768 \\
        --max-tokens 256 --prompt-cache-bytes 8G --json out/serve_load.json
    python3 benchmarks/serve_load.py --clients 2 --requests 6 --prompt-tokens 128 \\
        --max-tokens 16 --prompt-cache-bytes 1M   # CPU smoke, the reference model
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BASELINES = ("fp16", "kv4")


# --- mlx-lm's server with one read-only endpoint ---------------------------------------------


def stock_server(argv: list[str]) -> None:
    """``mlx_lm.server.main()`` with ``argv``, answering ``GET /v1/stats`` (its prompt
    cache's size and MLX's memory) besides its own API; nothing else is changed."""
    import mlx.core as mx
    import mlx_lm.server as server

    original = server.APIHandler.do_GET

    def do_GET(self):
        if self.path.rstrip("/") != "/v1/stats":
            return original(self)
        pc = self.response_generator.prompt_cache
        for _ in range(10):  # the generation thread may change the cache while it is read
            try:
                keys = [(m, t) for lru in pc._lru._lrus.values() for m, t in lru]
                break
            except RuntimeError:
                time.sleep(0.01)
        else:
            keys = []
        by_model: dict = {}
        for m, t in keys:
            by_model.setdefault(m, []).append(t)
        body = {
            "prompt_cache": {
                "sequences": len(pc),
                "sessions": sum(sessions(k) for k in by_model.values()),
                "resident_bytes": int(pc.nbytes),
                "max_bytes": self.response_generator.cli_args.prompt_cache_bytes,
            },
            "active_memory_bytes": int(mx.get_active_memory()),
            "peak_memory_bytes": int(mx.get_peak_memory()),
        }
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    server.APIHandler.do_GET = do_GET
    sys.argv = ["mlx_lm.server", *argv]
    server.main()


def sessions(keys: list) -> int:
    """How many of ``keys`` (token lists) are no prefix of another (as ``velox serve``
    counts its ``sessions``)."""
    ordered = sorted(tuple(k) for k in keys)
    return sum(1 for a, b in itertools.pairwise(ordered) if b[: len(a)] != a) + bool(ordered)


# --- a model of a named shape ----------------------------------------------------------------

# the file a shape model's directory holds last: what it was built from (compared on reuse)
SHAPE_MARKER = "serve_load-shape.json"
# the tokenizer files a shape model takes from the reference model, where it has them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _e2e():
    """``benchmarks/e2e.py``: its shapes and ``build_model``."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import e2e

    return e2e


def shape_marker(shape: str, weights: str, seed: int, reference: Path) -> dict:
    """What a shape model is built from: the shape's config, the weights, the seed and the
    reference model's tokenizer files (their SHA-256)."""
    e2e = _e2e()
    if shape not in e2e.SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(e2e.SHAPES)}, got {shape!r}")
    if weights not in e2e.WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(e2e.WEIGHTS)}, got {weights!r}")
    files = [reference / f for f in TOKENIZER_FILES if (reference / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model") for f in files):
        raise ValueError(f"{reference} holds no tokenizer.json or tokenizer.model")
    tokenizer = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    return {
        "shape": shape,
        "weights": weights,
        "seed": seed,
        "config": e2e.SHAPES[shape],
        "tokenizer": tokenizer,
    }


def build_shape_model(shape: str, weights: str, seed: int, out: Path, reference: Path) -> bool:
    """Write an mlx-lm model directory of ``shape`` to ``out``: random weights seeded with
    ``seed``, built by ``e2e.build_model`` (``4bit``: its layers quantized, config.json's
    ``quantization`` block saying how, so that ``mlx_lm.load`` loads them quantized), saved
    with mlx-lm's ``save_model`` and ``save_config``, and the ``reference`` model's tokenizer
    files. A directory that a build of the same shape, weights, seed and tokenizer wrote is
    reused (False); another non-empty one is refused. The build goes to a directory beside
    ``out``, renamed to ``out`` when complete. Returns whether it built."""
    marker = shape_marker(shape, weights, seed, reference)
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--model-dir {out} is a file, not a directory")
        held = out / SHAPE_MARKER
        if held.is_file() and json.loads(held.read_text()) == marker:
            return False
        if any(out.iterdir()):
            what = (
                f"a shape model of {json.loads(held.read_text()).get('shape')!r} built "
                "otherwise (shape, weights, seed or tokenizer)"
                if held.is_file()
                else "files of another kind"
            )
            raise ValueError(
                f"--model-dir {out} holds {what}: name a new or empty directory, or one "
                "built with the same --shape, --weights and --seed"
            )
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model

    config = dict(marker["config"])
    ref_config = json.loads((reference / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        if key in ref_config:
            config[key] = ref_config[key]
    out.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    part.chmod(0o777 & ~umask)  # mkdtemp's is the owner's alone
    try:
        model = _e2e().build_model(shape, weights, seed)
        quantized = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
        if quantized:
            q = quantized[0]
            config["quantization"] = {"group_size": q.group_size, "bits": q.bits, "mode": q.mode}
        save_model(part, model, donate_model=True)
        del model, quantized
        save_config(config, part / "config.json")
        for name in marker["tokenizer"]:
            shutil.copyfile(reference / name, part / name)
        (part / SHAPE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        part.rename(out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    finally:
        gc.collect()
        mx.clear_cache()
    return True


# --- servers ---------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blas_env() -> tuple[dict[str, str], str]:
    """The environment every server runs in (OpenBLAS preloaded where MLX's CPU wheel would
    use its reference BLAS) and a line naming the BLAS."""
    env = dict(os.environ)
    if sys.platform != "linux" or "blas" in env.get("LD_PRELOAD", "").lower():
        return env, "MLX's own"
    from velox_cli.blas import ACTIVE, find_blas, mlx_reference_blas

    if mlx_reference_blas() is None:
        return env, "MLX's own"
    lib, what, _ = find_blas()
    if lib is None:
        return env, "MLX's bundled reference BLAS"
    pre = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else str(lib)
    env[ACTIVE] = str(lib)  # velox serve does not re-execute itself
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env, what


def _get(port: int, path: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def _post(port: int, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """One server subprocess, its log in ``log``; ``stats`` is the endpoint read for the
    prompt cache and MLX's memory."""

    def __init__(self, name: str, cmd: list[str], stats: str, env: dict, log: Path):
        self.name, self.cmd, self.stats, self.log = name, cmd, stats, log
        self.port = int(cmd[cmd.index("--port") + 1])
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                _get(self.port, "/health", timeout=5)
                return
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"{self.name}: /health answered {e.code}") from None
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.tail()}") from None
                if time.time() > deadline:
                    raise RuntimeError(f"{self.name} did not listen in {timeout:.0f} s") from None
                time.sleep(0.3)

    def tail(self, n: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def rss(self) -> tuple[int | None, int | None]:
        """(resident bytes now, peak resident bytes) of the process, where readable."""
        status = Path(f"/proc/{self.proc.pid}/status")
        if status.exists():
            fields = {}
            for line in status.read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
            return fields.get("VmRSS"), fields.get("VmHWM")
        try:
            import psutil

            return psutil.Process(self.proc.pid).memory_info().rss, None
        except Exception:
            return None, None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def server_commands(a: argparse.Namespace, model: str) -> list[tuple[str, list[str], str]]:
    """``(name, command, stats path)`` per server, velox specs first."""
    common = ["--model", model, "--prompt-cache-size", str(a.prompt_cache_size)]
    common += ["--log-level", "WARNING", "--max-tokens", str(a.max_tokens)]
    if a.prompt_cache_bytes is not None:
        common += ["--prompt-cache-bytes", a.prompt_cache_bytes]
    out = []
    for spec in a.velox:
        cmd = [sys.executable, "-m", "velox_cli", "serve", "--method", spec, *common]
        out.append((f"velox {spec}", cmd, "/v1/velox"))
    for base in a.baselines:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stock-server", *common]
        if base == "kv4":
            cmd += ["--kv-bits", "4", "--quantized-kv-start", str(a.kv_start)]
        out.append((f"mlx_lm {base}", cmd, "/v1/stats"))
    return out


# --- the load --------------------------------------------------------------------------------


def _below(tokenizer, text: str, vocab: int | None) -> bool:
    """Whether every token of ``text`` is below ``vocab`` (always, where ``vocab`` is None)."""
    return vocab is None or max(tokenizer.encode(text), default=-1) < vocab


def prompt_words(tokenizer, vocab: int | None = None) -> list[str]:
    """The plain words prompts are made of: ASCII words of 3-10 letters that one token (ids
    256 to 20,000) decodes to, lower-cased; with ``vocab`` (a model's vocabulary, smaller
    than the tokenizer's for a shape model), only those whose tokens are below it, alone and
    after a space."""
    top = min(tokenizer.vocab_size, 20000, vocab or tokenizer.vocab_size)
    words = []
    for tid in range(256, top):
        w = tokenizer.decode([tid]).strip()
        if w.isascii() and w.isalpha() and 3 <= len(w) <= 10:
            words.append(w.lower())
    words = [
        w
        for w in sorted(set(words))
        if _below(tokenizer, w, vocab) and _below(tokenizer, " " + w, vocab)
    ]
    if len(words) < 50:
        below = "" if vocab is None else f" below token {vocab}"
        raise ValueError(
            f"the tokenizer has {len(words)} plain words{below}, too few to build prompts "
            "from (50 at least)"
        )
    return words


def label(tokenizer, text: str, words: list[str], i: int, vocab: int | None) -> str:
    """``text`` where its tokens are below ``vocab``, else two of ``words`` that tell ``i``
    apart (for ``i`` below ``len(words) ** 2``), then a colon."""
    if _below(tokenizer, text, vocab):
        return text
    n = len(words)
    return f"{words[i % n]} {words[i // n % n]}:"


def make_prompts(
    tokenizer, a: argparse.Namespace, vocab: int | None = None
) -> tuple[list[str], list[bool]]:
    """``a.requests`` prompts of about ``a.prompt_tokens`` tokens, each distinct from its first
    words on, but a ``a.shared`` fraction that start with one common prefix; and which share.
    With ``vocab``, every token of every prompt is below it (a ValueError otherwise): the
    words are :func:`prompt_words`' below it, and a request's head (``Request i of n:``) whose
    tokens are not is two of those words instead."""
    rng = random.Random(a.seed)
    words = prompt_words(tokenizer, vocab)

    def text(n_tokens: int, head: str = "") -> str:
        parts, out = [head] if head else [], head
        while len(tokenizer.encode(out)) < n_tokens:
            parts.extend(rng.choice(words) for _ in range(max(8, n_tokens // 4)))
            out = " ".join(parts)
        ids = tokenizer.encode(out)[:n_tokens]
        return tokenizer.decode(ids)

    prefix_tokens = min(a.prefix_tokens or a.prompt_tokens // 2, a.prompt_tokens - 8)
    head = label(tokenizer, "Shared context:", words, a.requests, vocab)
    prefix = text(prefix_tokens, head) if prefix_tokens > 0 else ""
    n_shared = round(a.shared * a.requests) if prefix else 0
    shared = [False] * a.requests
    for i in rng.sample(range(a.requests), n_shared):
        shared[i] = True
    prompts = []
    for i in range(a.requests):
        head = label(tokenizer, f"Request {i} of {a.requests}:", words, i, vocab)
        if shared[i]:
            prompts.append(prefix + "\n" + text(a.prompt_tokens - prefix_tokens - 1, head))
        else:
            prompts.append(text(a.prompt_tokens, head))
    for i, p in enumerate(prompts):
        if not _below(tokenizer, p, vocab):
            raise ValueError(
                f"prompt {i} holds token {max(tokenizer.encode(p))}, not below the model's "
                f"vocab_size {vocab}"
            )
    return prompts, shared


def warmup_prompt(tokenizer, vocab: int | None = None) -> str:
    """The warm-up request's prompt: ``Warm up.``, or two plain words and a full stop where
    its tokens are not below ``vocab``."""
    if _below(tokenizer, "Warm up.", vocab):
        return "Warm up."
    return " ".join(prompt_words(tokenizer, vocab)[:2]) + "."


def stream_request(port: int, body: dict, timeout: float) -> dict:
    """One streamed completion: its times and mlx-lm's usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    usage, error = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue  # blank lines, keep-alive comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = str(event["error"])
                break
            if event.get("usage"):
                usage = event["usage"]
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    if error is None and usage is None:
        error = "the stream ended without usage"
    return {"start": t0, "first": first, "end": end, "usage": usage, "error": error}


# (method, path, body) of the hostile requests ``--malformed`` sends: a body that is str is
# sent as it is (no JSON), any other is JSON-encoded
MALFORMED: tuple[tuple[str, str, object], ...] = (
    ("POST", "/v1/completions", "{not json"),
    ("POST", "/v1/completions", ""),
    ("POST", "/v1/completions", []),
    ("POST", "/v1/completions", {"prompt": ""}),
    ("POST", "/v1/completions", {"prompt": []}),
    ("POST", "/v1/completions", {"prompt": 12345}),
    ("POST", "/v1/completions", {"prompt": [[1, 2], [3]]}),
    ("POST", "/v1/completions", {"prompt": [99999999, -4]}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -5}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("POST", "/v1/completions", '{"prompt": "x", "temperature": NaN, "max_tokens": 2}'),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 7, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 5}}),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "/etc/passwd", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "../../secret", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": "hello"}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": 5, "content": ["x"]}]}),
    ("POST", "/v1/evil", {"prompt": "x"}),
    ("GET", "/v1/velox/../../etc/passwd", None),
)


def raw_request(port: int, method: str, path: str, body, timeout: float) -> tuple[int, str]:
    """``(status, body text)`` of one request sent as given (0 and the error's text where
    the connection failed)."""
    import http.client

    data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request(method, path, body=None if data is None else data.encode(), headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    except OSError as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def leaks(text: str, paths: list[str]) -> bool:
    """Whether an answer holds a Python traceback or one of this machine's ``paths``."""
    if "Traceback (most recent call last)" in text or re.search(r'File "[^"]+", line \d+', text):
        return True
    return any(p and p in text for p in paths)


def machine_paths(model: str) -> list[str]:
    """The paths of this machine an answer must not show: the repository, the home directory,
    the Python installation and the model's directory."""
    repo = str(Path(__file__).resolve().parents[1])
    out = {repo, str(Path.home()), sys.prefix, sys.base_prefix, str(Path(model).resolve())}
    return sorted(p for p in out if len(p) > 1)


class Poller(threading.Thread):
    """Reads the server's stats endpoint and its process's memory every ``every`` seconds."""

    def __init__(self, server: Server, every: float):
        super().__init__(daemon=True)
        self.server, self.every = server, every
        self.halt = threading.Event()
        self.readings: list[dict] = []
        self.rss_max = 0
        self.last: dict = {}

    def poll(self) -> None:
        try:
            info = _get(self.server.port, self.server.stats, timeout=10)
        except OSError:
            return
        self.last = info
        self.readings.append(info["prompt_cache"])
        rss, _ = self.server.rss()
        self.rss_max = max(self.rss_max, rss or 0)

    def run(self) -> None:
        while not self.halt.wait(self.every):
            self.poll()


def run_load(server: Server, prompts: list[str], a: argparse.Namespace, bias: dict) -> dict:
    from itertools import count

    budget = a.budget_bytes
    body = {"max_tokens": a.max_tokens, "temperature": 0}
    if bias:
        body["logit_bias"] = bias
    _post(server.port, "/v1/completions", {**body, "prompt": a.warmup, "max_tokens": 4}, 600)

    results: list[dict | None] = [None] * len(prompts)
    # the well-formed requests and the hostile ones, interleaved evenly
    hostile = [MALFORMED[j % len(MALFORMED)] for j in range(a.malformed)]
    jobs: list[tuple[str, int]] = [("ok", i) for i in range(len(prompts))]
    for j in range(len(hostile)):
        jobs.insert(round((j + 0.5) * len(jobs) / len(hostile)) if jobs else 0, ("bad", j))
    answers: list[tuple[int, str] | None] = [None] * len(hostile)
    next_index = count()
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                n = next(next_index)
            if n >= len(jobs):
                return
            kind, i = jobs[n]
            if kind == "bad":
                method, path, payload = hostile[i]
                answers[i] = raw_request(server.port, method, path, payload, min(a.timeout, 120))
                continue
            try:
                results[i] = stream_request(server.port, {**body, "prompt": prompts[i]}, a.timeout)
            except Exception as e:  # a refused or broken request is counted, not fatal
                said = ""
                if isinstance(e, urllib.error.HTTPError):  # the server's reason, where it gave one
                    with contextlib.suppress(OSError):
                        said = " " + e.read()[:300].decode("utf-8", "replace")
                results[i] = {"error": f"{type(e).__name__}: {e}{said}"}

    poller = Poller(server, a.poll)
    poller.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    poller.halt.set()
    poller.join()
    poller.poll()  # after the load
    _, rss_peak = server.rss()

    done = [r for r in results if r and r.get("error") is None]
    errors = [r["error"] for r in results if r and r.get("error") is not None]
    generated = sum(r["usage"]["completion_tokens"] for r in done)
    ttft = sorted(r["first"] - r["start"] for r in done if r["first"] is not None)
    rates = [
        (r["usage"]["completion_tokens"] - 1) / (r["end"] - r["first"])
        for r in done
        if r["first"] is not None and r["usage"]["completion_tokens"] > 1 and r["end"] > r["first"]
    ]
    readings = poller.readings
    streaming = sorted(
        [(r["first"], 1) for r in done if r["first"] is not None]
        + [(r["end"], -1) for r in done if r["first"] is not None]
    )
    running = peak_streams = 0
    for _, step in streaming:
        running += step
        peak_streams = max(peak_streams, running)
    within = [pc for pc in readings if budget is None or pc["resident_bytes"] <= budget]
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done]
    last = poller.last
    paths = machine_paths(a.model_path)
    leaked = [(hostile[i], ans) for i, ans in enumerate(answers) if ans and leaks(ans[1], paths)]
    alive, why = server.proc.poll() is None, "the process exited"
    if alive:
        try:
            _get(server.port, "/health", timeout=30)
        except OSError as e:
            alive, why = False, f"/health: {e}"
    malformed = {
        "malformed_sent": len(hostile),
        "malformed_errors": sum(
            1 for ans in answers if ans and (ans[0] >= 400 or '"error"' in ans[1])
        ),
        "malformed_leaks": len(leaked),
        "first_leak": None if not leaked else f"{leaked[0][0][:2]}: {leaked[0][1][:300]}",
        "malformed_answers": [
            {"request": repr(hostile[i])[:160], "status": ans[0], "body": ans[1][:200]}
            for i, ans in enumerate(answers)
            if ans is not None
        ],
        "server_alive": alive,
    }
    if not alive:
        # mlx-lm's server answers every request with its generation thread's exception once
        # that thread has failed: the first request error names it, the log's tail may not
        first = f"; first request error: {errors[0][:400]}" if errors else ""
        raise RuntimeError(
            f"{server.name} died under the load ({why}; after the hostile requests "
            f"{[a['request'] for a in malformed['malformed_answers']][:3]}...{first}): "
            f"{server.tail(600)}"
        )
    return {
        **malformed,
        "server": server.name,
        "command": " ".join(server.cmd[1:]),
        "requests": len(prompts),
        "completed": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "generated_tokens": generated,
        "decode_tok_s": generated / wall if wall > 0 else None,
        "request_decode_tok_s_median": statistics.median(rates) if rates else None,
        "ttft_s_median": statistics.median(ttft) if ttft else None,
        "ttft_s_p90": _quantile(ttft, 0.9),
        "prompt_tokens_mean": (
            statistics.mean(r["usage"]["prompt_tokens"] for r in done) if done else None
        ),
        "cached_tokens": sum(cached),
        "mlx_peak_bytes": last.get("peak_memory_bytes"),
        "rss_peak_bytes": rss_peak if rss_peak is not None else poller.rss_max or None,
        "cache_bytes_max": max((pc["resident_bytes"] for pc in readings), default=None),
        "cache_peak_bytes": (last.get("prompt_cache") or {}).get("peak_resident_bytes"),
        "cache_budget_bytes": budget,
        "polls": len(readings),
        "polls_over_budget": len(readings) - len(within),
        "sessions_held_max": max((pc["sessions"] for pc in within), default=0),
        "cache_entries_max": max((pc["sequences"] for pc in readings), default=None),
        "streams_concurrent_max": peak_streams,
        "evicted": (last.get("prompt_cache") or {}).get("evicted"),
    }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


# --- output ----------------------------------------------------------------------------------


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    head = [
        "server",
        "done",
        "tok/s",
        "req tok/s",
        "TTFT med s",
        "TTFT p90 s",
        "MLX peak MB",
        "RSS peak MB",
        "cache max MB",
        "sessions",
        "over",
        "streams",
        "cached tok",
        "hostile",
    ]
    lines = []
    for r in rows:
        if "completed" not in r:
            lines.append([r["server"], "failed: " + r["error"][:60]] + [""] * (len(head) - 2))
            continue
        lines.append(
            [
                r["server"],
                f"{r['completed']}/{r['requests']}",
                _num(r["decode_tok_s"], ".1f"),
                _num(r["request_decode_tok_s_median"], ".1f"),
                _num(r["ttft_s_median"], ".3f"),
                _num(r["ttft_s_p90"], ".3f"),
                _mb(r["mlx_peak_bytes"]),
                _mb(r["rss_peak_bytes"]),
                _mb(r["cache_bytes_max"]),
                str(r["sessions_held_max"]),
                f"{r['polls_over_budget']}/{r['polls']}",
                str(r["streams_concurrent_max"]),
                str(r["cached_tokens"]),
                (
                    f"{r['malformed_errors']}/{r['malformed_sent']} refused, "
                    f"{r['malformed_leaks']} leaks"
                    if r.get("malformed_sent")
                    else "-"
                ),
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


# --- main ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    e2e = _e2e()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model", help="model directory, GGUF or name (default: the reference model)"
    )
    which.add_argument(
        "--shape",
        choices=sorted(e2e.SHAPES),
        help="serve a model of this shape (benchmarks/e2e.py's) with random weights and the "
        "reference model's tokenizer, written before the servers start",
    )
    p.add_argument(
        "--weights",
        choices=e2e.WEIGHTS,
        help="--shape's weights (default 4bit; fp32 for a CPU)",
    )
    p.add_argument(
        "--model-dir",
        help="where --shape's model is written, and reused by a later run of the same "
        "--shape, --weights and --seed (default: a temporary directory, removed at exit)",
    )
    p.add_argument(
        "--velox",
        action="append",
        help="a velox serve --method spec (repeat for several; default uniform:bits=4)",
    )
    p.add_argument(
        "--baselines",
        default="fp16,kv4",
        help="mlx_lm.server rows, comma separated: fp16, kv4 (--kv-bits 4); '' for none",
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=16, help="requests in all")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--shared", type=float, default=0.5, help="fraction sharing a prefix")
    p.add_argument("--prefix-tokens", type=int, help="shared prefix (default: half a prompt)")
    p.add_argument("--prompt-cache-bytes", help="the prompt cache's budget, as mlx-lm reads it")
    p.add_argument("--prompt-cache-size", type=int, default=1000)
    p.add_argument("--kv-start", type=int, default=0, help="kv4's --quantized-kv-start")
    p.add_argument("--allow-eos", action="store_true", help="let answers stop before the end")
    p.add_argument(
        "--malformed",
        type=int,
        default=0,
        help="hostile requests sent among the load (default 0; see MALFORMED)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.25, help="seconds between stats readings")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to listen")
    p.add_argument("--json", help="write the rows and settings to this file")
    p.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary dir)")
    return p


def _model(value: str | None) -> str:
    if value is None:
        from velox_cli.data import find_shared

        ref = find_shared("reference-model")
        if ref is None:
            raise SystemExit(
                "serve_load: no shared/reference-model (the model without --model, and the "
                "tokenizer of --shape's)"
            )
        return str(Path(ref).resolve())
    from velox_cli import models

    return str(Path(models.resolve(value)).resolve())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stock-server"]:
        stock_server(argv[1:])
        return 0
    a = _parser().parse_args(argv)
    a.velox = a.velox or ["uniform:bits=4"]
    a.baselines = [b for b in a.baselines.split(",") if b]
    bad = [b for b in a.baselines if b not in BASELINES]
    if bad:
        raise SystemExit(f"serve_load: --baselines takes {', '.join(BASELINES)}, not {bad}")
    if a.clients < 1 or a.requests < 1 or a.prompt_tokens < 16 or a.max_tokens < 1:
        raise SystemExit("serve_load: --clients, --requests, --max-tokens >= 1, prompts >= 16")
    if not 0 <= a.shared <= 1:
        raise SystemExit("serve_load: --shared is a fraction, 0 to 1")
    from mlx_lm.utils import _parse_size

    try:
        a.budget_bytes = None if a.prompt_cache_bytes is None else _parse_size(a.prompt_cache_bytes)
    except Exception:
        raise SystemExit(f"serve_load: --prompt-cache-bytes {a.prompt_cache_bytes!r}") from None

    if a.malformed < 0:
        raise SystemExit("serve_load: --malformed counts requests: 0 or more")
    if a.shape is None and (a.weights is not None or a.model_dir is not None):
        raise SystemExit("serve_load: --weights and --model-dir go with --shape")
    with contextlib.ExitStack() as stack:
        return _serve(a, stack)


def _serve(a: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """``main`` from the model on: ``stack`` holds what is removed at the end (a temporary
    shape model)."""
    from mlx_lm.utils import load_tokenizer

    vocab, shape_model = None, None
    if a.shape is None:
        model = _model(a.model)
        tokenizer = load_tokenizer(Path(model))
    else:
        a.weights = a.weights or "4bit"
        reference = Path(_model(None))
        tokenizer = load_tokenizer(reference)
        vocab = _e2e().SHAPES[a.shape]["vocab_size"]
        if a.malformed and tokenizer.vocab_size > vocab:
            raise SystemExit(
                f"serve_load: --malformed with --shape {a.shape}: the hostile requests' text "
                f"may encode to the reference tokenizer's tokens up to "
                f"{tokenizer.vocab_size - 1}, past the shape's vocab_size {vocab}"
            )
    try:
        prompts, shared = make_prompts(tokenizer, a, vocab)
        a.warmup = warmup_prompt(tokenizer, vocab)
    except ValueError as e:
        of = "" if a.shape is None else f" (--shape {a.shape}, the reference model's tokenizer)"
        raise SystemExit(f"serve_load: {e}{of}") from None
    if a.shape is not None:
        if a.model_dir is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_load-shape-"))
            where = Path(tmp) / "model"
        else:
            where = Path(a.model_dir).expanduser()
        print(f"serve_load: shape model {a.shape} ({a.weights}) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            built = build_shape_model(a.shape, a.weights, a.seed, where, reference)
        except ValueError as e:
            raise SystemExit(f"serve_load: {e}") from None
        shape_model = {"built": built, "build_s": time.perf_counter() - t0}
        model = str(where.resolve())
        done = f"built in {shape_model['build_s']:.1f} s" if built else "reused"
        print(f"serve_load: shape model {done}: {model}", file=sys.stderr, flush=True)
    a.model_path = model
    # an end-of-sequence token past the model's vocabulary is never drawn (and no bias can
    # name it)
    eos = [t for t in tokenizer.eos_token_ids if vocab is None or t < vocab]
    bias = {} if a.allow_eos else {str(t): -100 for t in eos}
    env, blas = _blas_env()

    import mlx.core as mx

    settings = {
        k: v
        for k, v in vars(a).items()
        if k not in ("json", "log_dir", "budget_bytes", "model_path")
    }
    out = {
        "settings": {**settings, "model": model, "shared_requests": sum(shared)},
        **({} if shape_model is None else {"shape_model": shape_model}),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "blas": blas,
        },
        "rows": [],
    }
    ctx = (
        contextlib.nullcontext(a.log_dir)
        if a.log_dir
        else tempfile.TemporaryDirectory(prefix="serve_load-")
    )
    with ctx as logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        for name, cmd, stats in server_commands(a, model):
            port = _free_port()
            cmd = [*cmd, "--port", str(port)]
            log = Path(logs) / (name.replace(" ", "_").replace(":", "-") + ".log")
            print(f"serve_load: {name} ...", file=sys.stderr, flush=True)
            server = Server(name, cmd, stats, env, log)
            try:
                server.wait_ready(a.start_timeout)
                row = run_load(server, prompts, a, bias)
            except Exception as e:
                row = {"server": name, "error": f"{type(e).__name__}: {e}"}
            finally:
                server.stop()
            out["rows"].append(row)
    print(table(out["rows"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all("completed" in r for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
