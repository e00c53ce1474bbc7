"""``velox methods`` with every package installed (the long recommended specs of agetiered,
skvq...): every spec printed whole, no line wider than the terminal."""

import json
import re

from velox_cli.main import main


def whole(spec: str, line: str) -> bool:
    """``spec`` stands in ``line`` whole: not cut, not a part of a longer spec."""
    return re.search(r"(^|\s)" + re.escape(spec) + r"(\s|$)", line) is not None


def test_methods_prints_every_recommended_spec_whole(monkeypatch, capsys):
    assert main(["methods", "--json"]) == 0
    specs = [
        m["name"] + (":" + ",".join(f"{k}={v}" for k, v in r.items()) if r else "")
        for m in json.loads(capsys.readouterr().out)
        for r in m["recommended"]
    ]
    assert any(len(s) > 60 for s in specs)
    for width in (120, 80):
        monkeypatch.setenv("COLUMNS", str(width))
        assert main(["methods"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= width, width
        assert not any("…" in x for x in lines)
        for s in specs:
            assert any(whole(s, x) for x in lines), (width, s)
