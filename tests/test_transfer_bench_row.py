"""``velox bench --transfer-mapper DIR --transfer-source MODEL``: the transfer row."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox_cli.main import main
from velox_testing import tiny_model
from velox_testing.models import _tokenizer, tiny_config
from velox_transfer import fit_mapper

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + "
    "self.y ** 2) ** 0.5\n\n\nfor i in range(10):\n    print(i, add(i, 1))\n"
) * 30


def _save(path, seed):
    path.mkdir()
    model = tiny_model("llama", seed=seed, tie_word_embeddings=True)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(tiny_config("llama", tie_word_embeddings=True)))
    _tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two tiny model directories, a text file, and mappers: one model to itself (exact) and
    the other model to it."""
    root = tmp_path_factory.mktemp("bench-row")
    a, b = _save(root / "a", 0), _save(root / "b", 1)
    (root / "code.py").write_text(TEXT)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, 96).astype(np.int32) for _ in range(4)]
    ma, _ = mlx_lm.load(a)
    mb, _ = mlx_lm.load(b)
    ma.set_dtype(mx.float32)
    mb.set_dtype(mx.float32)
    fit_mapper(ma, ma, seqs[:3], seqs[3:], lags=(0,)).save(root / "a-to-a")
    fit_mapper(mb, ma, seqs[:3], seqs[3:], lags=(0, 1)).save(root / "b-to-a")
    return root, a, b


def _bench(root, model, source, mapper, out):
    return main(
        [
            "bench",
            "--model",
            model,
            "--data",
            str(root / "code.py"),
            "--quick",
            "--context",
            "128",
            "--methods",
            "fp16",
            "--transfer-mapper",
            str(root / mapper),
            "--transfer-source",
            source,
            "--json",
            str(out),
            "--chart",
            "",
        ]
    )


def test_transfer_row_exact_for_a_self_map_and_measured_for_a_pair(setup, tmp_path, capsys):
    root, a, b = setup
    assert _bench(root, a, a, "a-to-a", tmp_path / "self.json") == 0
    text = capsys.readouterr().out
    assert "transfer:source=a" in text and "velox-transfer mapper" in text
    rows = json.loads((tmp_path / "self.json").read_text())
    assert [r["spec"] for r in rows] == ["fp16", "transfer:source=a"]
    t = rows[1]
    assert t["error"] is None and t["method"] == "transfer"
    assert t["params"]["mapped_tokens"] == 127 and t["params"]["mapper_version"] == 3
    assert t["run"]["transfer"]["source"] == a
    # a model's own cache mapped to itself: the target's own distributions
    assert t["kl"] == pytest.approx(0, abs=1e-3) and t["top1"] == 1.0
    assert t["retrieval"] == rows[0]["retrieval"]
    assert t["cache_bytes"] > 0 and t["compression_ratio"] == pytest.approx(1.0, rel=0.05)
    assert _bench(root, a, b, "b-to-a", tmp_path / "pair.json") == 0
    t = json.loads((tmp_path / "pair.json").read_text())[1]
    assert t["spec"] == "transfer:source=b" and t["error"] is None
    assert t["kl"] > 1e-3 and 0 <= t["top1"] <= 1  # an unrelated pair: a lossy mapping


def test_transfer_options_refused(setup, tmp_path, capsys):
    root, a, _ = setup
    assert main(["bench", "--model", a, "--transfer-mapper", str(root / "a-to-a")]) == 2
    assert "go together" in capsys.readouterr().err
    # the mapper of another pair: refused before any row runs
    assert _bench(root, a, a, "b-to-a", tmp_path / "x.json") == 2
    assert "fingerprint" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
