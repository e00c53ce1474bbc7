"""The command line of a per-model artifact: ``python -m velox_<method> fit|show``.

A method that fits an artifact (:mod:`velox_core.artifacts`) gives :class:`ArtifactCommand`
its fit function, its own ``fit`` options, and how to save, load and describe a file; the
shared parts live here: the common ``fit`` options (``--model``, ``--text``, ``--out``,
``--tokens``, ``--seq-len``, ``--dtype``), reading the calibration text, loading the model,
the call of the fit, the default output path (``~/.cache/velox/<method>-<fingerprint>``,
where caches look; :data:`FIT_DOC` says so in the help), the fields every artifact shows
(fingerprint, model, calibration), an ``inspect CACHE`` command where the method reads saved
caches, and the exit codes (2 on a bad argument, with one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ArtifactCommand", "Option"]

DTYPES = ("auto", "float32", "float16", "bfloat16")
FIT_DOC = (
    "``fit`` loads the model with ``mlx_lm.load``, tokenizes the text files with the model's "
    "own tokenizer (each file followed by the EOS token) and writes the artifact to ``--out`` "
    "(default: ``~/.cache/velox/{method}-<fingerprint>.safetensors``, where velox finds it)."
)


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
class Option:
    """One of a method's own ``fit`` options, passed to its fit function as ``dest``.

    A ``bool`` option is a switch: ``--no-x`` (``default=True``) stores False, ``--x``
    (``default=False``) stores True.
    """

    flag: str
    type: type
    default: Any
    help: str
    dest: str | None = None

    @property
    def name(self) -> str:
        return self.dest or self.flag.lstrip("-").replace("-", "_")

    def add(self, parser: argparse.ArgumentParser) -> None:
        if self.type is bool:
            action = "store_false" if self.default else "store_true"
            parser.add_argument(self.flag, dest=self.name, action=action, help=self.help)
        else:
            parser.add_argument(
                self.flag, dest=self.name, type=self.type, default=self.default, help=self.help
            )


@dataclass(frozen=True)
class ArtifactCommand:
    """``python -m velox_<method> fit|show`` for one method's artifact.

    Attributes:
        method: the method's name (the default file's prefix, the program's name).
        what: what the artifact holds, for help texts and messages ("<method> key codebooks").
        fit: ``fit(model, tokenizer, texts, *, max_tokens, seq_len, source, **options)``
            returns the artifact (with ``layers``, ``fingerprint``, ``model`` and
            ``calibration``, whose ``tokens`` it used).
        save: ``save(artifact, path) -> path`` writes it.
        load: ``load(path) -> artifact`` reads one.
        describe: ``describe(artifact) -> dict``: its own fields (``layers`` included),
            shown after the fingerprint, model and calibration.
        summary: ``summary(artifact) -> str``: its geometry in a few words, for the line
            ``fit`` prints ("" for none).
        options: the method's own ``fit`` options.
        tokens: the default of ``--tokens``.
        doc: the program's description (:data:`FIT_DOC` is added to it).
        inspect: ``inspect(path) -> dict``: what a saved cache of the method holds, for an
            ``inspect CACHE`` command (None: no such command).
    """

    method: str
    what: str
    fit: Callable[..., Any]
    save: Callable[[Any, Path], Path]
    load: Callable[[str], Any]
    describe: Callable[[Any], dict]
    summary: Callable[[Any], str] = lambda _: ""
    options: tuple[Option, ...] = ()
    tokens: int = 16384
    doc: str = ""
    inspect: Callable[[str], dict] | None = None

    def parser(self) -> argparse.ArgumentParser:
        doc = f"{self.doc.rstrip()}\n\n{FIT_DOC.format(method=self.method)}"
        p = argparse.ArgumentParser(prog=f"python -m velox_{self.method}", description=doc)
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
        for option in self.options:
            option.add(fit)
        fit.set_defaults(run=self._fit)
        show = sub.add_parser("show", help="print what an artifact holds")
        show.add_argument("file")
        show.set_defaults(run=lambda a: print(json.dumps(self.show(a.file), indent=1)) or 0)
        if self.inspect is not None:
            inspect = sub.add_parser("inspect", help="print what a saved cache holds")
            inspect.add_argument("cache")
            inspect.set_defaults(run=lambda a: print(json.dumps(self.inspect(a.cache), indent=1)))
        return p

    def show(self, path: str) -> dict:
        """What ``show`` prints: the artifact's provenance, then its own fields."""
        art = self.load(path)
        provenance = {"fingerprint": art.fingerprint, "model": art.model}
        return {**provenance, "calibration": art.calibration, **self.describe(art)}

    def _fit(self, args: argparse.Namespace) -> int:
        texts = read_texts(args.text)
        model, tokenizer = load_for_fit(args.model, args.dtype)
        art = self.fit(
            model,
            tokenizer,
            texts,
            max_tokens=args.tokens,
            seq_len=args.seq_len,
            source=", ".join(Path(t).name for t in args.text),
            **{o.name: getattr(args, o.name) for o in self.options},
        )
        path = self.save(art, default_out(self.method, art.fingerprint, args.out))
        shape = ", ".join(x for x in (f"{len(art.layers)} layers", self.summary(art)) if x)
        print(
            f"{self.what} of {args.model} ({shape}, fingerprint {art.fingerprint}) from "
            f"{art.calibration['tokens']} tokens -> {path}"
        )
        return 0

    def main(self, argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        if self.inspect is not None and argv[:1] == ["inspect"] and len(argv) != 2:
            print(f"usage: python -m velox_{self.method} inspect CACHE", file=sys.stderr)
            return 2
        args = self.parser().parse_args(argv)
        try:
            return args.run(args) or 0
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    def fit_main(self, argv: list[str] | None = None) -> int:
        """``fit`` alone: what ``velox fit <method> ARGS`` runs."""
        return self.main(["fit", *(sys.argv[1:] if argv is None else argv)])
