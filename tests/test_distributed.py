"""velox caches under mlx-lm's distributed inference (``mlx.launch``, ring backend, two
and four processes on this machine) and the compressed prefill-to-decode hand-off (issue 54).

Each distributed check runs a worker script under ``mlx.launch --backend ring -n N`` with a
timeout (a hung rank fails the test, never blocks it) and compares what each rank prints with
the same script run in one process. ``mlx.launch`` exits 0 even when a rank fails, so every
rank's JSON line is required.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from velox_core import make_cache
from velox_testing import tiny_model

TIMEOUT = 300  # a hung rank fails the test; a loaded 2-core machine runs four ranks slowly

WORKER = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache
    from velox_core import make_cache, recv_cache, routed, send_cache
    from velox_testing import tiny_model

    where, plan = sys.argv[1], json.loads(sys.argv[2])  # where: "single" or "launch"
    g = mx.distributed.init()
    rank = g.rank()

    def say(**kw):
        print(json.dumps({"rank": rank, **kw}), flush=True)

    def model_of(family, split, dtype=mx.float32):
        if family == "llama":
            m = tiny_model("llama", head_dim=64, num_attention_heads=8, num_key_value_heads=4,
                           dtype=dtype)
        else:  # "qwen2": 4 layers (two stages of 2), "qwen2-8": 8 (four stages of 2)
            layers = 8 if family == "qwen2-8" else 4
            m = tiny_model("qwen2", num_hidden_layers=layers, dtype=dtype)
        if split == "shard":
            m.shard(g)
        elif split == "pipe":
            m.model.pipeline(g)
        mx.eval(m.parameters())
        return m

    prompt = mx.random.randint(0, 512, (128,), key=mx.random.key(1))

    def decode(model, caches, prompt, n=8):
        with routed(model):
            return [int(t) for t, _ in generate_step(prompt, model, prompt_cache=caches,
                                                     max_tokens=n)]

    def caches_for(model, spec, split, phase=""):
        if spec == "fp16":
            return [KVCache() for _ in model.layers]
        layers = None
        if spec.startswith("last/"):  # a velox spec asked for the stage's last layer too
            spec = spec.split("/", 1)[1]
            layers = {-1: spec}
        elif phase.startswith("pipe") and split is None:
            # one process: the layers that end a stage (stages of two layers) fp16, as
            # make_cache keeps them on the stages
            layers = {i: None for i in range(1, len(model.layers), 2)}
        if "+" in spec:  # a composition A+B, as velox's CLI builds it
            from velox_cli.specs import compose
            text, spec = spec, lambda i: compose(text)
        return make_cache(model, spec, layers=layers, storage_dtype=mx.float16)

    for phase, family, specs, refused in plan:
        if phase == "handoff":
            # rank 0 prefills and sends; every other rank receives, passes the cache on to the
            # next rank (the ring backend sends only between neighbours) and decodes
            if where == "single":
                continue
            model = model_of(family, None, mx.float16)  # fp16 tokens in mlx-lm's KVCache
            for spec in specs:
                if rank == 0:
                    caches = caches_for(model, spec, None)
                    with routed(model):
                        logits = model(prompt[None, :-1], cache=caches)
                    mx.eval(logits, [c.state for c in caches])
                    nbytes = sum(c.nbytes for c in caches)  # as held when sent
                    stored = sum(  # the arrays a cache holds (fp16: its tokens, not capacity)
                        sum(a.nbytes for a in c.state[1:]) if hasattr(c, "method")
                        else 2 * c.keys[..., : c.offset, :].nbytes
                        for c in caches
                    )
                    sent = send_cache(caches, 1, group=g)
                    say(phase=phase, spec=spec, tokens=decode(model, caches, prompt[-1:]),
                        payload=sent.payload, header=sent.header, stored=stored, nbytes=nbytes)
                else:
                    caches = recv_cache(rank - 1, group=g, model=model)
                    if rank + 1 < g.size():
                        send_cache(caches, rank + 1, group=g)
                    say(phase=phase, spec=spec, tokens=decode(model, caches, prompt[-1:]),
                        kinds=[type(c).__name__ for c in caches])
            continue
        split = phase.rstrip("4") if where == "launch" else None  # "pipe4": 4 stages
        model = model_of(family, split)
        for spec in specs + (refused if split else []):
            try:
                caches = caches_for(model, spec, split, phase)
            except ValueError as e:
                say(phase=phase, spec=spec, error=str(e))
                continue
            toks = decode(model, caches, prompt)
            say(phase=phase, spec=spec, tokens=toks, nbytes=sum(c.nbytes for c in caches),
                kinds=[type(c).__name__ for c in caches])
    """
)


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free local ports: ``mlx.launch`` gives rank ``i`` the
    port ``--starting-port + i`` (default 32323), so two launches at once (pytest-xdist's
    workers) would otherwise meet on the same ports."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def _launcher(n: int = 2) -> list[str]:
    exe = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("mlx.launch is not installed")
    return [exe, "--backend", "ring", "-n", str(n), "--starting-port", str(_free_ports(n))]


