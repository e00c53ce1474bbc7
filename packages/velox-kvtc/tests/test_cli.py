"""``python -m velox_kvtc fit|show|inspect`` and the ``velox fit kvtc`` entry point."""

import json
from importlib.metadata import entry_points

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

import velox_kvtc as kt
from velox_kvtc.__main__ import main
from velox_testing import tiny_model
from velox_testing.models import _tokenizer, tiny_config

TEXT = "def add(a, b):\n    return a + b\n\nclass P:\n    def __init__(self, x):\n" * 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    model = tiny_model("llama", head_dim=32, hidden_size=64, vocab_size=512)
    params = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), params, {"format": "mlx"})
    cfg = tiny_config("llama", head_dim=32, hidden_size=64)
    (path / "config.json").write_text(json.dumps(cfg))
    _tokenizer().save_pretrained(str(path))
    return path


def test_fit_show_and_inspect(model_dir, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT)
    out = tmp_path / "art" / "kvtc.safetensors"
    args = ["fit", "--model", str(model_dir), "--text", str(text), "--out", str(out)]
    assert main([*args, "--tokens", "1024", "--seq-len", "256", "--ratios", "3,4"]) == 0
    assert "KVTC basis" in capsys.readouterr().out
    assert main(["show", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert sorted(shown["plans"]) == ["3", "4"] and shown["calibration"]["tokens"] == 1024
    assert shown["basis"]["key"][0] == 2 * 2 * 32  # 2 layers x 2 KV heads x 32 channels
    model, tok = mlx_lm.load(str(model_dir))
    caches = [KVCache() for _ in model.layers]
    model(mx.array(tok.encode(TEXT)[:300])[None], cache=caches)
    cache = tmp_path / "c.kvtc"
    kt.save(cache, caches, basis=out, model=model, ratio=4, window=32)
    assert main(["inspect", str(cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 300 and info["bytes"]["total"] == cache.stat().st_size
    assert main(["inspect", str(text)]) == 2
    assert "not a KVTC cache" in capsys.readouterr().err
    assert main(["inspect"]) == 2
    bad = [*args, "--tokens", "1024", "--seq-len", "256", "--ratios", "3,x"]
    assert main(bad) == 2


def test_velox_fit_finds_it():
    found = {e.name: e for e in entry_points(group="velox.fit")}
    assert found["kvtc"].load() is kt.__main__.fit_main
