"""The ``velox`` command.

    velox bench [--model PATH] [--methods SPEC ...] [--context N] [--data FILE] [--quick]
                [--jobs N] [--json PATH] [--transfer-mapper DIR --transfer-source MODEL]
    velox eval [--model M] [--methods SPEC ...] [--tasks T ...] [--lengths N ...] [--prompts N]
               [--question after|inside] [--json PATH] [--chart PNG]  (the long-context suite)
    velox generate --method SPEC [--model PATH] [--prompt TEXT] [--max-tokens N] [--pipeline]
                   [--save-cache FILE]
                   (under mlx.launch: the model split over the processes)
    velox methods [--json]
    velox inspect FILE
    velox serve --method SPEC --model PATH [--storage-dtype D] [mlx_lm.server options]
    velox fit NAME [the method's fit options]
    velox transfer fit|apply|eval [options]  (velox-transfer: map one model's cache to another's)
    velox plan --shape S|--model M --memory 24GB --context 128k [--batch N] [--json]  (what fits)
    velox allocate [--model M] --budget 3bits|BYTES|SPEC [--specs SPEC ...] [--json PATH]
                   (one spec per layer from measured sensitivity; bench and eval take PATH)

Bad input (an unknown method, a bad parameter, a missing path) prints one line and exits 2.
The options of each command are in :mod:`velox_cli.args`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from .args import _parser

__all__ = ["main"]


@contextlib.contextmanager
def _progress(console: Any, counted: str, **options: Any) -> Iterator[Any]:
    """A rich progress bar (the task's description, the bar, ``counted``, the time taken;
    ``options``: more of ``Progress``'s) over a run that SIGTERM stops as Ctrl-C does
    (``KeyboardInterrupt``). Once it is stopped, a second SIGINT or SIGTERM must not interrupt
    the exit (both ignored from then on); the SIGTERM handler is put back after the run.
    Outside the main thread (``main()`` called by a program) signals stay the program's own."""
    import signal

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    def terminate(signum, frame):
        raise KeyboardInterrupt

    try:
        on_term = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread
        on_term = None
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn(counted))
    try:
        with Progress(*columns, TimeElapsedColumn(), console=console, **options) as prog:
            yield prog
    except KeyboardInterrupt:
        if on_term is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            on_term = signal.SIG_IGN
        raise
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


