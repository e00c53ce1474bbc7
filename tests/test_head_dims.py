"""Every installed method's recommended settings on tiny llama models of head dims 64 to 128:
``make_cache`` and a short generate work, or ``make_cache`` refuses with a ``ValueError``
naming the method and the head dim, never an error at the first forward."""

import re

import mlx.core as mx
import pytest

import velox_core
from velox_core import VeloxCache, make_cache, parse_spec
from velox_testing import recommended_specs, tiny_model, tiny_tokenizer

DIMS = (64, 80, 96, 112, 128)
SPECS = recommended_specs()
_MODELS: dict[int, object] = {}


def _model(dim: int):
    """Two layers, two query heads and one KV head of ``dim`` channels."""
    if dim not in _MODELS:
        _MODELS[dim] = tiny_model(
            "llama", head_dim=dim, hidden_size=2 * dim, num_attention_heads=2, num_key_value_heads=1
        )
    return _MODELS[dim]


def _prompt(caches: list, dim: int) -> list[int]:
    """Enough tokens that the window passes some to the codes (sinks + window + one flush)."""
    c = next(c for c in caches if isinstance(c, VeloxCache))
    n = min(c.sinks + c.window + c._flush_at + 8, 640)
    return mx.random.randint(0, 512, (n,), key=mx.random.key(dim)).tolist()


@pytest.mark.parametrize("spec", SPECS)
def test_recommended_settings_work_or_are_refused_at_make_cache(spec):
    name = parse_spec(spec)[0]
    outcome = {}
    for dim in DIMS:
        model = _model(dim)
        try:
            caches = make_cache(model, spec)
        except FileNotFoundError as exc:  # an artifact fitted on the model's own activations
            pytest.skip(f"{spec} needs an artifact fitted on the model: {exc}")
        except ValueError as exc:
            msg = str(exc)
            assert re.search(rf"\b{re.escape(name)}: ", msg), msg
            assert re.search(rf"head dim {dim}\b", msg), msg
            outcome[dim] = "refused"
            continue
        prompt = _prompt(caches, dim)
        text = velox_core.generate(model, tiny_tokenizer(), prompt, cache=caches, max_tokens=3)
        assert isinstance(text, str)
        velox = [c for c in caches if isinstance(c, VeloxCache)]
        assert len(velox) == len(model.layers)
        assert all(c.offset >= len(prompt) for c in velox)
        outcome[dim] = "ok"
    assert outcome[128] == "ok", outcome  # every method runs at the commonest head dim
