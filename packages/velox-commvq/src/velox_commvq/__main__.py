"""``python -m velox_commvq``: fit a model's CommVQ codebooks, or show an artifact.

Usage:

    python -m velox_commvq fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--samples 4096] [--pairs 4] [--entries 16]
        [--stages 2] [--iters 16] [--seed 0] [--dtype float32]
    python -m velox_commvq show FILE
"""

from __future__ import annotations

import sys

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import Codebooks, load_codebooks, save_codebooks
from .fit import fit_codebooks


def _summary(b: Codebooks) -> str:
    g = b.geometry
    return f"{g.stages} stages of {g.entries}+{g.entries} entries per {g.pairs} pairs"


def _describe(b: Codebooks) -> dict:
    g = b.geometry
    return {
        "geometry": {"pairs": g.pairs, "entries": g.entries, "stages": g.stages},
        "layers": {i: list(a.shape) for i, (a, _) in sorted(b.layers.items())},
        "layouts": b.layouts,
    }


COMMAND = ArtifactCommand(
    "commvq",
    "CommVQ key codebooks",
    fit_codebooks,
    save_codebooks,
    load_codebooks,
    _describe,
    _summary,
    options=(
        Option("--samples", int, 4096, "tokens sampled per head"),
        Option("--pairs", int, 4, "RoPE pairs per code"),
        Option("--entries", int, 16, "entries per small codebook"),
        Option("--stages", int, 2, "residual stages (2: up to 2 bits)"),
        Option("--iters", int, 16, "EM iterations per stage"),
        Option("--seed", int, 0, "seed of the sample and initialization"),
    ),
    doc=__doc__,
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
