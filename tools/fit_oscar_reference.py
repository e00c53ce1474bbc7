"""Fit the OSCAR artifact of the reference model.

    python tools/fit_oscar_reference.py [--tokens 16384] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters, CommVQ and Palu artifacts (``tools/reference_calibration.py``:
listed in ``shared/reference-model/corpus.json``, read from the local Python standard library,
checked against their SHA-256, taken in a seeded order, each tokenized as in training and cut
to its first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Every layer's key rotation
comes from the covariance of all calibration queries (per KV head, averaged), its value
rotation from the score-weighted covariance of all calibration values, its clip ratios from a
sample of 4,096 tokens (:mod:`velox_oscar.fit`).

Writes ``shared/artifacts/oscar-reference-model.safetensors`` (float16 rotations, about
0.4 MB), which ``velox_oscar`` finds by the model's fingerprint (``shared/artifacts`` is
searched after ``$VELOX_ARTIFACTS`` and ``~/.cache/velox``).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_oscar import fit_oscar, save_rotations

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "oscar",
        fit_oscar,
        save_rotations,
        tokens=16384,
        per_file=1024,
        note=lambda art: f"; 2-bit clips {[art.clips[i][2] for i in sorted(art.clips)]}",
    )
