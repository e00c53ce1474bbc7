"""``velox serve``: mlx-lm's OpenAI-compatible server with velox caches.

    velox serve --model PATH --method SPEC [--storage-dtype float16] [mlx_lm.server options]

Runs ``mlx_lm.server`` (its API, its continuous batching and its prompt cache) in this
process with every model it loads given velox caches (``velox_core.install``: the model's
``make_cache`` returns them, attention is routed to them). Requests of different lengths
batch together (``velox_core.VeloxBatch``). One endpoint is added:

    GET /v1/velox   {"method": SPEC,
                     "prompt_cache": {"sequences": n, "sessions": s, "resident_bytes": b,
                                      "max_bytes": B, "max_sequences": n,
                                      "peak_resident_bytes": p, "evicted": e,
                                      "by_type": {...}},
                     "active_memory_bytes": .., "peak_memory_bytes": ..}

and ``GET /v1/models`` lists the served model with that object as its ``velox`` field (and
the Hugging Face cache's models, as mlx-lm does, where there is such a cache);
``resident_bytes`` is what the prompt cache's velox caches hold now (measured from their
arrays, ``nbytes``: every buffer, capacity included, and every fitted codec array). mlx-lm's
``--kv-bits`` (its own quantized cache) is refused: the method spec says how the cache is
compressed.

``--prompt-cache-bytes`` (a size as mlx-lm reads it: bytes, or a number with ``M``, ``MB``,
``G`` or ``GB``, powers of 10) is a budget for the prompt cache, kept in every path, batched
or one request at a time: each time an entry is stored, the least recently used entries are
evicted until the entries' bytes are within it (each entry's velox caches' ``nbytes``,
counted when it is stored: a stored entry never changes, a request gets a copy of it). An
entry larger than the whole budget is not stored (mlx-lm's eviction would first give up every
other entry). mlx-lm 0.32 parses the option but never gives it to its prompt cache
(``mlx_lm.server.run`` makes ``LRUPromptCache(max_size)``, with no byte limit); it only trims
the cache when it adds a request to a running batch (to the budget less the bytes of the
batch's caches, ``BatchGenerator.prompt_cache_nbytes``). Its cache therefore outgrows the
budget as requests finish, and in the one-at-a-time path (``--kv-bits``, a seed, a method
that cannot batch) only ``--prompt-cache-size``'s count of entries bounds it. That trim still
runs here too. An entry a request reuses becomes the most recently used one (mlx-lm moves an
entry only when it is stored again). mlx-lm's order of cache types stays: ``assistant``
entries go before ``user`` ones, and those before ``system`` prompts, while there are at
least as many of them; within a type the least recently used goes first. A size that is not
one (``10K``, ``-1``) stops ``velox serve`` before it listens, with the reason.

In ``prompt_cache``: ``max_bytes`` is the budget (null without one), ``max_sequences``
mlx-lm's ``--prompt-cache-size``, ``peak_resident_bytes`` the most the cache held after any
insertion or trim, ``evicted`` the entries given up for either limit (one larger than the
budget included), and ``sessions`` the entries that are no prefix of another entry. mlx-lm
stores a batched request's prompt when its prefill ends and the prompt with its answer when
it finishes: where the caches keep a trimmed prefix the second entry replaces the first;
where they cannot (an eviction policy, per-head budgets, a codec fitted on the stored
tokens) both stay, two entries of one session.

A new prompt that shares a prefix with a longer stored entry reuses that prefix: the entry is
copied and trimmed to it, as mlx-lm does for its fp16 cache. mlx-lm trims only caches whose
``is_trimmable()`` is True (a trim that leaves exactly the cache that never saw the trimmed
tokens), which most velox caches answer False: their window holds the newest tokens as given
and flushes them in blocks, so a trim leaves the kept tokens coded where a fresh cache would
hold up to ``window + flush`` of them as given. ``velox serve`` trims every cache whose
``reuses_prefix()`` is True (``velox_cli.serve_cache.trims_to_prefix``): the kept tokens are
what the entry held, codes' rounding included, as with mlx-lm's ``--kv-bits`` cache.

``--model`` (and ``--draft-model``) take what ``velox bench`` and ``velox generate`` take: an
mlx-lm directory, a ``.gguf`` file or a model name (``smollm2``, ``gemma3``; see
``velox_cli.models``), and also a Hugging Face repo id, which mlx-lm looks up itself. The
model is loaded, and given its velox caches, before the server listens: a model that fails to
load or refuses the ``--method`` spec (a ``group`` its head dim does not take, say) stops
``velox serve`` with the reason instead of a server that answers every request with an error.
Whether requests batch is decided then too, by running mlx-lm's batch generator on two short
prompts: a method whose caches cannot be batched (xKV's and MiniCache's linked layers,
Q-Filters' copies) is served one request at a time, with a warning. An error raised while a
request is generated answers that request (500, or a last stream event) and the server serves
on, where mlx-lm's generation thread would die.

A request whose prompt is empty is answered 400; one whose prompt has no tokens is
refused without stopping the generation thread (mlx-lm's batch generator raises on it). So
are, before they reach the generation thread, fields mlx-lm reads without checking them: a
``stop`` that is no string or list of strings, a NaN or infinite sampling number, a
``logit_bias`` token outside the vocabulary (which crashes the process inside MLX), chat
messages without a role. Where ``--model`` is given, a request naming another model (or
draft model) is answered 404: mlx-lm would unload the served model to load the one a client
names (any path of the server's machine), and a load that fails while a batch runs can crash
the process. ``GET /v1/models`` names the served model as ``--model`` gave it.

The prompt cache within its budget is :mod:`velox_cli.serve_cache`; the answers to errors
raised while requests are generated, :mod:`velox_cli.serve_errors`; the checks of a request's
fields, :mod:`velox_cli.serve_requests`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any

from .serve_cache import _budgeted_prompt_cache
from .serve_errors import _error_responses, _first_line, _survive_request_errors, _track_requests
from .serve_requests import _request_error, _served_name

__all__ = ["serve"]

# owner/name, as Hugging Face spells repo ids: left to mlx-lm's own lookup when no such path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_ORIGINALS: dict[tuple[Any, str], Any] = {}  # mlx-lm's methods, before serve() wraps them


def _patch(owner: Any, name: str, make: Any) -> None:
    """Set ``owner.name`` to ``make(original)``, wrapping mlx-lm's own function however often
    serve() runs in one process."""
    key = (owner, name)
    original = _ORIGINALS.setdefault(key, getattr(owner, name))
    setattr(owner, name, make(original))


def _local_model(value: str) -> str:
    """The mlx-lm directory for ``--model value`` (``velox_cli.models.resolve``: a name, a
    ``.gguf`` file or a directory, made absolute), or ``value`` itself where it is no path
    here but reads as a Hugging Face repo id. Raises resolve's error otherwise."""
    from . import models

    try:
        return str(Path(models.resolve(value)).resolve())
    except FileNotFoundError:
        if _HUB_ID.fullmatch(value) and not Path(value).expanduser().exists():
            return value  # mlx-lm fetches it, or fails to; either way before listening
        raise


