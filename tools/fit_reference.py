"""Fit one method's artifact of the reference model.

    python tools/fit_reference.py METHOD [--tokens N] [--per-file N] [--seed 0] [--out FILE]
        [the method's own options]

METHOD is one of cachegen, commvq, kvtc, oscar, palu, qfilters, spectral (``python
tools/fit_reference.py METHOD --help`` lists its options and defaults).

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split; ``tools/reference_calibration.py``: listed in ``shared/reference-model/corpus.json``,
read from the local Python standard library, checked against their SHA-256, taken in the
order of ``--seed``, each tokenized as in training and cut to its first ``--per-file``
tokens) until ``--tokens`` tokens are gathered; they are cut into sequences of 2,048 tokens
(the first training phase's length). The model runs on the CPU in float32. The method's fit
runs on them (with ``--seed`` too where it samples) and the artifact goes to ``--out``,
default ``shared/artifacts/<METHOD>-reference-model.safetensors``, where the method finds it
by the model's fingerprint (``shared/artifacts`` is searched after ``$VELOX_ARTIFACTS`` and
``~/.cache/velox``). One line is printed: layers, fingerprint, tokens, files, the size.

What each fit does with the calibration (defaults: ``--tokens``, ``--per-file``):

* ``cachegen`` (16,384, 1,024): in each sequence the last 32 tokens are teacher-forced on the
  cache of the first 2,016, once as it is and once per layer and side with only that layer's
  keys (or values) coded at the default level (``velox_cachegen.fit_cachegen``); under
  2 KB: 12 multipliers and 12 measured KL values.
* ``commvq`` (16,384, 1,024): each KV head's codebooks are fitted by EM on ``--samples`` of
  its tokens: 2 residual stages of 16+16 entries per 4 RoPE pairs (1 bit per coordinate
  each), so 1-bit caches use the first stage and 2-bit caches both; float16 codebooks, about
  200 KB.
* ``kvtc`` (32,768, 1,024): of each sequence the first 4 and last 128 positions are left out
  (KVTC keeps them exact); the last quarter of the sequences measures the bit allocations
  for ``--ratios``, the rest fits the PCA of the 1,536-wide key rows (6 layers x 2 KV heads
  x 128 channels, RoPE undone) and of the value rows; float16 bases holding the components
  the 16x plan stores, about 2.4 MB.
* ``oscar`` (16,384, 1,024): every layer's key rotation comes from the covariance of all
  calibration queries (per KV head, averaged), its value rotation from the score-weighted
  covariance of all calibration values, its clip ratios from a sample of 4,096 tokens
  (:mod:`velox_oscar.fit`); float16 rotations, about 0.4 MB.
* ``palu`` (16,384, 1,024): every layer's key and value bases (one group of its 2 KV heads)
  come from the Gram matrices of all calibration tokens' pre-RoPE keys and values, the
  Fisher information of its projections from the gradients of the next-token loss over the
  same sequences; float16 bases, about 1.6 MB.
* ``qfilters`` (4,096, 512): each KV head's filter is the principal direction of
  ``--samples`` sampled post-RoPE queries of its query heads (:mod:`velox_qfilters.fit`);
  one (2, 128) float32 array per layer, a few KB.
* ``spectral`` (16,384, 1,024): every layer's key and value bases come from the covariance
  of all calibration tokens of each KV head but the first ``--skip`` of each sequence, the
  keys moved to positions drawn from ``[0, --positions)`` (:mod:`velox_spectral.fit`); int8
  bases, about 0.4 MB.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reference_calibration import ARTIFACTS, SEQ_LEN, calibration_ids, load_reference, source

from velox_core.artifacts_cli import Option


def _floats(text: str) -> list[float]:
    """``"16,20"`` -> ``[16.0, 20.0]``."""
    return [float(x) for x in text.split(",")]


@dataclass(frozen=True)
class Method:
    """One method's reference fit: ``fit`` and ``save`` of ``velox_<name>``, the calibration
    defaults, the fit's own options (one left at None is not passed: the fit's default
    holds), whether the fit takes ``seed=`` and a note appended to the printed line."""

    fit: str
    save: str
    tokens: int
    per_file: int
    options: tuple[Option, ...] = ()
    seeded: bool = False
    note: Callable[[Any], str] = lambda _: ""


def _steps(art) -> str:
    key = " ".join(f"{x:.2f}" for x in art.steps.key)
    return f"; key steps {key}, value steps " + " ".join(f"{x:.2f}" for x in art.steps.value)


METHODS = {
    "cachegen": Method("fit_cachegen", "save_profile", 16384, 1024, note=_steps),
    "commvq": Method(
        "fit_codebooks",
        "save_codebooks",
        16384,
        1024,
        (
            Option("--samples", int, 4096, "tokens sampled per head"),
            Option("--iters", int, 16, "EM iterations per stage"),
        ),
        seeded=True,
    ),
    "kvtc": Method(
        "fit_kvtc",
        "save_basis",
        32768,
        1024,
        (Option("--ratios", _floats, "16,20,24,32", "target ratios (comma-separated)"),),
        note=lambda art: (
            f"; components {art.bases['key'].shape[1]} + "
            f"{art.bases['value'].shape[1]}, {art.nbytes} bytes"
        ),
    ),
    "oscar": Method(
        "fit_oscar",
        "save_rotations",
        16384,
        1024,
        note=lambda art: f"; 2-bit clips {[art.clips[i][2] for i in sorted(art.clips)]}",
    ),
    "palu": Method(
        "fit_palu", "save_bases", 16384, 1024, note=lambda art: f"; Fisher {art.fisher}"
    ),
    "qfilters": Method(
        "fit_filters",
        "save_filters",
        4096,
        512,
        (Option("--samples", int, 3000, "queries sampled per head"),),
        seeded=True,
    ),
    "spectral": Method(
        "fit_spectral",
        "save_bases",
        16384,
        1024,
        (
            Option("--skip", int, None, "first tokens of each sequence left out (fit's: 4)"),
            Option("--positions", int, None, "key bases cover positions 0 to this (16,384)"),
        ),
        seeded=True,
    ),
}


def parser() -> argparse.ArgumentParser:
    """One subcommand per method, with the common options and the method's own."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name, m in METHODS.items():
        s = sub.add_parser(name, help=f"fit velox_{name}'s artifact")
        s.add_argument("--tokens", type=int, default=m.tokens, help="calibration tokens")
        s.add_argument("--per-file", type=int, default=m.per_file, help="tokens per file at most")
        s.add_argument("--seed", type=int, default=0, help="seed of the file order (and fit)")
        s.add_argument("--out", default=str(ARTIFACTS / f"{name}-reference-model.safetensors"))
        for option in m.options:
            option.add(s)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    m = METHODS[args.method]
    mod = importlib.import_module(f"velox_{args.method}")
    model, tokenizer = load_reference()
    ids, used = calibration_ids(tokenizer, args.tokens, args.per_file, args.seed)
    own = {o.name: getattr(args, o.name) for o in m.options if getattr(args, o.name) is not None}
    if m.seeded:
        own["seed"] = args.seed
    fit = getattr(mod, m.fit)
    art = fit(model, ids, max_tokens=args.tokens, seq_len=SEQ_LEN, source=source(used), **own)
    path = getattr(mod, m.save)(art, args.out)
    print(
        f"{len(art.layers)} layers, fingerprint {art.fingerprint}, "
        f"{art.calibration['tokens']} tokens from {len(used)} train files -> {path} "
        f"({path.stat().st_size / 1024:.0f} KB){m.note(art)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
