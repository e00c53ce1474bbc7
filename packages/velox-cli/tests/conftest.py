"""A tiny mlx-lm model directory (config, weights, tokenizer) and a text file for CLI runs."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from velox_testing import tiny_model
from velox_testing.models import _tokenizer, tiny_config

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + "
    "self.y ** 2) ** 0.5\n\n\nfor i in range(10):\n    print(i, add(i, 1))\n"
) * 30


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    model = tiny_model("llama", head_dim=64, hidden_size=128, vocab_size=512)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    cfg = tiny_config("llama", tie_word_embeddings=True)
    (path / "config.json").write_text(json.dumps(cfg))
    _tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "code.py"
    p.write_text(TEXT)
    return str(p)
