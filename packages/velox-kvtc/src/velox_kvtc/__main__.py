"""``python -m velox_kvtc``: fit a model's KVTC basis, show an artifact, inspect a cache.

Usage:

    python -m velox_kvtc fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 32768] [--seq-len 2048] [--ratios 8,16,20,24,32] [--dtype float32]
    python -m velox_kvtc show FILE
    python -m velox_kvtc inspect CACHE
"""

from __future__ import annotations

import sys

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import SIDES, KvtcBasis, load_basis, save_basis
from .fit import RATIOS, fit_kvtc
from .load import inspect


def _ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ValueError(f"--ratios: numbers separated by commas, got {text!r}") from None


def _fit(model, tokenizer, texts, *, ratios: str, **kwargs):
    return fit_kvtc(model, tokenizer, texts, ratios=_ratios(ratios), **kwargs)


def _describe(b: KvtcBasis) -> dict:
    return {
        "layers": {i: list(g) for i, g in b.geometry.items()},
        "basis": {s: list(b.bases[s].shape) for s in SIDES},
        "basis_bytes": b.nbytes,
        "basis_id": b.basis_id,
        "plans": {
            r: {
                s: {"bits": p.bits, "components": p.components, "groups": p.to_json()}
                for s, p in v.items()
            }
            for r, v in b.plans.items()
        },
    }


COMMAND = ArtifactCommand(
    "kvtc",
    "KVTC basis",
    _fit,
    save_basis,
    load_basis,
    _describe,
    lambda b: (
        f"{b.bases['key'].shape[1]} + {b.bases['value'].shape[1]} components, "
        f"ratios {', '.join(sorted(b.plans, key=float))}"
    ),
    options=(
        Option(
            "--ratios",
            str,
            ",".join(f"{r:g}" for r in RATIOS),
            "target ratios to allocate bits for (comma-separated)",
        ),
    ),
    tokens=32768,
    doc=__doc__,
    inspect=inspect,
)
main, fit_main = COMMAND.main, COMMAND.fit_main


if __name__ == "__main__":
    sys.exit(main())
