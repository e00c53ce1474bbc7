"""The ``velox`` command's argument parser: every subcommand and its options (the commands
themselves are in :mod:`velox_cli.main`)."""

from __future__ import annotations

import argparse
import sys

__all__: list[str] = []


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse's own convention)
        print(f"velox: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _outputs(p: argparse.ArgumentParser, json_help: str, chart: str) -> None:
    """The options where a run's results go: ``--json``, ``--markdown`` and ``--chart``
    (default ``chart``)."""
    p.add_argument("--json", dest="json_path", metavar="PATH", help=json_help)
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    p.add_argument(
        "--chart",
        default=chart,
        help="PNG chart path, printed in full when written ('' for none; default "
        f"{chart} in the current directory)",
    )


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="velox", description="KV-cache compression for MLX: measure, generate, inspect"
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    b = sub.add_parser("bench", help="memory, quality and speed of methods on a real model")
    b.add_argument(
        "--model",
        help="an mlx-lm model directory, a .gguf file or a name (smollm2); default: the "
        "reference model in shared/",
    )
    b.add_argument(
        "--methods",
        nargs="+",
        metavar="SPEC",
        help="specs like uniform:bits=4,group=64 or the baselines fp16 mlx-q4 mlx-q8 "
        "(default: the quick subset, fp16, mlx-q4 and five velox specs; --all for every "
        "method)",
    )
    b.add_argument(
        "--all",
        action="store_true",
        help="the full grid: the baselines and every installed method at its recommended "
        "settings (96 specs with every package; on two idle CPU cores about 10 minutes on the "
        "reference model and about 86 minutes on SmolLM2 at the default --context 2048, "
        "against about 1 and 8 minutes for the quick subset; benchmarks/bench_cost.py "
        "measures a model's)",
    )
    b.add_argument("--context", type=int, default=2048, help="prefix tokens (default 2048)")
    b.add_argument("--samples", type=int, default=1, help="quality samples (default 1)")
    b.add_argument(
        "--continuation", type=int, default=32, help="decode steps per sample (default 32)"
    )
    b.add_argument(
        "--recall-trials",
        type=int,
        default=1,
        help="recall prompts per depth (0.1, 0.5, 0.9) of the full context (default 1)",
    )
    b.add_argument("--chunk", type=int, default=512, help="prefill chunk size (default 512)")
    b.add_argument("--data", help="evaluate on this text file (or .jsonl[.gz] of {'text': ...})")
    b.add_argument("--quick", action="store_true", help="a small, fast run")
    b.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="specs measured at once, each in a worker process (default 0: one per CPU core on "
        "MLX's CPU backend, 1 on a GPU; 1 measures every spec alone, for speeds without "
        "neighbours)",
    )
    _outputs(b, "write the rows as JSON", "velox-bench.png")
    b.add_argument(
        "--transfer-mapper",
        metavar="DIR",
        help="a velox-transfer mapper into --model: adds a row of the model decoding from "
        "--transfer-source's cache mapped by it (with --transfer-source)",
    )
    b.add_argument(
        "--transfer-source", metavar="MODEL", help="the mapper's source model (see above)"
    )
    e = sub.add_parser(
        "eval",
        help="the long-context suite: RULER-style tasks (passkey, needles, variable tracking, "
        "common words) at long lengths, every spec against fp16 on the same prompts",
    )
    e.add_argument(
        "--model",
        help="an mlx-lm directory, a .gguf file or a name (smollm2, gemma3); default: the "
        "reference model in shared/",
    )
    e.add_argument(
        "--methods",
        nargs="+",
        metavar="SPEC",
        help="specs as velox bench takes them; a budget may be a share of each prompt "
        "(snapkv:budget=25%%); default: fp16, mlx-q8, mlx-q4 and every installed method at "
        "the --points operating points",
    )
    e.add_argument(
        "--points",
        nargs="+",
        default=["4x", "8x"],
        help="operating points of the default specs: 4x, 8x, 16x (default: 4x 8x)",
    )
    e.add_argument(
        "--tasks",
        nargs="+",
        default=["passkey", "multikey", "multivalue", "multiquery", "vartrack", "cwe"],
        help="tasks, with parameters as name:key=value (multikey:keys=8); default: all six",
    )
    e.add_argument(
        "--lengths", nargs="+", type=int, default=[4096], help="prompt tokens (default 4096)"
    )
    e.add_argument("--prompts", type=int, default=8, help="prompts per task and length (default 8)")
    e.add_argument(
        "--question",
        choices=("after", "inside"),
        default="after",
        help="after: the question comes after the compressed context (kvpress's protocol, "
        "the default); inside: context and question are compressed together (query-aware)",
    )
    e.add_argument(
        "--haystack",
        choices=("prose", "code", "noise"),
        default="prose",
        help="the filler text the needles hide in (default prose)",
    )
    e.add_argument(
        "--template",
        choices=("raw", "chat"),
        default="raw",
        help="raw: the prompt as plain text (default); chat: the user turn of the model's chat "
        "template, the answer prefix starting the assistant's turn",
    )
    e.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    e.add_argument(
        "--cut",
        choices=("once", "chunks"),
        default="once",
        help="when retention policies cut the compressed context (the whole prompt with "
        "--question inside): once, at its end (the default: kvpress's and the papers' "
        "protocol), or each prefill chunk as the next arrives (mlx-lm's chunked prefill)",
    )
    e.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts' needles and fillers (default 0)"
    )
    e.add_argument(
        "--jobs", type=int, default=0, help="worker processes (0: one per CPU core on a CPU)"
    )
    e.add_argument(
        "--split",
        choices=["auto", "prompts", "specs"],
        default="auto",
        help="how --jobs share the work: prompts (each worker runs every spec on its prompts), "
        "specs (each worker a share of the specs on every prompt: a GPU compiles each "
        "method's kernels once); auto (the default): prompts on a CPU, specs on a GPU",
    )
    _outputs(e, "write cells and trials", "velox-eval.png")
    e.add_argument(
        "--from-json",
        metavar="PATH",
        help="report an earlier run's JSON (table, markdown, chart) instead of running; a "
        "run stopped midway left its trials in PATH.trials.jsonl, which this reads too",
    )
    g = sub.add_parser("generate", help="mlx_lm.generate with a velox cache")
    g.add_argument(
        "--method",
        default="uniform:bits=4",
        metavar="SPEC",
        help="the cache: a method spec (velox methods lists them) or a baseline fp16, "
        "mlx-q4, mlx-q8 (default uniform:bits=4)",
    )
    g.add_argument(
        "--model",
        help="mlx-lm directory, .gguf file or name (smollm2); default: the reference model",
    )
    g.add_argument(
        "--prompt",
        default="import os\n\n\ndef ",
        help="the text to continue (default: the start of a Python file, which the reference "
        "model was trained on)",
    )
    g.add_argument(
        "--max-tokens", type=int, default=100, help="tokens to generate at most (default 100)"
    )
    g.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    g.add_argument(
        "--save-cache",
        metavar="PATH",
        help="write the caches after generating to PATH (.safetensors; velox inspect PATH "
        "summarizes it, velox_core.load_cache(PATH) reads it back; default: not saved)",
    )
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch, split the model into pipeline stages (default: by heads)",
    )
    m = sub.add_parser("methods", help="installed methods, their parameters and defaults")
    m.add_argument("--json", action="store_true", help="print them as JSON (default: a table)")
    i = sub.add_parser(
        "inspect",
        help="a cache file (velox generate --save-cache, velox_core.save_cache): method, "
        "layers, tokens, bytes",
        description="Summarize a cache file written by velox generate --save-cache or "
        "velox_core.save_cache(path, caches): the method, offset, tokens and bytes of every "
        "layer. The file is loaded and checked first; one that save_cache did not write is "
        "refused.",
    )
    i.add_argument(
        "file", help="a .safetensors file (velox generate --save-cache, velox_core.save_cache)"
    )
    s = sub.add_parser(
        "serve",
        help="mlx_lm.server with velox caches (OpenAI API, batching, prompt cache); "
        "other options go to mlx_lm.server",
        epilog="Every other option goes to mlx_lm.server as it is (python -m mlx_lm.server "
        "--help lists them: --prompt-cache-bytes, --draft-model, --chat-template...).",
    )
    s.add_argument(
        "--method",
        required=True,
        metavar="SPEC",
        help="the cache of every request: a method spec (velox methods lists them)",
    )
    s.add_argument(
        "--model",
        help="an mlx-lm directory, a .gguf file, a name (smollm2, gemma3) or a Hugging Face "
        "repo id; loaded before the server listens (default: none, each request names its "
        "model, as mlx_lm.server does)",
    )
    s.add_argument("--host", help="the address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="the port to listen on (default 8080)")
    s.add_argument(
        "--storage-dtype",
        choices=("float16", "bfloat16", "float32"),
        help="the dtype the caches store unquantized tokens and scales in (default: the model's)",
    )
    f = sub.add_parser(  # no -h of its own: `velox fit NAME --help` is the method's help
        "fit",
        add_help=False,
        help="fit a method's per-model artifact (velox fit commvq --model PATH ...); the "
        "options are the method's own",
    )
    f.add_argument("name", help="the method whose fitter to run")
    sub.add_parser(  # its options are velox-transfer's own (`velox transfer fit --help`)
        "transfer",
        add_help=False,
        help="cross-model KV transfer (velox-transfer): fit a mapper, apply it, evaluate it",
    )
    from .allocate import add_parser as add_allocate_parser
    from .plan import add_parser as add_plan_parser

    add_plan_parser(sub)
    add_allocate_parser(sub)
    return p