def _positive(name: str, v: int) -> None:
    if v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v}")


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import DEPTHS, BenchSettings, auto_jobs, run_bench, write_json
    from .blas import active_blas
    from .chart import chart
    from .report import console as report_console
    from .report import markdown, print_report
    from .specs import default_specs, parse, quick_specs

    for name in ("context", "samples", "continuation", "recall_trials", "chunk"):
        _positive("--" + name.replace("_", "-"), getattr(a, name))
    if a.jobs < 0:
        raise ValueError(f"--jobs must be 0 (one per CPU core) or a positive count, got {a.jobs}")
    if (a.transfer_mapper is None) != (a.transfer_source is None):
        raise ValueError("--transfer-mapper and --transfer-source go together: give both")
    transfer = (a.transfer_mapper, a.transfer_source) if a.transfer_mapper else None
    if a.methods and a.all:
        raise ValueError("--methods and --all choose the specs two ways: give one")
    specs = (
        [parse(t) for t in a.methods]
        if a.methods
        else (default_specs() if a.all else quick_specs())
    )
    settings = BenchSettings(
        a.context, a.samples, a.continuation, a.recall_trials, a.chunk, a.quick, a.jobs
    )
    console = report_console()  # the terminal's width, COLUMNS, or 120 when not a terminal
    s = settings.resolved()
    what = (
        "as given"
        if a.methods
        else (
            "baselines + every installed method's recommended"
            if a.all
            else f"the quick subset; --all measures all {len(default_specs())}"
        )
    )
    recall = len(DEPTHS) * s.recall_trials
    jobs = min(s.jobs, len(specs)) if s.jobs else f"up to {auto_jobs(len(specs))}"
    console.print(  # what this run measures, before it starts
        f"velox bench: {len(specs)} specs ({what}) and the fp16 reference | context {s.context}"
        f" | {s.samples} sample{'s' * (s.samples != 1)} x {s.continuation} decode steps"
        f" | {recall} recall prompts"
        f" | chunk {s.chunk} | BLAS: {active_blas()} | {jobs} jobs",
        highlight=False,
    )
    done: list = []  # the rows finished so far, rewritten to --json as each one finishes

    def finished(rows: list, info: dict) -> None:
        done[:] = rows
        if a.json_path:
            write_json(a.json_path, rows, info)

    try:
        with _progress(console, "{task.completed}/{task.total}", transient=False) as prog:
            task = prog.add_task("loading", total=len(specs) + (transfer is not None))

            def tick(desc: str, n: int = 1) -> None:
                prog.update(task, description=desc, advance=n)

            def skipped(spec, reason: str) -> None:  # a method without its fitted file
                console.print(f"skipped {spec.text}: {reason}", highlight=False, markup=False)
                prog.update(task, total=prog.tasks[0].total - 1)

            rows, info = run_bench(
                specs, a.model, a.data, settings, tick, transfer, finished, skipped
            )
    except KeyboardInterrupt:
        kept = f"; {len(done)} finished rows are in {a.json_path}" if a.json_path else ""
        console.print(f"velox bench: interrupted after {len(done)} of {len(specs)} rows{kept}")
        return 130
    print_report(console, rows, info)  # the table, its notes, the best at about 4x and 8x
    if a.json_path:
        write_json(a.json_path, rows, info)
        console.print(f"rows written to {a.json_path}")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(rows) + "\n")
        console.print(f"markdown table written to {a.markdown}")
    if a.chart:
        chart(a.chart, rows, info)
        console.print(f"chart written to {os.path.abspath(a.chart)}", highlight=False)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from rich.console import Console

    from .longctx import report
    from .longctx.grid import default_specs
    from .longctx.run import EvalSettings, aggregate, finished_prompts, run_eval, spec_check

    console = Console(width=max(150, Console().width))
    if a.from_json:
        trials, info = report.load_json(a.from_json)
    else:
        if a.methods:
            texts = list(a.methods)
        else:
            from velox_core.kernels import backend

            from .bench import model_head_dim
            from .longctx.grid import CUDA_LEFT_OUT

            texts = default_specs(a.points, model_head_dim(a.model), backend())
            if backend() == "cuda":
                console.print(
                    f"velox eval: {' and '.join(CUDA_LEFT_OUT)} left out on CUDA (mlx-lm's "
                    "quantized attention does not finish a prefill chunk there in minutes); "
                    "--methods runs them",
                    highlight=False,
                )
        specs = [spec_check(t) for t in texts]
        if not any(s.text == "fp16" for s in specs):
            specs.insert(0, spec_check("fp16"))
        settings = EvalSettings(
            list(a.tasks),
            list(a.lengths),
            a.prompts,
            a.question,
            a.haystack,
            a.template,
            a.chunk,
            a.seed,
            a.jobs,
            a.split,
            a.cut,
        )
        tasks = settings.check()
        total = len(tasks) * len(settings.lengths) * settings.prompts
        console.print(
            f"velox eval: {len(specs)} specs x {len(tasks)} tasks x lengths "
            f"{', '.join(map(str, settings.lengths))} x {settings.prompts} prompts "
            f"({total} prompts, fp16 first on each) | question {settings.question}, cut "
            f"{settings.cut} | "
            f"haystack {settings.haystack}",
            highlight=False,
        )
        record = None
        if a.json_path:  # each prompt's trials as they come: a stopped run keeps them
            record = a.json_path + ".trials.jsonl"
            open(record, "w").close()
        done: list = []

        def finished(ts: list) -> None:
            done.extend(ts)
            if record is not None:
                report.append_trials(record, ts)

        try:
            with _progress(console, "{task.completed:.0f}/{task.total} prompts") as prog:
                bar = prog.add_task("loading", total=total)
                trials, info = run_eval(
                    specs,
                    a.model,
                    settings,
                    lambda desc, n=1: prog.update(bar, description=desc, advance=n),
                    finished,
                )
        except KeyboardInterrupt:
            n = finished_prompts(done, [s.text for s in specs])
            console.print(f"velox eval: interrupted after {n} of {total} prompts")
            if a.json_path and done:
                info = {"model": str(a.model), "partial": True, **vars(settings)}
                report.write_json(a.json_path, done, info)
                console.print(f"the finished prompts' cells and trials are in {a.json_path}")
            return 130
        if a.json_path:
            report.write_json(a.json_path, trials, info)
            console.print(f"cells and trials written to {a.json_path}")
    cells = aggregate(trials)
    console.print(report.table(cells, info))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(report.markdown(cells))
        console.print(f"markdown table written to {a.markdown}")
    if a.chart:
        report.chart(a.chart, cells, info)
        console.print(f"chart written to {os.path.abspath(a.chart)}", highlight=False)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import velox_core

    from .bench import load_model
    from .evaluate import after_prefill, held_bytes, prefill
    from .generate_notes import ratio_notes
    from .specs import Spec, build_caches, parse

    spec = parse(a.method)
    _positive("--max-tokens", a.max_tokens)
    if a.save_cache is not None and not a.save_cache.endswith(".safetensors"):
        raise ValueError(f"--save-cache must name a .safetensors file, got {a.save_cache!r}")
    if not 0 <= a.temp < float("inf"):
        raise ValueError(f"--temp must be 0 (greedy) or a finite number above, got {a.temp}")
    group = mx.distributed.init()  # under mlx.launch: the model split over the processes
    model, tokenizer, store, _ = load_model(a.model, group, a.pipeline)
    rank, ranks = group.rank(), group.size()
    mx.random.seed(a.seed)
    caches = build_caches(spec, model, store)
    tokens: list[int] = []
    prompt: str | list[int] = a.prompt
    # the prompt's ids as mlx-lm's stream_generate encodes a text prompt (special tokens
    # unless the text starts with the BOS token)
    bos = getattr(tokenizer, "bos_token", None)
    ids = tokenizer.encode(a.prompt, add_special_tokens=bos is None or not a.prompt.startswith(bos))
    with velox_core.routed(model):
        # a step after the prefill (KVzip's reconstruction): the prompt but its last token
        # is prefilled and the step taken here; generation starts from the last token
        step = any(hasattr(type(getattr(c, "policy", None)), "after_prefill") for c in caches)
        if step and len(ids) > 1:
            prefill(model, caches, ids[:-1])
            after_prefill(model, tokenizer, caches, ids[:-1])
            prompt = ids[-1:]
        for r in mlx_lm.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=a.max_tokens,
            prompt_cache=caches,
            sampler=make_sampler(temp=a.temp),
        ):
            if rank == 0:  # every process generates the same tokens; the first prints them
                print(r.text, end="", flush=True)
            tokens.append(r.token)
    if rank == 0:
        print()
    seen = caches[0].offset  # the prompt and the generated tokens the caches were fed
    held = sum(held_bytes(c) for c in caches)
    resident = sum(c.nbytes for c in caches)
    fp16 = build_caches(Spec("fp16", "fp16"), model, store)  # measured, on the same tokens
    prefill(model, fp16, (ids + tokens)[:seen])
    ref = sum(held_bytes(c) for c in fp16)
    where = f" (process {rank} of {ranks}: its share of the model)" if ranks > 1 else ""
    print(
        f"[velox] {spec.text}{where}: {seen} tokens, cache {held / 2**20:.2f} MiB held "
        f"({resident / 2**20:.2f} MiB resident with growth capacity); fp16 cache for the same "
        f"tokens {ref / 2**20:.2f} MiB held ({ref / held:.2f}x; held bytes: the rows of every "
        "array that hold tokens, each cache counted alike)"
    )
    for note in ratio_notes(caches, held, ref):
        print(f"[velox] {note}")
    if a.save_cache is not None and rank == 0:
        from .specs import plain_caches

        meta = {"spec": spec.text, "prompt": a.prompt}
        velox_core.save_cache(a.save_cache, plain_caches(caches), meta)
        print(f"[velox] caches written to {os.path.abspath(a.save_cache)} (velox inspect reads it)")
    return 0


