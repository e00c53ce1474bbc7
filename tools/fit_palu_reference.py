"""Fit the Palu artifact of the reference model.

    python tools/fit_palu_reference.py [--tokens 16384] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters and CommVQ artifacts (``tools/fit_qfilters_reference.py``: listed
in ``shared/reference-model/corpus.json``, read from the local Python standard library,
checked against their SHA-256, taken in a seeded order, each tokenized as in training and cut
to its first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Every layer's key and value
bases (one group of its 2 KV heads) come from the Gram matrices of all calibration tokens'
pre-RoPE keys and values; the Fisher information of its projections from the gradients of the
next-token loss over the same sequences.

Writes ``shared/artifacts/palu-reference-model.safetensors`` (float16 bases, about 1.6 MB),
which ``velox_palu`` finds when ``$VELOX_ARTIFACTS`` lists ``shared/artifacts`` (``velox
bench`` adds it).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_palu import fit_palu, save_bases

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "palu",
        fit_palu,
        save_bases,
        tokens=16384,
        per_file=1024,
        note=lambda art: f"; Fisher {art.fisher}",
    )
