"""``python -m velox_palu``: fit a model's Palu bases, or show an artifact.

Usage:

    python -m velox_palu fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--heads-per-group G] [--no-fisher]
        [--dtype float32]
    python -m velox_palu show FILE
"""

from __future__ import annotations

import sys

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import SIDES, PaluBases, load_bases, save_bases
from .fit import fit_palu


def _describe(b: PaluBases) -> dict:
    return {
        "heads_per_group": b.heads_per_group,
        "layers": {i: {s: list(b.bases[(i, s)][0].shape) for s in SIDES} for i in b.layers},
        "fisher": b.fisher,
        "layouts": b.layouts,
    }


COMMAND = ArtifactCommand(
    "palu",
    "Palu bases",
    fit_palu,
    save_bases,
    load_bases,
    _describe,
    lambda b: f"{b.heads_per_group} KV heads per group",
    options=(
        Option("--heads-per-group", int, None, "KV heads per group (default 4)"),
        Option("--no-fisher", bool, True, "skip the Fisher information (uniform ranks)", "fisher"),
    ),
    doc=__doc__,
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
