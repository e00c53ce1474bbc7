"""Every installed method through mlx-lm end to end, and the compositions across packages."""

import importlib
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import velox_core
from velox_core import VeloxCache, load_cache, make_cache, methods, routed, save_cache
from velox_core.cache.eviction import EvictionCache
from velox_testing import recommended_specs, tiny_model, tiny_tokenizer

MODEL = tiny_model("llama", head_dim=128, hidden_size=256)
SPECS = recommended_specs()


def _installed(name: str):
    """The package ``name``, imported, or None where it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@pytest.fixture(scope="module", autouse=True)
def fitted_artifacts(tmp_path_factory):
    """Q-Filters, CommVQ, Palu, OSCAR and the spectral quantizer need artifacts fitted on the
    model; fit them once for the tiny model (CommVQ with a short EM: these tests check the
    plumbing, not its quality)."""
    out = tmp_path_factory.mktemp("artifacts")
    prompt = mx.random.randint(0, 512, (4, 256), key=mx.random.key(0))
    tokens = prompt.reshape(-1).tolist()
    if (qf := _installed("velox_qfilters")) is not None:
        qf.save_filters(qf.fit_filters(MODEL, prompt), out / "tiny.safetensors")
    if (cvq := _installed("velox_commvq")) is not None:
        books = cvq.fit_codebooks(MODEL, tokens, seq_len=256, samples=512, iters=4)
        cvq.save_codebooks(books, out / "tiny-commvq.safetensors")
    if (palu := _installed("velox_palu")) is not None:
        palu.save_bases(palu.fit_palu(MODEL, tokens, seq_len=256), out / "tiny-palu.safetensors")
    if (oscar := _installed("velox_oscar")) is not None:
        rot = oscar.fit_oscar(MODEL, tokens, seq_len=256, samples=256)
        oscar.save_rotations(rot, out / "tiny-oscar.safetensors")
    if (spectral := _installed("velox_spectral")) is not None:
        bases = spectral.fit_spectral(MODEL, tokens, seq_len=256)
        spectral.save_bases(bases, out / "tiny-spectral.safetensors")
    old = os.environ.get("VELOX_ARTIFACTS")
    os.environ["VELOX_ARTIFACTS"] = str(out)
    yield
    if old is None:
        os.environ.pop("VELOX_ARTIFACTS", None)
    else:
        os.environ["VELOX_ARTIFACTS"] = old


def test_every_package_registered():
    expected = {
        "uniform",
        "kivi",
        "kvsink",
        "kitty",
        "zipcache",
        "gear",
        "kvarn",
        "xquant",
        "nsnquant",
        "oscar",
        "spectral",
        "turboquant",
        "polarquant",
        "qjl",
        "skvq",
        "kvquant",
        "vecinfer",
        "agetiered",
        "streamingllm",
        "snapkv",
        "knorm",
        "curdkv",
        "tova",
        "h2o",
        "keyformer",
        "morphkv",
        "cam",
        "kvzip",
        "pyramidkv",
        "squeeze",
        "expected-attention",
        "chunkkv",
        "rocketkv",
        "qfilters",
        "nestedkv",
        "adakv",
        "rabitq",
        "commvq",
        "svdq",
        "xkv",
        "palu",
        "minicache",
        "anchorkv",
    }
    assert expected <= set(methods())


@pytest.mark.parametrize("spec", SPECS)
def test_recommended_settings_generate_save_and_load(spec, tmp_path):
    caches = make_cache(MODEL, spec)
    text = velox_core.generate(
        MODEL, tiny_tokenizer(), "def add(a, b):\n    return", cache=caches, max_tokens=6
    )
    assert isinstance(text, str)
    offsets = {c.offset for c in caches}
    assert len(offsets) == 1 and offsets.pop() > 6
    # a longer prefill in chunks, then save, load and compare the next step's logits
    prompt = mx.random.randint(0, 512, (1, 700), key=mx.random.key(1))
    caches = make_cache(MODEL, spec)
    with routed(MODEL):
        for s in range(0, 700, 256):
            MODEL(prompt[:, s : s + 256], cache=caches)
        path = tmp_path / "c.safetensors"
        save_cache(path, caches)
        loaded = load_cache(path)
        a = MODEL(mx.array([[7]]), cache=caches)
        b = MODEL(mx.array([[7]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-3).item()
    assert all(c.nbytes > 0 for c in caches if isinstance(c, VeloxCache))


def test_qfilters_over_turboquant_3bit_is_one_composed_cache():
    qf = pytest.importorskip("velox_qfilters")
    tq = pytest.importorskip("velox_turboquant")
    template = VeloxCache(
        key_codec=tq.TurboQuant(bits=3),
        value_codec=tq.TurboQuant(bits=3),
        policy=qf.QFiltersPolicy(budget=256),
        window=32,
    )
    caches = make_cache(MODEL, template)
    fp16 = [KVCache() for _ in MODEL.layers]
    prompt = mx.random.randint(0, 512, (1, 2048), key=mx.random.key(2))
    with routed(MODEL):
        for s in range(0, 2048, 512):
            MODEL(prompt[:, s : s + 512], cache=caches)
            MODEL(prompt[:, s : s + 512], cache=fp16)
        MODEL(mx.array([[3]]), cache=caches)
    assert all(c.size() <= 257 and c.offset == 2049 for c in caches)
    mx.eval([c.state for c in caches], [c.state for c in fp16])
    # 1/8 of the tokens at 3 bits: far below 1/7 of the fp16 cache
    assert sum(c.nbytes for c in caches) < sum(c.nbytes for c in fp16) / 7
    assert isinstance(caches[0].tiers[0].key_codec, tq.TurboQuant)


@pytest.mark.parametrize(
    "name", ["cachegen", "commvq", "kvtc", "oscar", "palu", "qfilters", "spectral"]
)
def test_every_fit_hint_names_one_command_form(name):
    """A method whose artifact is fitted names its fit the same way in every message (the
    form that works with the method's package alone installed)."""
    mod = importlib.import_module(f"velox_{name}.artifact")
    assert (
        f"python -m velox_{name} fit --model PATH --text CALIBRATION.txt --out FILE"
    ) == mod.HOW_TO_FIT
    assert importlib.util.find_spec(f"velox_{name}.__main__") is not None
    src = Path(importlib.import_module(f"velox_{name}").__file__).parent
    for f in src.glob("*.py"):
        assert "velox fit " not in f.read_text(), f  # not the velox-cli form in one of them


EVICTING = sorted(n for n, m in methods().items() if issubclass(m.cache_class, EvictionCache))


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("prefill", ["prompt", "chunks"])
def test_every_eviction_preset_cuts_a_chunked_prompt_as_its_prefill_says(name, prefill):
    """``prefill`` is a setting every eviction preset shares: the policy a preset builds
    takes it, whether it builds its policy from same-named fields or its own way."""
    assert len(EVICTING) >= 18
    cache = velox_core.make(f"{name}:budget=256,prefill={prefill}")
    assert cache.policy.prefill == prefill
