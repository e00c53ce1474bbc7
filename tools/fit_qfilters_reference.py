"""Fit the Q-Filters artifact of the reference model.

    python tools/fit_qfilters_reference.py [--tokens 4096] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), listed in ``shared/reference-model/corpus.json`` and read from the local Python
standard library; a file whose SHA-256 differs from the manifest is skipped. Files are taken
in a seeded order, each tokenized as in training (no special tokens, followed by
``<|endoftext|>``) and cut to its first ``--per-file`` tokens (so the calibration spans
several files), until ``--tokens`` tokens are gathered; they are cut into sequences of
2,048 tokens (the first training phase's length). The model runs on the CPU in float32.

Writes ``shared/artifacts/qfilters-reference-model.safetensors`` (one (2, 128) float32 array
per layer, a few KB), which ``velox_qfilters`` finds when ``$VELOX_ARTIFACTS`` lists
``shared/artifacts``.
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_core.artifacts_cli import Option
from velox_qfilters import fit_filters, save_filters

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "qfilters",
        fit_filters,
        save_filters,
        tokens=4096,
        per_file=512,
        options=(Option("--samples", int, 3000, "queries sampled per head"),),
        seeded=True,
    )
