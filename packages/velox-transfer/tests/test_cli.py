"""``python -m velox_transfer fit | apply | eval`` on two tiny model directories."""

from __future__ import annotations

import gzip
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from velox_testing import tiny_model
from velox_testing.models import _tokenizer, tiny_config
from velox_transfer.__main__ import main

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + "
    "self.y ** 2) ** 0.5\n\n\nfor i in range({n}):\n    print(i, add(i, {n}))\n"
)
SMALL = dict(
    hidden_size=96, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=32
)


def _save(path, seed, **kw):
    path.mkdir()
    model = tiny_model("llama", seed=seed, tie_word_embeddings=True, **kw)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (path / "config.json").write_text(
        json.dumps(tiny_config("llama", tie_word_embeddings=True, **kw))
    )
    _tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer-cli")
    data = root / "docs.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for d in range(12):
            f.write(json.dumps({"text": TEXT.format(n=d) * 4}) + "\n")
    return _save(root / "src", 0), _save(root / "tgt", 1, **SMALL), str(data), root


def test_fit_apply_eval(dirs, capsys):
    src, tgt, data, root = dirs
    out = str(root / "mapper")
    common = ["--source", src, "--target", tgt]
    fit = ["fit", *common, "--out", out, "--data", data, "--every", "3", "--tokens", "512"]
    assert main([*fit, "--heldout-tokens", "256", "--seq-len", "128"]) == 0
    assert "target layer 2: source layers" in capsys.readouterr().out
    for cache in ("fp16", "uniform:bits=4,group=32"):
        args = ["apply", *common, "--mapper", out, "--prompt", TEXT.format(n=3), "--cache", cache]
        assert main([*args, "--max-tokens", "4"]) == 0
        assert f"into the target's {cache} caches" in capsys.readouterr().out
    ev = ["eval", *common, "--mapper", out, "--data", data, "--prefixes", "48", "--samples", "1"]
    assert main([*ev, "--continuation", "4", "--tails", "16", "--json", str(root / "e.json")]) == 0
    text = capsys.readouterr().out
    assert "| 48 | transfer | 1 |" in text and "| 48 | last 16 only | 16 |" in text
    assert len(json.loads((root / "e.json").read_text())["rows"]) == 5
    # the pair reversed is refused, with the exit status of a user error
    assert main(["eval", "--source", tgt, "--target", src, "--mapper", out, "--data", data]) == 2
    assert "fingerprint" in capsys.readouterr().err
