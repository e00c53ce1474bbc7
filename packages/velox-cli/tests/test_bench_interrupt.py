"""Stopping ``velox bench`` (issue 55): its worker processes die with it, Ctrl-C (and SIGTERM)
stops it within seconds, and ``--json`` holds every row finished so far (written as rows
finish, not only at the end)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from velox_cli.data import find_shared

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

# enough work that the rows after the first take far longer than a stop (tens of seconds on
# an idle machine): a run that finished before the signal would prove nothing
SPECS = [f"uniform:bits={b},group={g}" for b in (2, 3, 4, 5, 6, 8) for g in (32, 64)]
# seconds from the signal to the exit: an interrupt that waited for the running specs would
# take the minutes the remaining rows need (the margin is for a loaded CI machine)
STOP_WITHIN = 15


def _velox(*args: str, json_path: Path) -> subprocess.Popen:
    """``velox ARGS --json JSON_PATH --chart ""`` in a process of its own, output piped."""
    cmd = [sys.executable, "-m", "velox_cli", *args, "--json", str(json_path), "--chart", ""]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell's background job inherits SIGINT ignored (then Python sets no Ctrl-C
        # handler): the command gets the default a terminal gives it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _bench(json_path: Path) -> subprocess.Popen:
    run = ["--context", "2048", "--continuation", "16", "--chunk", "512", "--jobs", "2"]
    return _velox("bench", "--methods", *SPECS, *run, json_path=json_path)


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started, and theirs (Linux ``/proc/PID/task/*/children``)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited (nobody reaped it yet)


def _rows(path: Path) -> list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_for(what, seconds: float, proc: subprocess.Popen):
    deadline = time.time() + seconds
    while time.time() < deadline:
        got = what()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"velox bench ended early: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out: {proc.communicate()[0][-3000:]}")


def _stop_midway(proc: subprocess.Popen, started, sig) -> tuple:
    """Once ``started()`` holds, send ``sig`` to ``proc`` and wait for its exit (at most
    STOP_WITHIN seconds). Returns ``(proc, its output, seconds to exit, its workers)``."""
    try:
        _wait_for(started, 240, proc)
        workers = _children(proc.pid)
        assert workers, "no worker processes"
        t0 = time.time()
        proc.send_signal(sig)
        out = proc.communicate(timeout=STOP_WITHIN)[0]
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, out, elapsed, workers


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_stops_within_seconds_and_keeps_the_finished_rows(tmp_path, sig):
    path = tmp_path / "rows.json"
    # a row finished: written while running
    proc, out, elapsed, workers = _stop_midway(_bench(path), lambda: _rows(path), sig)
    assert proc.returncode != 0 and elapsed < STOP_WITHIN, (proc.returncode, elapsed, out[-2000:])
    rows = _rows(path)
    assert rows and len(rows) < len(SPECS), rows
    assert {r["spec"] for r in rows} <= set(SPECS)
    assert all(not r.get("error") for r in rows), rows
    assert "Traceback" not in out, out[-3000:]
    deadline = time.time() + 5
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived velox bench"


def test_workers_die_with_a_killed_bench(tmp_path):
    proc = _bench(tmp_path / "rows.json")
    try:
        # the workers are up once both have loaded the model (their /proc cmdline says spawn)
        def started():
            kids = _children(proc.pid)
            spawned = [k for k in kids if "spawn_main" in _cmdline(k)]
            return kids if len(spawned) >= 2 else None

        workers = _wait_for(started, 120, proc)
        time.sleep(3)  # past their start: loading the model, or measuring
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)  # not communicate: live workers would hold its stdout open
        # a worker still importing when its parent died (a loaded machine) ends as its
        # initializer starts and finds the parent gone: allow for the imports
        deadline = time.time() + 30
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.2)
        left = [w for w in workers if _alive(w)]
    finally:
        if proc.poll() is None:
            proc.kill()
    for w in left:  # leave nothing behind, whatever the outcome
        try:
            os.kill(w, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"worker processes {left} outlived the killed velox bench"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _eval(json_path: Path) -> subprocess.Popen:
    run = ["--tasks", "passkey", "--lengths", "2048", "--prompts", "12", "--jobs", "2"]
    return _velox("eval", "--methods", "fp16", *SPECS[:6], *run, json_path=json_path)


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_eval_interrupt_keeps_the_finished_prompts(tmp_path, sig):
    """``velox eval`` stopped midway exits within seconds, its workers with it, and its
    ``--json`` holds the prompts it finished (a GPU run's time limit ends it so)."""
    path = tmp_path / "eval.json"
    record = Path(str(path) + ".trials.jsonl")
    proc, out, elapsed, workers = _stop_midway(_eval(path), lambda: _lines(record), sig)
    assert proc.returncode == 130 and elapsed < STOP_WITHIN, (proc.returncode, elapsed, out[-2000:])
    assert "interrupted after" in out and "Traceback" not in out, out[-3000:]
    data = json.loads(path.read_text())
    assert data["run"]["partial"] is True
    done = {(t["task"], t["length"], t["index"]) for t in data["trials"]}
    assert 1 <= len(done) < 12
    assert {t["spec"] for t in data["trials"]} == {"fp16", *SPECS[:6]}
    deadline = time.time() + 5
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived velox eval"
