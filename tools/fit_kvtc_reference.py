"""Fit the KVTC artifact of the reference model.

    python tools/fit_kvtc_reference.py [--tokens 32768] [--ratios 16,20,24,32] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Palu artifact (``tools/fit_palu_reference.py``: listed in
``shared/reference-model/corpus.json``, read from the local Python standard library, checked
against their SHA-256, taken in a seeded order, each tokenized as in training and cut to its
first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Of each sequence the first 4
and last 128 positions are left out (KVTC keeps them exact); the last quarter of the
sequences measures the bit allocations, the rest fits the PCA of the 1,536-wide key rows (6
layers x 2 KV heads x 128 channels, RoPE undone) and of the value rows.

Writes ``shared/artifacts/kvtc-reference-model.safetensors`` (float16 bases holding the
components the 16x plan stores, about 2.4 MB), which ``velox_kvtc`` finds when
``$VELOX_ARTIFACTS`` lists ``shared/artifacts`` (``benchmarks/kvtc_disk.py`` adds it).
"""

from __future__ import annotations

from reference_calibration import fit_reference

from velox_core.artifacts_cli import Option
from velox_kvtc import fit_kvtc, save_basis


def _fit(model, ids, *, ratios: str, **kwargs):
    return fit_kvtc(model, ids, ratios=[float(r) for r in ratios.split(",")], **kwargs)


if __name__ == "__main__":
    fit_reference(
        __doc__,
        "kvtc",
        _fit,
        save_basis,
        tokens=32768,
        per_file=1024,
        options=(Option("--ratios", str, "16,20,24,32", "target ratios (comma-separated)"),),
        note=lambda art: (
            f"; components {art.bases['key'].shape[1]} + "
            f"{art.bases['value'].shape[1]}, {art.nbytes} bytes"
        ),
    )
