"""``python -m velox_oscar``: fit a model's OSCAR rotations and clip ratios, or show an artifact.

Usage:

    python -m velox_oscar fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--samples 4096] [--group G]
        [--seed 0] [--dtype float32]
    python -m velox_oscar show FILE
"""

from __future__ import annotations

import sys

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import OscarRotations, load_rotations, save_rotations
from .fit import fit_oscar


def _describe(r: OscarRotations) -> dict:
    return {
        "layers": {i: list(a["key"].shape) for i, a in sorted(r.layers.items())},
        **r.tables(),
        "key_heads": {i: a["key_mean"].shape[0] for i, a in sorted(r.layers.items())},
        "fit_group": r.fit_group,
    }


COMMAND = ArtifactCommand(
    "oscar",
    "OSCAR rotations",
    fit_oscar,
    save_rotations,
    load_rotations,
    _describe,
    lambda r: "clip ratios fitted at 2 to 8 bits",
    options=(
        Option("--samples", int, 4096, "tokens per layer for the clip fit"),
        Option("--group", int, None, "group the clips are fitted for (default: the head, <=128)"),
        Option("--seed", int, 0, "seed of the clip sample"),
    ),
    doc=__doc__,
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
