"""Every option of every velox command says what it does and its default; velox serve shows
the options a user starts it with; velox inspect reads what velox generate writes."""

import argparse
import os

import pytest

from velox_cli.main import _parser, main


def _subparsers():
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _options():
    for name, sp in _subparsers().items():
        for a in sp._actions:
            if not isinstance(a, argparse._HelpAction):
                yield name, a


@pytest.mark.parametrize(
    "name,action", list(_options()), ids=lambda x: x if isinstance(x, str) else x.dest
)
def test_every_option_has_help_and_states_its_default(name, action):
    assert action.help, f"velox {name} {action.option_strings or action.dest}: no help"
    has_default = action.default not in (None, False, argparse.SUPPRESS)
    if has_default and action.option_strings and not action.required:
        assert "default" in action.help, (name, action.option_strings, action.help)


def test_serve_help_shows_model_host_and_port_and_passes_them_on(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--method", "mlx_lm.server"):
        assert flag in text
    seen = {}

    def fake_serve(spec, argv, storage_dtype=None):
        seen.update(spec=spec, argv=argv)

    monkeypatch.setattr("velox_cli.serve.serve", fake_serve)
    argv = ["serve", "--method", "uniform:bits=4", "--model", "smollm2", "--port", "9000"]
    assert main([*argv, "--prompt-cache-size", "4"]) == 0
    assert seen["argv"] == ["--model", "smollm2", "--port", "9000", "--prompt-cache-size", "4"]


def test_inspect_reads_what_generate_saves(model_dir, tmp_path, capsys):
    pytest.importorskip("velox_kivi", reason="saves a kivi cache (pip install velox-kivi)")
    path = tmp_path / "c.safetensors"
    for spec in ("kivi:bits=2", "mlx-q4", "fp16"):
        argv = ["generate", "--model", model_dir, "--method", spec, "--max-tokens", "4"]
        assert main([*argv, "--save-cache", str(path)]) == 0
        assert f"caches written to {path}" in capsys.readouterr().out
        assert main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert "total:" in out and ("kivi" if spec == "kivi:bits=2" else "KVCache") in out
    assert main(["generate", "--model", model_dir, "--save-cache", "c.bin"]) == 2
    assert "--save-cache must name a .safetensors file" in capsys.readouterr().err


def test_chart_path_is_printed_in_full(model_dir, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--model", model_dir, "--data", text_file, "--quick", "--context", "64"]
    assert main([*argv, "--methods", "fp16", "--jobs", "1", "--chart", "c.png"]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert f"chart written to {os.path.join(str(tmp_path), 'c.png')}" in out


def test_bad_input_the_sweep_found_is_refused_in_one_line(model_dir, text_file, tmp_path, capsys):
    """tools/bad_input_sweep.py's finds: an infinite --temp generated (uniform sampling), a
    --model naming a plain file crashed in mlx-lm (NotADirectoryError), a parameter given
    twice kept the last silently."""
    gen = ["generate", "--model", model_dir, "--max-tokens", "2"]
    (tmp_path / "empty").mkdir()
    for argv, why in (
        ([*gen, "--temp", "inf"], "--temp must be"),
        ([*gen, "--model", text_file], "is no model"),
        ([*gen, "--model", str(tmp_path / "empty")], "is no model"),
        ([*gen, "--method", "uniform:bits=4,bits=2"], "given twice"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("velox: error:") and why in err[0], err
