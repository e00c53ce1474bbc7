"""Fit the CacheGen layer steps of the reference model.

    python tools/fit_cachegen_reference.py [--tokens 16384] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the other artifacts (``tools/reference_calibration.py``: listed in
``shared/reference-model/corpus.json``, read from the local Python standard library, checked
against their SHA-256, taken in a seeded order, each tokenized as in training and cut to its
first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. In each sequence the last 32
tokens are teacher-forced on the cache of the first 2,016, once as it is and once per layer
and side with only that layer's keys (or values) coded at the default level
(``velox_cachegen.fit_cachegen``).

Writes ``shared/artifacts/cachegen-reference-model.safetensors`` (a few hundred bytes: 12
multipliers and 12 measured KL values), which ``velox_cachegen`` finds by the model's
fingerprint when ``$VELOX_ARTIFACTS`` lists ``shared/artifacts`` (``benchmarks/
cachegen_disk.py`` adds it).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_cachegen import fit_cachegen, save_profile

if __name__ == "__main__":
    fit_reference(
        __doc__,
        "cachegen",
        fit_cachegen,
        save_profile,
        tokens=16384,
        per_file=1024,
        note=lambda art: (
            "; key steps "
            + " ".join(f"{x:.2f}" for x in art.steps.key)
            + ", value steps "
            + " ".join(f"{x:.2f}" for x in art.steps.value)
        ),
    )