def _resolve_models(argv: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """``argv`` with its ``--model`` and ``--draft-model`` values resolved (see
    :func:`_local_model`), and the aliases by flag: each value given -> the path it resolved
    to (so a request naming the model as it was given gets the same, loaded, model)."""
    out: list[str] = list(argv)
    aliases: dict[str, dict[str, str]] = {"--model": {}, "--draft-model": {}}
    for i, arg in enumerate(out):
        for flag in ("--model", "--draft-model"):
            if arg == flag and i + 1 < len(out):
                at, value, fmt = i + 1, out[i + 1], "{}"
            elif arg.startswith(flag + "="):
                at, value, fmt = i, arg[len(flag) + 1 :], flag + "={}"
            else:
                continue
            path = _local_model(value)
            out[at] = fmt.format(path)
            if path != value:
                aliases[flag][value] = path
    return out, aliases


def _provider_class(
    spec: str, storage_dtype: Any, aliases: dict[str, dict[str, str]] | None = None
):
    import mlx_lm.server as server

    import velox_core

    class VeloxModelProvider(server.ModelProvider):
        """mlx-lm's model provider; each model it loads (and its draft) gets velox caches.

        The default model's load (mlx-lm runs it on its generation thread) is reported through
        ``loaded`` and ``load_error``, so the server listens only once it has succeeded."""

        def __init__(self, cli_args):
            super().__init__(cli_args)
            self.loaded = threading.Event()
            self.load_error: BaseException | None = None
            aliases_ = aliases or {}
            for name, path in aliases_.get("--model", {}).items():  # a request may name it
                self._model_map.setdefault(name, path)  # as it was given: the same model
                self._adapter_map.setdefault(name, cli_args.adapter_path)
            for name, path in aliases_.get("--draft-model", {}).items():
                self._draft_model_map.setdefault(name, path)

        def load_default(self):
            try:
                super().load_default()
            except Exception as e:
                self.load_error = e
                if self.is_distributed:  # no listener waits on the other ranks
                    raise
            finally:
                self.loaded.set()

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            try:
                super()._load(model_path, adapter_path, draft_model_path)
            except Exception as e:
                raise ValueError(f"cannot load the model {model_path!r}: {_first_line(e)}") from e
            try:
                velox_core.install(self.model, spec, storage_dtype=storage_dtype)
                if self.draft_model is not None:
                    velox_core.install(self.draft_model, spec, storage_dtype=storage_dtype)
            except Exception as e:
                self.reset()  # never keep it loaded with mlx-lm's own caches
                raise ValueError(
                    f"the model {model_path!r} refuses --method {spec}: {_first_line(e)}"
                ) from e
            caches = self.model.make_cache()
            self.is_batchable = self.draft_model is None and all(
                hasattr(c, "merge") for c in caches
            )
            if self.is_batchable:  # decided now, not by a generation thread that dies
                why = _cannot_batch(self.model)
                if why is not None:
                    self.is_batchable = False
                    logging.warning(
                        "velox serve: --method %s cannot batch sequences (%s); requests are "
                        "served one at a time",
                        spec,
                        why,
                    )

        def reset(self) -> None:
            for m in (self.model, getattr(self, "draft_model", None)):
                if m is not None:
                    velox_core.uninstall(m)
            super().reset()

    return VeloxModelProvider


def _cannot_batch(model) -> str | None:
    """Why mlx-lm's batch generator cannot run ``model`` with its (velox) caches, or None.

    Two prompts of different lengths are generated together, two tokens each, as the server
    batches requests (``merge``, a padded prefill, decode): a method whose caches refuse to
    be batched (layers sharing state, as xKV's and MiniCache's) or lose something when copied
    fails here, while the model loads, instead of on the first request."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=2,
        completion_batch_size=2,
        prefill_batch_size=2,
        stream=mx.default_stream(mx.default_device()),
    )
    try:
        gen.insert([[1, 2, 3], [1, 2]], max_tokens=[2, 2])
        finished = 0
        for _ in range(16):
            _, responses = gen.next()
            finished += sum(r.finish_reason is not None for r in responses)
            if finished >= 2:
                return None
        return "the batch generator did not finish two 2-token requests"
    except Exception as e:
        return _first_line(e)
    finally:
        gen.close()


def _checked_size(original):
    """mlx-lm's ``_parse_size`` (for ``--prompt-cache-bytes``) answering a value that is no
    size with the reason (argparse prints it and exits with status 2), where mlx-lm's raises
    ``decimal.InvalidOperation`` or ``KeyError`` and argparse lets the traceback through."""

    def size(value: str) -> int:
        try:
            return int(original(value))
        except Exception:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a size: give bytes (1000000) or a number with M, MB, G or GB "
                "(powers of 10: 1.5G is 1500000000 bytes)"
            ) from None

    return size


class _LoadFailed(ValueError):
    """The served model did not load (or refused the spec); the server never listened."""


def _listen_after_load(original):
    """mlx-lm's ``_run_http_server``, run once the generation thread has loaded the default
    model; where that failed, the thread is stopped and :class:`_LoadFailed` raised."""

    def run_http_server(host, port, response_generator, *args, **kwargs):
        provider = response_generator.model_provider
        loaded = getattr(provider, "loaded", None)
        if loaded is not None:
            while not loaded.wait(0.2):
                if not response_generator.generation_available():
                    raise _LoadFailed("the generation thread stopped while loading the model")
            if provider.load_error is not None:
                response_generator.stop_and_join()
                raise _LoadFailed(_first_line(provider.load_error))
        return original(host, port, response_generator, *args, **kwargs)

    return run_http_server


class _EmptyPrompt(ValueError):
    pass


def _refuse_empty_tokens(original):
    """``ResponseGenerator._tokenize`` refusing a prompt of no tokens: mlx-lm puts the error
    on the request's queue (the request fails) where its batch generator would raise on the
    generation thread and stop it (every later request then fails)."""

    def _tokenize(self, tokenizer, request, args):
        out = original(self, tokenizer, request, args)
        if len(out[0]) == 0:
            raise _EmptyPrompt("the prompt has no tokens: nothing to generate from")
        return out

    return _tokenize


def _refuse_bad_requests(original):
    """``APIHandler.handle_completion`` answering 400 to a request the server cannot serve
    (:func:`_request_error`: an empty prompt or messages, a ``stop`` that is no string or list
    of strings, a NaN or infinite sampling number, a ``logit_bias`` token outside the
    vocabulary: 400; a model other than the served one: 404), before it reaches the
    generation thread."""

    def handle_completion(self, request, stop_words):
        refused = _request_error(self, request, stop_words)
        if refused is not None:
            self._set_completion_headers(refused[0])
            self.end_headers()
            self.wfile.write(json.dumps({"error": refused[1]}).encode())
            self.wfile.flush()
            return None
        return original(self, request, stop_words)

    return handle_completion


def _velox_endpoint(spec: str):
    """A ``do_GET`` that answers ``/v1/velox`` and passes every other path to mlx-lm's."""
    import mlx.core as mx
    import mlx_lm.server as server

    original = server.APIHandler.do_GET

    def velox_info(self) -> dict:
        return {
            "method": spec,
            "prompt_cache": self.response_generator.prompt_cache.info(),
            "active_memory_bytes": int(mx.get_active_memory()),
            "peak_memory_bytes": int(mx.get_peak_memory()),
        }

    def models(self) -> dict:
        # the served model with its cache; mlx-lm's own listing also scans the Hugging Face
        # cache, and answers nothing where there is none (an offline machine)
        data = _hf_models(self.created)
        name = _served_name(self.response_generator.model_provider)
        if name:
            data.append(
                {
                    "id": name,  # as the command line named it: no path of this machine
                    "object": "model",
                    "created": self.created,
                    "velox": velox_info(self),
                }
            )
        return {"object": "list", "data": data}

    def do_GET(self):
        path = self.path.rstrip("/")
        if path == "/v1/velox":
            body = velox_info(self)
        elif path == "/v1/models":
            body = models(self)
        else:
            return original(self)
        self._set_completion_headers(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    return do_GET


def _hf_models(created: int) -> list[dict]:
    """mlx-lm models in the Hugging Face cache, as mlx-lm's server lists them."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    need = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:  # no Hugging Face cache on this machine
        return []
    out = []
    for repo in repos:
        if repo.repo_type != "model" or "main" not in repo.refs:
            continue
        if need <= {f.file_path.name for f in repo.refs["main"].files}:
            out.append({"id": repo.repo_id, "object": "model", "created": created})
    return out


def serve(spec: str, argv: list[str], storage_dtype: Any = None) -> None:
    """Run mlx-lm's server with velox caches of ``spec``; ``argv`` are mlx_lm.server's options
    (``--model``, ``--host``, ``--port``...). Blocks until the server stops.

    Raises:
        ValueError: a bad spec, ``--kv-bits``, or a model that fails to load or refuses the
            spec (before the server listens).
        SystemExit: an option mlx-lm's parser refuses (status 2: a ``--prompt-cache-bytes``
            that is no size, say), with the reason on stderr.
        FileNotFoundError: ``--model`` names no model, file or directory.
    """
    import mlx_lm.server as server

    import velox_core

    if any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in argv):
        raise ValueError(
            "velox serve: --kv-bits is mlx-lm's own quantized cache; the --method spec sets "
            "how velox compresses the cache"
        )
    velox_core.make(spec)  # an unknown method or a bad parameter fails before loading
    argv, aliases = _resolve_models(argv)  # named models and GGUF files, as bench takes them
    server.ModelProvider = _provider_class(spec, storage_dtype, aliases)
    server.APIHandler.do_GET = _velox_endpoint(spec)
    _patch(
        server.APIHandler,
        "handle_completion",
        lambda original: _error_responses(_refuse_bad_requests(original)),
    )
    _patch(server.ResponseGenerator, "_tokenize", _refuse_empty_tokens)
    _patch(server.ResponseGenerator, "_next_request", _track_requests)
    _patch(server.ResponseGenerator, "_run_generate", _survive_request_errors)
    _patch(server, "_run_http_server", _listen_after_load)
    _patch(server, "_parse_size", _checked_size)  # --prompt-cache-bytes, read by main()
    _patch(server.ResponseGenerator, "__init__", _budgeted_prompt_cache)
    old = sys.argv
    sys.argv = ["velox serve", *argv]
    try:
        server.main()
    except _LoadFailed as e:
        raise ValueError(f"velox serve: {e}") from None
    finally:
        sys.argv = old
