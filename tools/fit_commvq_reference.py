"""Fit the CommVQ artifact of the reference model.

    python tools/fit_commvq_reference.py [--tokens 16384] [--samples 4096] [--iters 16] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters artifact (``tools/fit_qfilters_reference.py``: listed in
``shared/reference-model/corpus.json``, read from the local Python standard library, checked
against their SHA-256, taken in a seeded order, each tokenized as in training and cut to its
first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Each KV head's codebooks are
fitted by EM on ``--samples`` of its tokens: 2 residual stages of 16+16 entries per 4 RoPE
pairs (1 bit per coordinate each), so 1-bit caches use the first stage and 2-bit caches both.

Writes ``shared/artifacts/commvq-reference-model.safetensors`` (float16 codebooks, about
200 KB), which ``velox_commvq`` finds when ``$VELOX_ARTIFACTS`` lists ``shared/artifacts``
(``velox bench`` adds it).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_commvq import fit_codebooks, save_codebooks
from velox_core.artifacts_cli import Option

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "commvq",
        fit_codebooks,
        save_codebooks,
        tokens=16384,
        per_file=1024,
        options=(
            Option("--samples", int, 4096, "tokens sampled per head"),
            Option("--iters", int, 16, "EM iterations per stage"),
        ),
        seeded=True,
    )
