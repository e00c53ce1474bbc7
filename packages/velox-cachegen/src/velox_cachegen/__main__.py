"""``python -m velox_cachegen``: measure a model's layer steps, show them, inspect a cache.

Usage:

    python -m velox_cachegen fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--dtype float32]
    python -m velox_cachegen show FILE
    python -m velox_cachegen inspect CACHE
"""

from __future__ import annotations

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
    inspect=inspect,
)
main, fit_main = COMMAND.main, COMMAND.fit_main


if __name__ == "__main__":
    sys.exit(main())
