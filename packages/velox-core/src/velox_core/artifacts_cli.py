"""The command line of a per-model artifact: ``python -m velox_<method> fit|show``.

A method that fits an artifact (:mod:`velox_core.artifacts`) gives :class:`ArtifactCommand`
its name, its own ``fit`` options, the function that fits and writes, and the one that
describes a file; the shared parts live here: the common ``fit`` options (``--model``,
``--text``, ``--out``, ``--tokens``, ``--seq-len``, ``--dtype``), reading the calibration
text, loading the model, the default output path (``~/.cache/velox/<method>-<fingerprint>``,
where caches look) and the exit codes (2 on a bad argument, with one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DTYPES", "ArtifactCommand", "default_out", "load_for_fit", "read_texts"]

DTYPES = ("auto", "float32", "float16", "bfloat16")


def read_texts(names: list[str]) -> list[str]:
    """The calibration files' text (``SystemExit`` naming a missing one)."""
    out = []
    for name in names:
        p = Path(name)
        if not p.is_file():
            raise SystemExit(f"--text {name}: no such file")
        out.append(p.read_text(encoding="utf-8", errors="replace"))
    return out


def load_for_fit(path: str, dtype: str = "auto") -> tuple[Any, Any]:
    """``mlx_lm.load(path)``, the model cast to ``dtype`` unless ``"auto"``."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(path)
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def default_out(method: str, fingerprint: str, out: str | None) -> Path:
    """``out``, or ``~/.cache/velox/<method>-<fingerprint>.safetensors``."""
    return Path(out) if out else Path("~/.cache/velox") / f"{method}-{fingerprint}.safetensors"


@dataclass(frozen=True)
class ArtifactCommand:
    """``python -m velox_<method> fit|show`` for one method's artifact.

    Attributes:
        method: the method's name (the default file's prefix, the program's name).
        what: what the artifact holds, for help texts ("the CommVQ key codebooks").
        add_fit_options: adds the method's own ``fit`` options to the parser.
        fit: ``fit(args, model, tokenizer, texts) -> message`` fits, writes and says what.
        show: ``show(path) -> dict`` describes a file (printed as JSON).
        tokens: the default of ``--tokens``.
    """

    method: str
    what: str
    add_fit_options: Callable[[argparse.ArgumentParser], None]
    fit: Callable[[argparse.Namespace, Any, Any, list[str]], str]
    show: Callable[[str], dict]
    tokens: int = 16384
    doc: str = ""

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"python -m velox_{self.method}", description=self.doc)
        sub = p.add_subparsers(dest="command", required=True)
        fit = sub.add_parser("fit", help=f"fit {self.what} of a model on calibration text")
        fit.add_argument("--model", required=True, help="mlx-lm model path or repository")
        fit.add_argument("--text", required=True, nargs="+", help="calibration text file(s)")
        fit.add_argument("--out", help="artifact to write (.safetensors)")
        fit.add_argument(
            "--tokens", type=int, default=self.tokens, help="calibration tokens at most"
        )
        fit.add_argument(
            "--seq-len", type=int, default=2048, help="tokens per calibration sequence"
        )
        fit.add_argument("--dtype", choices=DTYPES, default="auto", help="run the model so")
        self.add_fit_options(fit)
        fit.set_defaults(run=self._fit)
        show = sub.add_parser("show", help="print what an artifact holds")
        show.add_argument("file")
        show.set_defaults(run=lambda a: print(json.dumps(self.show(a.file), indent=1)) or 0)
        return p

    def _fit(self, args: argparse.Namespace) -> int:
        texts = read_texts(args.text)
        model, tokenizer = load_for_fit(args.model, args.dtype)
        print(self.fit(args, model, tokenizer, texts))
        return 0

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parser().parse_args(argv)
        try:
            return args.run(args)
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    def fit_main(self, argv: list[str] | None = None) -> int:
        """``fit`` alone: what ``velox fit <method> ARGS`` runs."""
        return self.main(["fit", *(sys.argv[1:] if argv is None else argv)])
