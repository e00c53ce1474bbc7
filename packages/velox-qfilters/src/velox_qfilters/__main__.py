"""``python -m velox_qfilters``: fit a model's Q-Filters, or show an artifact.

Usage:

    python -m velox_qfilters fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 8192] [--seq-len 2048] [--samples 3000] [--seed 0] [--dtype float32]
    python -m velox_qfilters show FILE
"""

from __future__ import annotations

import sys

from velox_core.artifacts_cli import ArtifactCommand, Option

from .artifact import Filters, load_filters, save_filters
from .fit import fit_filters


def _describe(f: Filters) -> dict:
    return {"layers": {i: list(a.shape) for i, a in sorted(f.layers.items())}}


COMMAND = ArtifactCommand(
    "qfilters",
    "Q-Filters",
    fit_filters,
    save_filters,
    load_filters,
    _describe,
    lambda f: f"{f.calibration['samples']} sampled queries",
    options=(
        Option("--samples", int, 3000, "queries sampled for the SVD"),
        Option("--seed", int, 0, "seed of the query sample"),
    ),
    tokens=8192,
    doc=__doc__,
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