def cmd_methods(a: argparse.Namespace) -> int:
    from velox_core import methods

    from .specs import describe_params

    out: list[dict[str, Any]] = []
    for name, m in methods().items():
        out.append(
            {
                "name": name,
                "summary": m.summary,
                "paper": m.paper,
                "cache_class": f"{m.cache_class.__module__}.{m.cache_class.__name__}",
                "parameters": describe_params(name),
                "recommended": list(m.recommended),
            }
        )
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    from .report import console, methods_table

    con = console()  # the terminal's width, COLUMNS, or 120 when not a terminal
    t, broken = methods_table(out, con.width)
    con.print(t)
    if broken:  # the specs the table broke over lines, whole, to copy
        con.print("recommended specs broken over lines above, whole:", highlight=False)
        for spec in broken:
            con.print("  " + spec, soft_wrap=True, highlight=False, markup=False)
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from velox_core import inspect_cache_file

    info = inspect_cache_file(a.file)
    t = Table(title=f"{a.file} (format version {info['version']})")
    for col in ("layer", "method", "offset", "tokens", "bytes"):
        t.add_column(col, justify="right" if col != "method" else "left")
    for r in info["layers"]:
        t.add_row(
            str(r["layer"]), str(r["method"]), str(r["offset"]), str(r["tokens"]), f"{r['bytes']:,}"
        )
    Console().print(t)
    print(f"total: {info['bytes']:,} bytes in {len(info['layers'])} layers")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from .serve import serve

    dtype = None
    if a.storage_dtype:
        import mlx.core as mx

        dtype = getattr(mx, a.storage_dtype)
    own = [  # velox serve's documented options, handed on to mlx_lm.server as given
        x
        for flag, v in (("--model", a.model), ("--host", a.host), ("--port", a.port))
        if v is not None
        for x in (flag, str(v))
    ]
    serve(a.method, [*own, *a.rest], storage_dtype=dtype)
    return 0


