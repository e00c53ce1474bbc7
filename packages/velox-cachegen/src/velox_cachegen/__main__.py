"""``python -m velox_cachegen``: measure a model's layer steps, show them, inspect a cache.

    python -m velox_cachegen fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--dtype float32]
    python -m velox_cachegen show FILE
    python -m velox_cachegen inspect CACHE

``fit`` loads the model with ``mlx_lm.load``, tokenizes the text files with the model's own
tokenizer (each file followed by the EOS token) and writes the layer steps to ``--out``
(default: ``~/.cache/velox/cachegen-<fingerprint>.safetensors``, where saves find them).
"""

from __future__ import annotations

import json
import sys

from velox_core.artifacts_cli import ArtifactCommand

from .artifact import LayerProfile, fit_cachegen, load_profile, save_profile
from .load import inspect


def _describe(p: LayerProfile) -> dict:
    return {"layers": p.layers, "layer_steps": p.steps.to_json(), "kl": p.kl}


COMMAND = ArtifactCommand(
    "cachegen",
    "CacheGen layer steps",
    fit_cachegen,
    save_profile,
    load_profile,
    _describe,
    lambda p: "key steps " + " ".join(f"{x:.2f}" for x in p.steps.key),
    tokens=16384,
    doc=__doc__,
)
fit_main = COMMAND.fit_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["inspect"]:
        if len(args) != 2:
            print("usage: python -m velox_cachegen inspect CACHE", file=sys.stderr)
            return 2
        try:
            print(json.dumps(inspect(args[1]), indent=1))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    return COMMAND.main(args)


if __name__ == "__main__":
    sys.exit(main())
