"""``velox serve``: mlx-lm's OpenAI-compatible server with velox caches.

    velox serve --model PATH --method SPEC [--storage-dtype float16] [mlx_lm.server options]

Runs ``mlx_lm.server`` (its API, its continuous batching and its prompt cache) in this
process with every model it loads given velox caches (``velox_core.install``: the model's
``make_cache`` returns them, attention is routed to them). Requests of different lengths
batch together (``velox_core.VeloxBatch``). One endpoint is added:

    GET /v1/velox   {"method": SPEC, "prompt_cache": {"sequences": n, "resident_bytes": b,
                     "by_type": {...}}, "active_memory_bytes": .., "peak_memory_bytes": ..}

and ``GET /v1/models`` lists the served model with that object as its ``velox`` field (and
the Hugging Face cache's models, as mlx-lm does, where there is such a cache);
``resident_bytes`` is what the prompt cache's velox caches hold (measured from their
arrays, ``nbytes``). mlx-lm's ``--kv-bits`` (its own quantized cache) is refused: the method
spec says how the cache is compressed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["serve"]


def _provider_class(spec: str, storage_dtype: Any):
    import mlx_lm.server as server

    import velox_core

    class VeloxModelProvider(server.ModelProvider):
        """mlx-lm's model provider; each model it loads (and its draft) gets velox caches."""

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            velox_core.install(self.model, spec, storage_dtype=storage_dtype)
            if self.draft_model is not None:
                velox_core.install(self.draft_model, spec, storage_dtype=storage_dtype)
            caches = self.model.make_cache()
            self.is_batchable = self.draft_model is None and all(
                hasattr(c, "merge") for c in caches
            )

        def reset(self) -> None:
            for m in (self.model, getattr(self, "draft_model", None)):
                if m is not None:
                    velox_core.uninstall(m)
            super().reset()

    return VeloxModelProvider


def _velox_endpoint(spec: str):
    """A ``do_GET`` that answers ``/v1/velox`` and passes every other path to mlx-lm's."""
    import mlx.core as mx
    import mlx_lm.server as server

    original = server.APIHandler.do_GET

    def velox_info(self) -> dict:
        pc = self.response_generator.prompt_cache
        return {
            "method": spec,
            "prompt_cache": {
                "sequences": len(pc),
                "resident_bytes": int(pc.nbytes),
                "by_type": pc.stats_by_type(),
            },
            "active_memory_bytes": int(mx.get_active_memory()),
            "peak_memory_bytes": int(mx.get_peak_memory()),
        }

    def models(self) -> dict:
        # the served model with its cache; mlx-lm's own listing also scans the Hugging Face
        # cache, and answers nothing where there is none (an offline machine)
        data = _hf_models(self.created)
        model = self.response_generator.cli_args.model
        if model:
            data.append(
                {
                    "id": _model_id(model),
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


def _model_id(model: str) -> str:
    from pathlib import Path

    p = Path(model)
    return str(p.resolve()) if p.exists() else model


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
    (``--model``, ``--host``, ``--port``...). Blocks until the server stops."""
    import mlx_lm.server as server

    import velox_core

    if any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in argv):
        raise ValueError(
            "velox serve: --kv-bits is mlx-lm's own quantized cache; the --method spec sets "
            "how velox compresses the cache"
        )
    velox_core.make(spec)  # an unknown method or a bad parameter fails before loading
    server.ModelProvider = _provider_class(spec, storage_dtype)
    server.APIHandler.do_GET = _velox_endpoint(spec)
    old = sys.argv
    sys.argv = ["velox serve", *argv]
    try:
        server.main()
    finally:
        sys.argv = old
