"""``velox bench`` rows of velox-xquant and velox-nsnquant on a tiny mlx-lm model directory:
each spec measured, its held bytes what the codes hold, and XQuant's pairs below its unpaired
bytes."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from velox_cli.main import main
from velox_testing import tiny_model
from velox_testing.models import _tokenizer, tiny_config

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + "
    "self.y ** 2) ** 0.5\n\n\nfor i in range(10):\n    print(i, add(i, 1))\n"
) * 30

SPECS = [
    "fp16",
    "xquant:bits=2,window=0",
    "xquant:bits=2,window=0,share_from=None",
    "nsnquant:bits=2,group=64",
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("xq-bench")
    model = tiny_model("llama", head_dim=64, hidden_size=128, tie_word_embeddings=True)
    mx.save_safetensors(
        str(root / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (root / "config.json").write_text(json.dumps(tiny_config("llama", tie_word_embeddings=True)))
    _tokenizer().save_pretrained(str(root))
    (root / "code.py").write_text(TEXT)
    out = root / "rows.json"
    argv = ["bench", "--model", str(root), "--data", str(root / "code.py"), "--quick"]
    argv += ["--context", "256", "--methods", *SPECS, "--json", str(out), "--chart", ""]
    assert main(argv) == 0
    return {r["spec"]: r for r in json.loads(out.read_text())}


def test_every_spec_gives_a_measured_row(rows):
    assert list(rows) == SPECS
    for spec in SPECS[1:]:
        r = rows[spec]
        assert r["error"] is None, (spec, r["error"])
        assert r["method"] == spec.split(":")[0]
        assert r["cache_bytes"] > 0 and r["kl"] >= 0 and 0 <= r["top1"] <= 1
        assert r["compression_ratio"] > 1.5, (spec, r["compression_ratio"])


def test_the_bytes_follow_the_codes(rows):
    """A pair's higher layer holds no codes: the paired row holds fewer bytes than the
    unpaired one; NSNQuant's 2-bit codes hold less than a quarter of fp16's bytes."""
    paired, alone = rows["xquant:bits=2,window=0"], rows["xquant:bits=2,window=0,share_from=None"]
    assert paired["bytes_per_token"] < alone["bytes_per_token"]
    assert rows["nsnquant:bits=2,group=64"]["compression_ratio"] > 4
