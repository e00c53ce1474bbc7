"""Measured layer steps: the fit, its artifact, how an encode finds it, the command line."""

import json
import subprocess
import sys
from functools import lru_cache

import numpy as np
import pytest
from _cg_util import model, prefilled

import velox_cachegen as cg
from velox_cachegen.__main__ import main
from velox_cachegen.artifact import resolve_steps
from velox_cachegen.container import split
from velox_cachegen.header import chunk_count
from velox_testing import tiny_model


@lru_cache(maxsize=1)
def profile() -> cg.LayerProfile:
    ids = np.random.default_rng(1).integers(0, 512, 2 * 160)
    return cg.fit_cachegen(model(), ids, seq_len=160, steps=8, window=16, chunk=64)


def test_the_fit_measures_every_layer_side_and_balances_them():
    p = profile()
    kl = np.array([p.kl["key"], p.kl["value"]])
    assert kl.shape == (2, 2) and np.all(kl > 0)
    mult = np.array([p.steps.key, p.steps.value])
    # the most sensitive layer-side gets the finest step, the median one keeps the level
    assert mult.ravel()[np.argmax(kl)] == mult.min()
    assert np.all((mult >= 0.125) & (mult <= 4.0))
    balanced = kl * mult**2
    assert balanced.max() / balanced.min() < kl.max() / kl.min() or np.ptp(mult) == 0
    assert p.calibration["tokens"] == 320 and p.calibration["steps"] == 8


def test_the_artifact_round_trips_and_an_encode_finds_it_by_fingerprint(monkeypatch, tmp_path):
    path = cg.save_profile(profile(), tmp_path / "steps.safetensors")
    back = cg.load_profile(path)
    assert back.steps == profile().steps and back.fingerprint == profile().fingerprint
    caches = prefilled(80)
    monkeypatch.setenv("VELOX_ARTIFACTS", str(tmp_path))
    assert resolve_steps(None, model(), 2) == profile().steps
    data = cg.encode(caches, model=model())
    header, _ = split(data, chunk_count)
    assert header["quality"]["layer_steps"] == profile().steps.to_json()
    assert resolve_steps(None, None, 2) == cg.LayerSteps.reference(2)
    assert resolve_steps(str(path), model(), 2) == profile().steps
    other = tiny_model("llama", head_dim=32, hidden_size=64, seed=3)
    with pytest.raises(ValueError, match="fitted for another model"):
        cg.encode(caches, model=other, layer_steps=str(path))


def test_fit_refuses_bad_arguments():
    ids = np.arange(100) % 50
    with pytest.raises(ValueError, match="fewer than one sequence"):
        cg.fit_cachegen(model(), ids, seq_len=200)
    with pytest.raises(ValueError, match="must exceed steps"):
        cg.fit_cachegen(model(), ids, seq_len=16, steps=16)
    with pytest.raises(ValueError, match="delta"):
        cg.fit_cachegen(model(), ids, seq_len=50, delta="x")
    with pytest.raises(ValueError, match="step must be a positive"):
        cg.fit_cachegen(model(), ids, seq_len=50, step=0)


def test_the_command_line_inspects_caches_and_shows_steps(tmp_path, capsys):
    cg.save(tmp_path / "c.cgen", prefilled(70), chunk=32, window=8)
    assert main(["inspect", str(tmp_path / "c.cgen")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 70 and len(info["chunks"]) == 3
    path = cg.save_profile(profile(), tmp_path / "p.safetensors")
    assert main(["show", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["layer_steps"] == profile().steps.to_json()
    (tmp_path / "bad.cgen").write_bytes(b"nope")
    assert main(["inspect", str(tmp_path / "bad.cgen")]) == 2
    assert "magic" in capsys.readouterr().err
    out = subprocess.run(
        [sys.executable, "-m", "velox_cachegen", "fit", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--model" in out.stdout