FIT_GROUP = "velox.fit"  # entry points: method name -> fit_main(argv) -> exit code


def cmd_fit(a: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    found = {e.name: e for e in entry_points(group=FIT_GROUP)}
    if a.name not in found:
        have = ", ".join(sorted(found)) or "none installed"
        raise ValueError(f"no fitter for {a.name!r} (methods with one: {have})")
    return int(found[a.name].load()(a.rest) or 0)


def cmd_plan(a: argparse.Namespace) -> int:
    from .plan import cmd_plan as run

    return run(a)


def cmd_allocate(a: argparse.Namespace) -> int:
    from .allocate import cmd_allocate as run

    return run(a)


def cmd_transfer(a: argparse.Namespace) -> int:
    try:
        from velox_transfer.__main__ import main as transfer_main
    except ImportError:
        raise ValueError(
            "velox transfer needs velox-transfer: pip install ./packages/velox-transfer"
        ) from None
    return int(transfer_main(a.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] in (
        ["bench"],
        ["eval"],
        ["generate"],
        ["serve"],
        ["transfer"],
        ["plan"],
        ["allocate"],
    ):
        from .blas import preload

        preload(sys.argv[1:])  # re-executes with OpenBLAS where MLX bundles a reference BLAS
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd not in ("serve", "fit", "transfer"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    handler = {
        "bench": cmd_bench,
        "eval": cmd_eval,
        "generate": cmd_generate,
        "methods": cmd_methods,
        "inspect": cmd_inspect,
        "serve": cmd_serve,
        "fit": cmd_fit,
        "transfer": cmd_transfer,
        "plan": cmd_plan,
        "allocate": cmd_allocate,
    }[args.cmd]
    try:
        return handler(args)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"velox: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
