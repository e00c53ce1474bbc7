"""velox caches under mlx-lm's distributed inference (``mlx.launch``, ring backend, two
and four processes on this machine) and the compressed prefill-to-decode hand-off (issue 54).

Each distributed check runs a worker script under ``mlx.launch --backend ring -n N`` with a
timeout (a hung rank fails the test, never blocks it) and compares what each rank prints with
the same script run in one process. ``mlx.launch`` exits 0 even when a rank fails, so every
rank's JSON line is required.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from velox_core import make_cache
from velox_testing import tiny_model

TIMEOUT = 120

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

    def caches_for(model, spec, split):
        if spec.startswith("lastfp16/"):  # every pipeline stage's last layer fp16
            spec = spec.split("/", 1)[1]
            if split == "pipe":
                return make_cache(model, spec, layers={-1: None}, storage_dtype=mx.float16)
            # the stages' last layers: stages of two layers each
            last = {i: None for i in range(1, len(model.layers), 2)}
            return make_cache(model, spec, layers=last, storage_dtype=mx.float16)
        if spec == "fp16":
            return [KVCache() for _ in model.layers]
        return make_cache(model, spec, storage_dtype=mx.float16)

    for phase, family, specs, refused in plan:
        if phase == "handoff":  # rank 0 prefills and sends; rank 1 receives and decodes
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
                    caches = recv_cache(0, group=g, model=model)
                    say(phase=phase, spec=spec, tokens=decode(model, caches, prompt[-1:]),
                        kinds=[type(c).__name__ for c in caches])
            continue
        split = phase.rstrip("4") if where == "launch" else None  # "pipe4": 4 stages
        model = model_of(family, split)
        for spec in specs + (refused if split else []):
            try:
                caches = caches_for(model, spec, split)
            except ValueError as e:
                say(phase=phase, spec=spec, error=str(e))
                continue
            toks = decode(model, caches, prompt)
            say(phase=phase, spec=spec, tokens=toks, nbytes=sum(c.nbytes for c in caches))
    """
)


def _launcher(n: int = 2) -> list[str]:
    exe = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("mlx.launch is not installed")
    return [exe, "--backend", "ring", "-n", str(n)]


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
]
SHARD_REFUSED = {
    "xkv:layer_group=2,key_rank=64,value_rank=64": "SVD of the channels of all KV heads",
    "adakv:budget=48": "shared among all the layer's KV heads",
    "kvzip:budget=48": "shared among the KV heads of every layer",
    "minicache:t=0.5,gamma=0.05": "range of angular distances over all the heads",
}
PIPED = ["lastfp16/uniform:bits=4", "lastfp16/snapkv:budget=48"]
PIPE_REFUSED = {
    "uniform:bits=4": "cache.keys",
    "lastfp16/pyramidkv:budget=48": "linked across the model's layers",
}
HANDOFF = ["uniform:bits=4", "streamingllm:budget=48,bits=4", "snapkv:budget=48", "fp16"]
PLAN = [
    ["shard", "llama", SHARDED, list(SHARD_REFUSED)],
    ["pipe", "qwen2", PIPED, list(PIPE_REFUSED)],
    ["handoff", "llama", HANDOFF, []],
]
# four processes: the tiny llama's 4 KV heads one per rank; a qwen2 of 8 layers in 4 stages
SHARDED4 = ["uniform:bits=4", "snapkv:budget=48", "streamingllm:budget=48,bits=4"]
PLAN4 = [["shard", "llama", SHARDED4, []], ["pipe4", "qwen2-8", PIPED, []]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """``{"single" | "launch" | "launch4": ({(phase, spec): {rank: row}}, output)}``: the
    plans run once in one process, once on two and once on four (one launch each: starting
    ranks is most of the time)."""
    out = {}
    for where, plan, n in (
        ("single", PLAN + PLAN4[1:], 1),
        ("launch", PLAN, 2),
        ("launch4", PLAN4, 4),
    ):
        rows, text = _run(tmp_path_factory.mktemp(where), where[:6], plan, n)
        got: dict = {}
        for r in rows:
            got.setdefault((r["phase"], r["spec"]), {})[r["rank"]] = r
        out[where] = (got, text)
    return out


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
    [("launch", 2, s) for s in SHARDED] + [("launch4", 4, s) for s in SHARDED4],
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


@pytest.mark.parametrize("spec", list(SHARD_REFUSED))
def test_sharded_refusals(runs, spec):
    """Methods that mix a layer's heads are refused at make_cache, on every rank."""
    for r in _rows(runs, "launch", "shard", spec, 2).values():
        assert "cannot run on a model sharded by heads" in r.get("error", ""), r
        assert SHARD_REFUSED[spec] in r["error"], r


@pytest.mark.parametrize(
    "where, phase, n, spec",
    [("launch", "pipe", 2, s) for s in PIPED] + [("launch4", "pipe4", 4, s) for s in PIPED],
)
def test_pipeline_tokens(runs, where, phase, n, spec):
    """mlx-lm's pipeline (qwen2: two stages of 4 layers; four of 8): velox caches with each
    stage's last layer fp16 decode the tokens of one process with the same caches."""
    one = _rows(runs, "single", phase, spec, 1)[0]
    for r in _rows(runs, where, phase, spec, n).values():
        assert r.get("tokens") == one["tokens"], (r, one)


@pytest.mark.parametrize("spec", list(PIPE_REFUSED))
def test_pipeline_refusals(runs, spec):
    """A velox cache on a stage's last layer, and a method linking layers, are refused."""
    for r in _rows(runs, "launch", "pipe", spec, 2).values():
        assert "split into pipeline stages" in r.get("error", ""), r
        assert PIPE_REFUSED[spec] in r["error"], r


@pytest.mark.parametrize("spec", HANDOFF)
def test_handoff(runs, spec):
    """A prefilled cache sent as its stored arrays is rebuilt on the receiver, which decodes
    the tokens the sender decodes from its own cache; the payload is the arrays the cache
    holds (no more than its resident bytes), the header small."""
    rows = _rows(runs, "launch", "handoff", spec, 2)
    sender, receiver = rows[0], rows[1]
    assert receiver["tokens"] == sender["tokens"], (sender, receiver)
    assert sender["payload"] == sender["stored"], sender
    assert sender["payload"] <= sender["nbytes"], sender
    assert sender["header"] < 8192, sender
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
    from velox_core import VeloxCache
    from velox_core.registry import get_method, methods
    from velox_core.split import FITTED_ON_WHOLE_MODEL

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
