"""tools/bad_input_sweep.py's file part on every run: 300+ saved caches altered (headers signed
again, bytes flipped or cut), each refused in a worker process; none loads, none crashes in
MLX or hangs (the spec and command-line parts run with the script itself)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_altered_file_is_refused(tmp_path):
    out = tmp_path / "sweep.json"
    script = ROOT / "tools" / "bad_input_sweep.py"
    argv = [sys.executable, str(script), "--parts", "files", "--timeout", "120", "--json", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["files"]
    bad = [r for r in rows if r["outcome"] != "refused"]
    assert len(rows) >= 300 and not bad, bad
    assert "0 against the targets" in run.stdout
