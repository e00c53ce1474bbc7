"""Every fenced code block of README.md and docs/*.md that is meant to run, run as written.

Collected: each block fenced as ``python``, ``bash``, ``sh``, ``shell`` or ``console``, one test
case per block, named ``page:line`` (the line of its opening fence). Other fences (diagrams,
trees, formulas, output, untagged) are prose.

How a block runs, with only what a reader of the page has:

- The ``python`` blocks of one page are one session: they run in order in one fresh
  interpreter, each in the namespace the page's earlier blocks left (as a reader pastes them
  into one REPL), so a block may use the names that an earlier block of its page defined, and
  no others. A block fails with its own traceback (its line numbers are the page's); the later
  blocks of the page still run, in the namespace the failed one left.
- A shell block runs in a fresh ``bash`` with ``set -eo pipefail``: every command must exit 0.
  In a ``console`` block only the lines after a ``$ `` prompt (and their ``\\`` continuations)
  are commands; the other lines are the output shown.
- The working directory stands for the root of a fresh clone: a scratch folder holding a link
  to each top-level entry of the checkout, so that relative paths (``shared/reference-model``,
  ``benchmarks/...``) resolve while the files a block writes stay out of the tree. ``HOME`` is
  a scratch folder of this run (``~/.cache/velox`` starts empty), velox's location variables
  (``VELOX_ARTIFACTS``, ``VELOX_SHARED``, ``VELOX_CACHE_DIR``) and ``XDG_CACHE_HOME`` are
  unset, and the interpreter's ``bin`` folder comes first on ``PATH`` (``velox``, ``python``
  and ``mlx.launch`` are this environment's).

A block that is not meant to run carries an HTML comment, which a Markdown renderer does not
show, on the line before its fence:

    <!-- docs-test: skip (why it does not run here) -->
    <!-- docs-test: slow (why it takes a minute or more) -->

``skip`` reports the block as skipped, with the reason; ``slow`` runs it only where
``DOCS_BLOCKS_SLOW=1`` (``nox -s docs``), as a ``docs_slow`` test. A ``docs-test`` comment
that is not directly followed by a fence, or that says neither, fails
:func:`test_markers_are_well_formed`. The blocks of pages this test may not edit are skipped
through :data:`UNMARKED` instead.

The blocks of all selected cases start together when the first case asks for its result, as
many at once as the machine has cores (at most 4): a page's session is one job, a shell block
one job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
SLOW = os.environ.get("DOCS_BLOCKS_SLOW") == "1"
TIMEOUT = {"fast": 180, "slow": 1800}  # seconds for one block (a page: the sum of its blocks)
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
MARK_BODY = re.compile(r"^(?P<kind>skip|slow)\s*\((?P<reason>.+)\)$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
# Pages this test may not edit: (page, how the first line of a block's code starts, the marker
# it would carry: "skip" or "slow", why), for their blocks without a marker; an entry that
# matches no block fails test_unmarked_entries_match.
E2E = "docs/end-to-end.md"
GPU = "a GPU benchmark of a Llama-3.1-8B-shaped model: minutes"
UNMARKED = [
    (E2E, "python3 benchmarks/e2e.py", "skip", GPU),
    (E2E, "VELOX_CUDA_INCLUDE=0 python3 benchmarks/e2e.py", "skip", GPU),
    (E2E, "python3 benchmarks/batch_serve.py", "skip", GPU),
    (E2E, "python3 benchmarks/decode_steps.py", "skip", GPU),
    (E2E, "python3 benchmarks/serve_load.py", "skip", "a GPU server load test: minutes"),
    (E2E, "bash benchmarks/gpu_run.sh", "skip", "the GPU host's benchmark runs"),
]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    lang: str  # "python" or "shell"
    code: str
    first: str  # the first non-blank line of the block as the page shows it
    mark: str | None  # None, "skip" or "slow"
    reason: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def speed(self) -> str:
        return "slow" if self.mark == "slow" else "fast"

    def runs(self) -> bool:
        return self.mark is None or (self.mark == "slow" and SLOW)


def parse(rel: str, text: str) -> tuple[list[Block], list[str]]:
    """The code blocks of page ``rel`` (its ``text``) and its ill-formed ``docs-test`` markers
    (as messages)."""
    lines = text.split("\n")
    blocks, problems = [], []
    pending: tuple[int, str] | None = None  # a marker waiting for the fence on the next line
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        marker = MARKER.match(lines[i])
        if pending is not None and not m:
            problems.append(f"{rel}:{pending[0]}: a docs-test marker not followed by a fence")
            pending = None
        if marker:
            pending = (i + 1, marker["body"])
            i += 1
            continue
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence[0] * len(fence))
            and set(lines[end].strip()) == {fence[0]}
        ):
            end += 1
        body = lines[i + 1 : end]
        if indent:  # a fence indented in a list: its lines lose that indentation
            body = [ln[indent:] if ln[:indent].isspace() else ln.lstrip() for ln in body]
        words = m["info"].split()
        lang = words[0].lower() if words else ""
        mark, reason = None, ""
        if pending is not None:
            mb = MARK_BODY.match(pending[1])
            if mb is None:
                problems.append(
                    f"{rel}:{pending[0]}: a docs-test marker says {pending[1]!r}; "
                    "expected 'skip (reason)' or 'slow (reason)'"
                )
            else:
                mark, reason = mb["kind"], mb["reason"].strip()
            pending = None
        if lang in PYTHON | SHELL:
            code = "\n".join(body)
            first = next((ln for ln in body if ln.strip()), "")
            if mark is None:
                for page_, start, kind, why in UNMARKED:
                    if page_ == rel and first.startswith(start):
                        mark, reason = kind, why
            kind = "python" if lang in PYTHON else "shell"
            if lang == "console":
                code = console_commands(body)
            blocks.append(Block(rel, i + 1, kind, code, first, mark, reason))
        i = end + 1
    if pending is not None:
        problems.append(f"{rel}:{pending[0]}: a docs-test marker not followed by a fence")
    return blocks, problems


def console_commands(lines: list[str]) -> str:
    """The commands of a ``console`` block: lines after a ``$ `` prompt and their ``\\``
    continuations; every other line is output."""
    out, more = [], False
    for ln in lines:
        if more:
            out.append(ln)
        elif ln.startswith("$ "):
            out.append(ln[2:])
        else:
            continue
        more = ln.rstrip().endswith("\\")
    return "\n".join(out)


def collect() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for page in PAGES:
        b, p = parse(page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8"))
        blocks += b
        problems += p
    return blocks, problems


BLOCKS, PROBLEMS = collect()

# Runs one page's python blocks in one interpreter: argv[1] a JSON file of the blocks, argv[2]
# the JSON file of their results, rewritten after each block (a timeout keeps those finished).
DRIVER = textwrap.dedent(
    """
    import json, sys, time, traceback
    blocks = json.load(open(sys.argv[1]))
    results = {}
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for b in blocks:
        print(f"\\n----- {b['id']} -----", flush=True)
        print(f"\\n----- {b['id']} -----", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            # padded so that a traceback gives the line of the page
            code = compile("\\n" * b["line"] + b["code"], b["page"], "exec")
            exec(code, namespace)
            error = None
        except BaseException:
            kind, value, tb = sys.exc_info()  # the traceback from the block's own frame on
            error = "".join(traceback.format_exception(kind, value, tb.tb_next))
        sys.stdout.flush()
        sys.stderr.flush()
        results[b["id"]] = {"error": error, "seconds": time.perf_counter() - start}
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    """
)


@dataclass
class Outcome:
    error: str | None  # None: the block ran and succeeded
    seconds: float
    output: str  # what its process printed (a page session's: every block's)


def _clone(scratch: Path) -> Path:
    """A folder mirroring the repository root: a link to each top-level entry that a clone
    holds (not the build, cache and output folders)."""
    clone = scratch / "clone"
    clone.mkdir()
    ignored = {"out", "dist", "build", "__pycache__"}
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ignored:
            continue
        (clone / entry.name).symlink_to(entry)
    return clone


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("VELOX_ARTIFACTS", "VELOX_SHARED", "VELOX_CACHE_DIR", "XDG_CACHE_HOME"):
        env.pop(name, None)
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, bool]:
    """(exit status, combined output, timed out) of ``cmd``; its whole process group is killed
    on a timeout."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc, timed_out = p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc, timed_out = p.wait(), True
        out.seek(0)
        return rc, out.read(), timed_out


class Runner:
    """Runs the selected blocks, a page's python blocks as one session, in parallel."""

    def __init__(self, blocks: list[Block], scratch: Path):
        self.clone = _clone(scratch)
        home = scratch / "home"
        home.mkdir()
        self.env = _env(home)
        self.scratch = scratch
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
        self.futures: dict[str, Future] = {}
        pages: dict[str, list[Block]] = {}
        for b in blocks:
            if b.lang == "python":
                pages.setdefault(b.page, []).append(b)
            else:
                self.futures[b.id] = self.pool.submit(self._shell, b)
        for page, session in pages.items():
            f = self.pool.submit(self._session, page, session)
            for b in session:
                self.futures[b.id] = f

    def outcome(self, block: Block) -> Outcome:
        result = self.futures[block.id].result()
        return result[block.id] if block.lang == "python" else result

    def _shell(self, block: Block) -> Outcome:
        script = "set -eo pipefail\n" + block.code
        start = time.perf_counter()
        rc, output, timed_out = _run(
            ["bash", "-c", script], self.clone, self.env, TIMEOUT[block.speed]
        )
        seconds = time.perf_counter() - start
        error = None
        if timed_out:
            error = f"timed out after {TIMEOUT[block.speed]} s"
        elif rc != 0:
            error = f"exit status {rc}"
        return Outcome(error, seconds, output)

    def _session(self, page: str, session: list[Block]) -> dict[str, Outcome]:
        name = page.replace("/", "_")
        spec, results = self.scratch / f"{name}.json", self.scratch / f"{name}.results.json"
        rows = [{"id": b.id, "page": b.page, "line": b.line, "code": b.code} for b in session]
        spec.write_text(json.dumps(rows))
        timeout = sum(TIMEOUT[b.speed] for b in session)
        rc, output, timed_out = _run(
            [sys.executable, "-c", DRIVER, str(spec), str(results)], self.clone, self.env, timeout
        )
        done = json.loads(results.read_text()) if results.exists() else {}
        outcomes = {}
        for b in session:
            r = done.get(b.id)
            if r is not None:
                outcomes[b.id] = Outcome(r["error"], r["seconds"], output)
                continue
            why = f"timed out after {timeout} s" if timed_out else f"exit status {rc}"
            error = f"the page's session ended before this block ({why})"
            outcomes[b.id] = Outcome(error, 0.0, output)
        return outcomes


def _section(output: str, block: Block) -> str:
    """The part of a page session's output its driver printed while ``block`` ran."""
    head = f"----- {block.id} -----"
    if head not in output:
        return output
    parts = output.split(head)
    text = "".join(p.split("\n----- ", 1)[0] for p in parts[1:])
    return text.strip()


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    """A :class:`Runner` of the blocks the selected test cases run."""
    wanted = {
        item.callspec.params["block"].id
        for item in request.session.items
        if getattr(item, "callspec", None) is not None
        and isinstance(item.callspec.params.get("block"), Block)
    }
    blocks = [b for b in BLOCKS if b.id in wanted and b.runs()]
    r = Runner(blocks, tmp_path_factory.mktemp("docs-blocks"))
    yield r
    r.pool.shutdown(wait=False, cancel_futures=True)


def _param(block: Block):
    marks = [pytest.mark.docs_slow] if block.mark == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_runs(block: Block, runner: Runner):
    if block.mark == "skip":
        pytest.skip(f"{block.id}: {block.reason}")
    if block.mark == "slow" and not SLOW:
        pytest.skip(f"{block.id}: slow ({block.reason}); DOCS_BLOCKS_SLOW=1 runs it (nox -s docs)")
    got = runner.outcome(block)
    if got.error is not None:
        output = _section(got.output, block) if block.lang == "python" else got.output
        shown = f"\n--- its output (the last 4,000 characters) ---\n{output[-4000:]}"
        pytest.fail(
            f"{block.id} ({block.lang}) failed after {got.seconds:.1f} s: {got.error}"
            + (shown if output.strip() else ""),
            pytrace=False,
        )


def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_unmarked_entries_match():
    stale = [
        (page, start)
        for page, start, _, _ in UNMARKED
        if not any(b.page == page and b.first.startswith(start) for b in BLOCKS)
    ]
    assert not stale, f"UNMARKED entries that match no block (update or remove them): {stale}"


def test_blocks_are_found():
    """The collection itself: README's blocks are there, with python and shell ones."""
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert {b.lang for b in readme} == {"python", "shell"}
    assert len(BLOCKS) > 50


def test_parse_rules():
    """Markers, console prompts, indented fences and prose fences, on a page made up here."""
    page = textwrap.dedent(
        """\
        <!-- docs-test: skip (a reason) -->
        ```python
        x = 1
        ```

        ```console
        $ velox methods \\
            --help
        usage: velox methods
        $ echo hi
        hi
        ```

        1. a list item:

           ```bash
           echo indented
           ```

        <!-- docs-test: slow (a minute) -->
        ```sh
        sleep 60
        ```

        ```text
        not code
        ```

        <!-- docs-test: skip (stray) -->

        <!-- docs-test: later -->
        ```python
        y = 2
        ```
        """
    )
    blocks, problems = parse("page.md", page)
    assert [(b.line, b.lang, b.mark, b.reason) for b in blocks] == [
        (2, "python", "skip", "a reason"),
        (6, "shell", None, ""),
        (16, "shell", None, ""),
        (21, "shell", "slow", "a minute"),
        (32, "python", None, ""),
    ]
    assert blocks[1].code == "velox methods \\\n    --help\necho hi"
    assert blocks[2].code == "echo indented"
    assert problems == [
        "page.md:29: a docs-test marker not followed by a fence",
        "page.md:31: a docs-test marker says 'later'; expected 'skip (reason)' or 'slow (reason)'",
    ]
