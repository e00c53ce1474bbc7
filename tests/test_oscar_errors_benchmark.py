"""benchmarks/oscar_errors.py: its anisotropy factors on keys built to have a known answer,
and a short run on the reference model whose rows hold what the script promises (a check of
the script, not a measurement)."""

import json

import numpy as np
import pytest


def test_anisotropy_of_isotropic_and_offset_keys(load_benchmark):
    bench = load_benchmark("oscar_errors")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4096, 32))
    k = rng.standard_normal((1, 4096, 32))
    a = bench.anisotropy(q, k)
    # white keys and queries: an even error is as loud as the logits' own spread
    assert a["iso"] == pytest.approx(1.0, rel=0.1)
    assert a["iso_centred"] == pytest.approx(1.0, rel=0.1)
    assert a["channel"] == pytest.approx(1.0, rel=0.1)
    # a constant offset adds energy the logits do not vary by: only the raw factor grows
    b = bench.anisotropy(q, k + 10.0)
    assert b["iso"] == pytest.approx(101.0, rel=0.1)
    assert b["iso_centred"] == pytest.approx(a["iso_centred"], rel=1e-6)
    # queries reading only the keys' quiet channels: a per-channel code's error stays
    # where the keys vary, an even one does not
    quiet = k * np.r_[np.full(16, 0.1), np.ones(16)]
    reads = q * np.r_[np.ones(16), np.zeros(16)]
    c = bench.anisotropy(reads, quiet)
    assert c["iso"] > 20 * c["channel"]


def test_rows_on_the_reference_model(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("oscar_errors")
    out = tmp_path / "errors.json"
    specs = ["oscar:bits=2,sinks=16,window=0", "oscar:bits=8,sinks=0,window=0"]
    rows = bench.main(
        ["--length", "300", "--specs", *specs, "--centred", specs[0], "--json", str(out)]
    )
    layers = 6  # the reference model's
    assert len(rows) == 3 * layers
    two, eight, centred = rows[:layers], rows[layers : 2 * layers], rows[2 * layers :]
    assert all(r["exact_tokens"] == 16 for r in two + centred)  # the sinks, as given
    assert all(r["exact_tokens"] == 0 for r in eight)
    for a, b in zip(two, eight):
        assert 0 < b["key_mse"] < a["key_mse"] / 100 and 0 < b["value_mse"] < a["value_mse"] / 100
        assert 0 <= b["attn_kl"] < a["attn_kl"] and b["out_err"] < a["out_err"]
        assert b["bits"] > a["bits"] > 2
    assert {r["keys"] for r in centred} == {"centred"}
    data = json.loads(out.read_text())
    assert data["rows"] == rows and set(data["anisotropy"]) == {str(i) for i in range(layers)}
    info = data["info"]
    assert info["coded_tokens"] == 128 * (info["context_tokens"] // 128) > 16
    assert "kmse" in capsys.readouterr().out
