"""``python -m velox_spectral``: fit a model's PCA bases, or show an artifact.

    python -m velox_spectral fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--skip 4] [--positions 16384] [--seed 0]
        [--dtype float32]
    python -m velox_spectral show FILE

``show`` prints each layer's head count and dim and the ranks that hold 50, 80, 90 and 95%
of each side's variance (the largest over its heads).
"""

from __future__ import annotations

import sys

import numpy as np

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import SIDES, SpectralBases, load_bases, save_bases
from .codec import rank_for_variance
from .fit import POSITIONS, SKIP, fit_spectral

FRACTIONS = (0.5, 0.8, 0.9, 0.95)


def _describe(r: SpectralBases) -> dict:
    out = {}
    for i, sides in sorted(r.layers.items()):
        h, d = sides["key"]["mean"].shape
        ranks = {
            s: {
                str(f): rank_for_variance(np.asarray(sides[s]["eigenvalues"]), f) for f in FRACTIONS
            }
            for s in SIDES
        }
        out[i] = {"heads": h, "dim": d, "ranks": ranks}
    return {"layers": out}


COMMAND = ArtifactCommand(
    "spectral",
    "spectral bases",
    fit_spectral,
    save_bases,
    load_bases,
    _describe,
    lambda r: "PCA bases of keys and values per KV head",
    options=(
        Option("--skip", int, SKIP, "first tokens of each sequence left out (sinks)"),
        Option("--positions", int, POSITIONS, "key bases cover positions 0 to this (0: as run)"),
        Option("--seed", int, 0, "seed of the keys' positions"),
    ),
    doc=__doc__,
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
