"""Fit the spectral (PCA) artifact of the reference model.

    python tools/fit_spectral_reference.py [--tokens 16384] [--skip 4] [--positions 16384]
        [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters, CommVQ, Palu and OSCAR artifacts (``tools/reference_calibration.py``:
listed in ``shared/reference-model/corpus.json``, read from the local Python standard library,
checked against their SHA-256, taken in a seeded order, each tokenized as in training and cut
to its first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Every layer's key and value
bases come from the covariance of all calibration tokens of each KV head but the first
``--skip`` of each sequence (:mod:`velox_spectral.fit`).

Writes ``shared/artifacts/spectral-reference-model.safetensors`` (float16 bases, about
0.8 MB), which ``velox_spectral`` finds by the model's fingerprint (``shared/artifacts`` is
searched after ``$VELOX_ARTIFACTS`` and ``~/.cache/velox``).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_core.artifacts_cli import Option
from velox_spectral import fit_spectral, save_bases
from velox_spectral.fit import POSITIONS, SKIP

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "spectral",
        fit_spectral,
        save_bases,
        tokens=16384,
        per_file=1024,
        options=(
            Option("--skip", int, SKIP, "first tokens of each sequence left out"),
            Option("--positions", int, POSITIONS, "key bases cover positions 0 to this"),
        ),
        seeded=True,
    )