def _run(folder: Path, where: str, plan: list, n: int = 2) -> tuple[list[dict], str]:
    """The worker's JSON lines (every rank's) and its whole output, run in one process
    (``single``) or on ``n`` (``launch``)."""
    script = folder / "worker.py"
    script.write_text(WORKER)
    launch = _launcher(n) if where == "launch" else []
    cmd = [*launch, sys.executable, str(script), where, json.dumps(plan)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=folder)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{where} ran past {TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    out = f"{p.stdout}\n{p.stderr}"
    if p.returncode:
        pytest.fail(f"{where} exited {p.returncode}:\n{out}")
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")], out


SHARDED = [
    "uniform:bits=4",
    "snapkv:budget=48",
    "h2o:budget=48",
    "streamingllm:budget=48,bits=4",
    "minicache:t=0.5,gamma=0,start_layer=0",  # cross-layer: layers 0 and 1 merged
    "snapkv:budget=48+uniform:bits=4",  # a composition: SnapKV's tokens in 4-bit codes
    "kvarn:key_bits=4,value_bits=2,sinks=16,group=32",
    "gear:bits=4,group=32",
    "curdkv:budget=48",
    "polarquant",
    "xquant:bits=2,window=16",  # cross-layer: layer 1 reads layer 0's codes
    "nsnquant:bits=2,group=32",
    "morphkv:budget=48",
    "squeeze:budget=48",
    "rocketkv:budget=48",
]
SHARD_REFUSED = {
    "xkv:layer_group=2,key_rank=64,value_rank=64": "SVD of the channels of all KV heads",
    "adakv:budget=48": "shared among all the layer's KV heads",
    "kvzip:budget=48": "shared among the KV heads of every layer",
    "minicache:t=0.5,gamma=0.05": "range of angular distances over all the heads",
    "polarquant:codebook=online": "online codebooks are fitted on the angles of all",
    "adakv:budget=48+uniform:bits=4": "shared among all the layer's KV heads",  # A's reason
}
# on the stages make_cache keeps each stage's last layer fp16 (one process: given None)
PIPED = ["uniform:bits=4", "snapkv:budget=48", "snapkv:budget=48+uniform:bits=4"]
PIPE_REFUSED = {
    "last/uniform:bits=4": "cache.keys",  # a velox spec asked for the stage's last layer
    "pyramidkv:budget=48": "linked across the model's layers",
    "squeeze:budget=48": "decided together from every layer's importance",
}
HANDOFF = ["uniform:bits=4", "streamingllm:budget=48,bits=4", "snapkv:budget=48", "fp16"]
PLAN = [
    ["shard", "llama", SHARDED, list(SHARD_REFUSED)],
    ["pipe", "qwen2", PIPED, list(PIPE_REFUSED)],
    ["handoff", "llama", HANDOFF, []],
]
# four processes: the tiny llama's 4 KV heads one per rank; a qwen2 of 8 layers in 4 stages
SHARDED4 = ["uniform:bits=4", "snapkv:budget=48", "streamingllm:budget=48,bits=4"]
PLAN4 = [
    ["shard", "llama", SHARDED4, []],
    ["pipe4", "qwen2-8", PIPED, []],
    ["handoff", "llama", ["uniform:bits=4", "snapkv:budget=48"], []],  # to ranks 1, 2 and 3
]


class _Runs(dict):
    """``{"single" | "launch" | "launch4": ({(phase, spec): {rank: row}}, output)}``: each
    plan run once, when a test first asks for it: in one process, on two and on four (one
    launch each: starting ranks is most of the time)."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory
        self.plans = {"single": (PLAN + PLAN4[1:], 1), "launch": (PLAN, 2), "launch4": (PLAN4, 4)}

    def __missing__(self, where: str):
        plan, n = self.plans[where]
        rows, text = _run(self.factory.mktemp(where), where[:6], plan, n)
        got: dict = {}
        for r in rows:
            got.setdefault((r["phase"], r["spec"]), {})[r["rank"]] = r
        self[where] = (got, text)
        return self[where]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory)


# four processes, and velox generate / serve launched, run in ``nox -s distributed`` (the
# two-process plan stays in the default suite)
PROCESSES = pytest.mark.processes


def _rows(runs, where: str, phase: str, spec: str, ranks: int) -> dict[int, dict]:
    got, text = runs[where]
    r = got.get((phase, spec), {})
    assert sorted(r) == list(range(ranks)), f"{phase} {spec}: ranks {sorted(r)} reported\n{text}"
    return r


def test_ring_all_sum(tmp_path):
    """mx.distributed runs here: two processes on the ring backend sum their ranks."""
    script = tmp_path / "hello.py"
    script.write_text(
        "import mlx.core as mx\n"
        "g = mx.distributed.init(strict=True)\n"
        "x = mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g)\n"
        "print(f'{g.rank()} {g.size()} {x.item()}', flush=True)\n"
    )
    p = subprocess.run(
        [*_launcher(), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert sorted(p.stdout.split("\n")[:-1]) == ["0 2 3.0", "1 2 3.0"], p.stdout + p.stderr


@pytest.mark.parametrize(
    "where, n, spec",
    [("launch", 2, s) for s in SHARDED]
    + [pytest.param("launch4", 4, s, marks=PROCESSES) for s in SHARDED4],
)
def test_sharded_tokens_and_bytes(runs, where, n, spec):
    """On a model sharded by heads over two processes (``model.shard``; four for
    :data:`SHARDED4`, one KV head each), each rank's cache decodes the tokens of one process
    with the same cache and holds ``1/n`` of its bytes (5%)."""
    one = _rows(runs, "single", "shard", spec, 1)[0]
    for rank, r in _rows(runs, where, "shard", spec, n).items():
        assert "error" not in r, r
        assert r["tokens"] == one["tokens"], (rank, r["tokens"], one["tokens"])
        assert abs(r["nbytes"] / (one["nbytes"] / n) - 1) <= 0.05, (r, one)


@pytest.mark.parametrize(
    "where, phase, n, spec",
    [("launch", "pipe", 2, s) for s in PIPED]
    + [pytest.param("launch4", "pipe4", 4, s, marks=PROCESSES) for s in PIPED],
)
def test_pipeline_tokens(runs, where, phase, n, spec):
    """mlx-lm's pipeline (qwen2: 4 layers in two stages; 8 in four): make_cache keeps each
    stage's last layer fp16 and velox caches elsewhere, which decode the tokens of one
    process with the same caches."""
    one = _rows(runs, "single", phase, spec, 1)[0]
    for r in _rows(runs, where, phase, spec, n).values():
        assert r.get("tokens") == one["tokens"], (r, one)
        *first, last = r["kinds"]
        assert last == "KVCache" and "KVCache" not in first, r["kinds"]


# a phase's refusal: what every refusal there says, and each method's own reason
REFUSALS = {
    "shard": ("cannot run on a model sharded by heads", SHARD_REFUSED),
    "pipe": ("split into pipeline stages", PIPE_REFUSED),
}


@pytest.mark.parametrize(
    "phase, spec", [(phase, s) for phase, (_, specs) in REFUSALS.items() for s in specs]
)
def test_refusals(runs, phase, spec):
    """Refused at make_cache on every rank, with the method's reason: on a model sharded by
    heads, the methods that mix a layer's heads; in a pipeline, a velox cache on a stage's
    last layer and the methods linking layers."""
    says, reasons = REFUSALS[phase]
    for r in _rows(runs, "launch", phase, spec, 2).values():
        assert says in r.get("error", ""), r
        assert reasons[spec] in r["error"], r


@pytest.mark.parametrize(
    "where, n, spec",
    [("launch", 2, s) for s in HANDOFF]
    + [
        pytest.param("launch4", 4, s, marks=PROCESSES)
        for s in ("uniform:bits=4", "snapkv:budget=48")
    ],
)
def test_handoff(runs, where, n, spec):
    """A prefilled cache sent as its stored arrays (by rank 0 to rank 1, which passes it on
    to rank 2, and so on: one receiver on two processes, three on four, as the ring backend
    sends only between neighbours) is rebuilt on every receiver, which decodes
    the tokens the sender decodes from its own cache; the payload is the arrays the cache
    holds (no more than its resident bytes), the header small."""
    rows = _rows(runs, where, "handoff", spec, n)
    sender = rows[0]
    assert sender["payload"] == sender["stored"], sender
    assert sender["payload"] <= sender["nbytes"], sender
    assert sender["header"] < 8192, sender
    for rank in range(1, n):
        receiver = rows[rank]
        assert receiver["tokens"] == sender["tokens"], (rank, sender, receiver)
        kinds = set(receiver["kinds"])
        assert kinds == {"KVCache"} if spec == "fp16" else "KVCache" not in kinds, receiver


def test_handoff_bytes_against_fp16(runs):
    """4-bit codes move under 0.3x the bytes of the fp16 cache of the same prompt."""
    fp16 = _rows(runs, "launch", "handoff", "fp16", 2)[0]["payload"]
    q4 = _rows(runs, "launch", "handoff", "uniform:bits=4", 2)[0]["payload"]
    assert q4 <= 0.3 * fp16, (q4, fp16)


def test_refusal_needs_no_group():
    """The refusal reads the heads the layers store against the config: a tiny llama cut by
    hand to half its heads (what one of two processes holds after ``model.shard``) is
    treated as sharded, in one process and without a group."""
    model = tiny_model("llama", head_dim=64, num_attention_heads=8, num_key_value_heads=4)
    make_cache(model, "adakv:budget=64")  # not sharded: accepted
    for layer in model.layers:
        attn = layer.self_attn
        attn.n_heads //= 2
        attn.n_kv_heads //= 2
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(attn, name)
            lin.weight = lin.weight[: lin.weight.shape[0] // 2]
        attn.o_proj.weight = attn.o_proj.weight[:, : attn.o_proj.weight.shape[1] // 2]
    model.__velox_routes__ = None
    with pytest.raises(ValueError, match="2 of the model's 4 KV heads here"):
        make_cache(model, "adakv:budget=64")
    with pytest.raises(ValueError, match="tova cannot run"):
        make_cache(model, "tova:budget=64")
    caches = make_cache(model, "nestedkv:budget=64,heads=uniform")
    assert len(caches) == len(model.layers)
    assert mx.distributed.init().size() == 1


def test_each_class_states_its_split_refusal_by_attribute():
    """A cache class answers ``split_refusal`` from its attributes: ``mixes_heads`` refuses a
    split by heads only, ``fitted_on_whole_model`` any split; every installed method's
    answer is a string, and an override (depending on the settings) still wins."""
    from velox_core import VeloxCache, get_method, methods
    from velox_core.cache.velox import FITTED_ON_WHOLE_MODEL

    def cache_class(name):
        return get_method(name).cache_class

    class Mixing(VeloxCache):
        mixes_heads = "it mixes heads"

    class Fitted(VeloxCache):
        fitted_on_whole_model = True

    assert VeloxCache.split_refusal({}, True, True) == ""
    assert Mixing.split_refusal({}, True, False) == "it mixes heads"
    assert Mixing.split_refusal({}, False, True) == ""
    assert Fitted.split_refusal({}, False, True) == FITTED_ON_WHOLE_MODEL
    for name in methods():
        cls = cache_class(name)
        for by_heads in (True, False):
            assert isinstance(cls.split_refusal({}, by_heads, not by_heads), str), name
    assert cache_class("qfilters").split_refusal({}, False, True) == FITTED_ON_WHOLE_MODEL
    assert cache_class("tova").split_refusal({}, False, True) == ""
    assert "heads" in cache_class("tova").split_refusal({}, True, False)
    assert cache_class("nestedkv").split_refusal({"heads": "uniform"}, True, False) == ""
    kvzip = cache_class("kvzip").split_refusal  # by its settings: how budgets are shared
    assert "every layer" in kvzip({"heads": "global"}, True, False)
    assert "stages" in kvzip({}, False, True)
    assert kvzip({"heads": "uniform"}, True, True) == ""


# -- velox generate and velox serve on a model split over processes ---------------------------
GENERATE_PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return"


def _generate(folder: Path, model: str, spec: str, n: int = 1, *extra: str) -> str:
    """``velox generate``'s output, in one process (``n=1``) or under ``mlx.launch``."""
    launch = _launcher(n) if n > 1 else []
    cmd = [*launch, sys.executable, "-m", "velox_cli", "generate", "--model", model]
    cmd += ["--method", spec, "--max-tokens", "12", "--prompt", GENERATE_PROMPT, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=folder)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _text_and_reports(out: str) -> tuple[str, list[str]]:
    """The generated text (every line but velox's reports) and the report lines."""
    lines = out.splitlines()
    reports = [x for x in lines if x.startswith("[velox] ")]
    return "\n".join(x for x in lines if not x.startswith("[velox] ")).strip(), reports


def _qwen2_dir(folder: Path) -> str:
    """A tiny qwen2 saved as mlx-lm saves models (weights, their index, config) with the
    reference model's tokenizer: a model mlx-lm can load into pipeline stages."""
    from mlx_lm.utils import save_config, save_model

    from velox_testing.models import tiny_config

    ref = Path(__file__).resolve().parents[1] / "shared" / "reference-model"
    cfg = tiny_config("qwen2", num_hidden_layers=4, vocab_size=8192)
    model = tiny_model("qwen2", num_hidden_layers=4, vocab_size=8192)
    out = folder / "qwen2"
    save_model(out, model)
    save_config(cfg, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ref / name, out / name)
    return str(out)


def _one_process_text(model_dir: str, spec: str, fp16_layers: dict) -> str:
    """The text velox generate prints for ``spec`` on one process with ``fp16_layers`` kept
    as mlx-lm's cache (as the CLI runs on a CPU: float32 compute, float16 storage)."""
    import mlx_lm

    import velox_core

    model, tokenizer = mlx_lm.load(model_dir)
    model.set_dtype(mx.float32)
    caches = make_cache(model, spec, layers=fp16_layers, storage_dtype=mx.float16)
    return velox_core.generate(model, tokenizer, GENERATE_PROMPT, cache=caches, max_tokens=12)


@PROCESSES
@pytest.mark.parametrize("how", ["heads", "pipeline"])
def test_velox_generate_split_over_processes(tmp_path, how):
    """``velox generate`` under ``mlx.launch`` loads the model split over two processes, as
    mlx-lm's server does: by heads (the reference model's 2 KV heads, one per process), or
    into pipeline stages with ``--pipeline`` (a tiny qwen2, two stages of two layers, each
    stage's last layer fp16). It prints the one-process text once, and each process its cache
    line."""
    spec = "uniform:bits=4"
    if how == "heads":
        model = str(Path(__file__).resolve().parents[1] / "shared" / "reference-model")
        want, _ = _text_and_reports(_generate(tmp_path, model, spec))
        extra: tuple = ()
    else:
        model = _qwen2_dir(tmp_path)
        want = _one_process_text(model, spec, {1: None, 3: None}).strip()
        extra = ("--pipeline",)
    got, reports = _text_and_reports(_generate(tmp_path, model, spec, 2, *extra))
    assert want and got == want, (got, want)
    # each process's cache line (velox generate's other notes, such as the tokens still
    # waiting in fp16, are printed beside them)
    heads = sorted(r.split(": its share")[0] for r in reports if ": its share" in r)
    assert heads == [f"[velox] {spec} (process {r} of 2" for r in (0, 1)], reports


def test_velox_generate_pipeline_needs_processes(tmp_path):
    """``--pipeline`` in one process is refused with the reason (exit 2)."""
    model = str(Path(__file__).resolve().parents[1] / "shared" / "reference-model")
    cmd = [sys.executable, "-m", "velox_cli", "generate", "--model", model, "--pipeline"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert p.returncode == 2 and "mlx.launch" in p.stderr, p.stderr


@PROCESSES
def test_velox_serve_split_by_heads():
    """``velox serve`` under ``mlx.launch``: mlx-lm's server loads the model split by heads
    over two processes (the first listens) and, with velox caches, answers a completion with
    the one-process greedy text."""
    import mlx_lm
    from serving import free_port, request, start, stop

    import velox_core

    spec, prompt = "uniform:bits=4", GENERATE_PROMPT
    model = str(Path(__file__).resolve().parents[1] / "shared" / "reference-model")
    port = free_port()
    cmd = [*_launcher(2), sys.executable, "-m", "velox_cli", "serve", "--method", spec]
    proc = start([*cmd, "--model", model, "--port", str(port), "--max-tokens", "8"], port)
    try:
        status, body = request(port, "/v1/completions", {"prompt": prompt, "temperature": 0})
        info = request(port, "/v1/velox")[1]
    finally:
        out = stop(proc)  # mlx.launch; its ranks outlive it, each stopped by its port
        subprocess.run(["pkill", "-f", f"velox_cli serve .*--port {port} "], check=False)
    assert status == 200, (body, out)
    m, tok = mlx_lm.load(model)
    want = velox_core.generate(m, tok, prompt, cache=spec, max_tokens=8)
    assert body["choices"][0]["text"] == want, (body, want, out)
    assert info["method"] == spec and info["prompt_cache"]["resident_bytes"] > 0, info
