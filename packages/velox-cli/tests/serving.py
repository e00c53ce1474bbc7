"""Helpers of the ``velox serve`` tests: a free port, a server started as a subprocess and
stopped, and HTTP requests that return error statuses instead of raising."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "velox_cli", "serve", *args]


def request(port: int, path: str, body: dict | None = None):
    """``(status, JSON body)`` of a GET (no body) or POST, error statuses included (a body
    that is no JSON comes back as text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def start(cmd: list[str], port: int, env: dict | None = None):
    """The server process once it answers ``/health`` (healthy or not: the test looks at
    why); fails the test if it exits or does not listen within 180 s."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    wait_listening(proc, port)
    return proc


def wait_listening(proc, port: int, log: Path | None = None) -> None:
    """Return once the server ``proc`` answers ``/health`` on ``port`` (healthy or not);
    if it exits or does not listen within 180 s, kill it and fail the test with the end of
    its output: its stdout pipe's, or the file ``log``'s where it writes there."""
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except urllib.error.HTTPError:  # listening, but unhealthy
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                out = proc.communicate()[0]
                if log is not None:
                    out = log.read_text(errors="replace")
                pytest.fail(f"velox serve did not start: {out[-3000:]}")
            time.sleep(0.3)


def stop(proc) -> str:
    """Terminate the server; its output."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]
