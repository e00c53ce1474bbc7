"""benchmarks/decode_launches.py on the CPU: a decode step's stubbed kernel launches and graph
are recorded, the same tree compares equal, and a changed launch is named (a check of the
script, not a measurement)."""

import copy
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "decode_launches", ROOT / "benchmarks" / "decode_launches.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_compare_and_name_a_difference(tmp_path, capsys):
    mod = _module()
    out = tmp_path / "a.json"
    argv = ["--caches", "uniform:bits=4", "--context", "256", "--steps", "2"]
    assert mod.main([*argv, "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["uniform:bits=4"]
    # two timed steps and the graph's step, each attending through the fused decode kernel
    assert len(rec["launches"]) == 3
    assert all(any("decode" in launch["kernel"] for launch in s) for s in rec["launches"])
    assert rec["graph"] and all(n > 0 for n in rec["graph"].values())
    assert mod.main([*argv, "--compare", str(out)]) == 0
    assert "the same launches and graph" in capsys.readouterr().out

    changed = copy.deepcopy(rec)
    changed["launches"][1][0]["grid"][0] += 1
    assert "step 1, launch 0" in mod.first_difference(rec, changed)
    changed = copy.deepcopy(rec)
    name = next(iter(changed["graph"]))
    changed["graph"][name] += 1
    assert mod.first_difference(rec, changed).startswith("graph: " + name)
    out.write_text(json.dumps({"uniform:bits=4": changed}))
    assert mod.main([*argv, "--compare", str(out)]) == 1
