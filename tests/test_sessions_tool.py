"""tools/sessions.py: nox's default sessions, lint first, the package sessions side by side,
the others after them; a failed session fails the run once every session has run."""

import threading
import time


def _fake(monkeypatch, tool, failing=()):
    names = [
        "lint",
        "tests(package='velox-a')",
        "tests(package='velox-qjl')",
        "integration",
        "build",
    ]
    monkeypatch.setattr(tool, "default_sessions", lambda: list(names))
    started, running, peak = [], [0], [0]
    lock = threading.Lock()

    def run(name):
        with lock:
            started.append(name)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return name, 1 if name in failing else 0, 0.05

    monkeypatch.setattr(tool, "run_session", run)
    return started, peak


def test_order_and_side_by_side(load_tool, monkeypatch):
    tool = load_tool("sessions")
    started, peak = _fake(monkeypatch, tool)
    assert tool.main(["--jobs", "2"]) == 0
    assert started[0] == "lint" and started[-2:] == ["integration", "build"]
    # the emulator-heavy package first, then the rest, two at a time
    assert started[1] == "tests(package='velox-qjl')"
    assert peak[0] == 2


def test_a_failure_fails_the_run_after_every_session(load_tool, monkeypatch, capsys):
    tool = load_tool("sessions")
    started, _ = _fake(monkeypatch, tool, failing=("tests(package='velox-a')",))
    assert tool.main(["--jobs", "2"]) == 1
    assert len(started) == 5
    assert "failed: tests(package='velox-a')" in capsys.readouterr().out


def test_only_and_bad_jobs(load_tool, monkeypatch):
    import pytest

    tool = load_tool("sessions")
    started, _ = _fake(monkeypatch, tool)
    assert tool.main(["--only", "velox-a"]) == 0
    assert started == ["tests(package='velox-a')"]
    with pytest.raises(SystemExit):
        tool.main(["--jobs", "0"])
    with pytest.raises(SystemExit):
        tool.main(["--only", "nothing-like-this"])
