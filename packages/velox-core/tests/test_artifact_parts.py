"""The parts of velox_core.artifacts that the fitting method packages share: the provenance
of a fit, the prefill over calibration sequences, the per-layer record and ``bind``'s layer."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_core.artifacts import (
    FittedLayers,
    bound_layer,
    fingerprint,
    fitted,
    identity,
    prefilled,
)
from velox_testing import tiny_model


@dataclass
class _Record(FittedLayers):
    what = "test arrays"
    layers: dict[int, Any]


def test_fitted_is_the_provenance_of_a_fit_on_the_model():
    model = tiny_model()
    out = fitted(model, "token ids", None, tokens=7, seed=1)
    assert out["fingerprint"] == fingerprint(model)
    assert out["model"] == identity(model)
    assert out["calibration"] == {
        "tokens": 7,
        "seed": 1,
        "input": "token ids",
        "source": "",
        "dtype": "mlx.core.float16",
    }
    rec = _Record({0: mx.zeros(2)}, **out)
    assert rec.provenance() == out


def test_a_record_names_the_fitted_layers_of_a_missing_one():
    rec = _Record({0: "a", 2: "b"}, fingerprint="fp")
    assert rec.layer(2) == "b"
    with pytest.raises(ValueError, match=r"these test arrays have no layer 1 \(fitted: \[0, 2\]\)"):
        rec.layer(1)


def test_prefilled_runs_each_sequence_in_fresh_caches():
    model = tiny_model()
    ids = np.arange(1, 11, dtype=np.int64)
    runs = [
        (seq.tolist(), [(i, c.offset) for i, c in caches])
        for seq, caches in prefilled(model, ids, seq_len=4, chunk=3)
    ]
    layers = len(model.layers)
    assert [r[0] for r in runs] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]], [[9, 10]]]
    assert [r[1] for r in runs] == [[(i, n) for i in range(layers)] for n in (4, 4, 2)]


def test_bound_layer_checks_and_sets_the_layer():
    obj = SimpleNamespace(layer=None)
    assert not bound_layer(obj, object(), None)  # no layer yet
    assert not bound_layer(obj, None, 3) and obj.layer == 3  # no model
    assert bound_layer(obj, object(), None)
    with pytest.raises(ValueError, match="layer"):
        bound_layer(obj, object(), -1)
