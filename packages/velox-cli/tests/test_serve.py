"""``velox serve``: mlx-lm's server with velox caches answers batched requests of different
lengths with each request's own greedy completion, and reports the caches' bytes."""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

SPEC = "uniform:bits=4"
PROMPTS = [
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def norm(self):\n        return",
    "for i in range(",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return json.loads(r.read())


def _post(port: int, path: str, body: dict):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture
def server(model_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "velox_cli", "serve", "--method", SPEC, "--model", model_dir]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while True:
        try:
            _get(port, "/health")
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"velox serve did not start: {proc.communicate()[0][-2000:]}")
            time.sleep(0.3)
    yield port
    proc.terminate()
    proc.communicate(timeout=30)


def test_serve_batches_requests_of_different_lengths(server, model_dir):
    import mlx_lm

    import velox_core

    results = [None] * len(PROMPTS)

    def ask(i):
        body = {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0}
        results[i] = _post(server, "/v1/completions", body)["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model, tok = mlx_lm.load(model_dir)
    for prompt, got in zip(PROMPTS, results):
        want = velox_core.generate(model, tok, prompt, cache=SPEC, max_tokens=8)
        assert got == want, (prompt, got, want)

    info = _get(server, "/v1/velox")
    assert info["method"] == SPEC
    assert info["prompt_cache"]["sequences"] >= 1 and info["prompt_cache"]["resident_bytes"] > 0
    models = _get(server, "/v1/models")["data"]
    assert models[-1]["velox"]["method"] == SPEC


def test_serve_refuses_bad_settings(model_dir):
    for extra, msg in (
        (["--method", "nosuch"], "nosuch"),
        (["--method", SPEC, "--kv-bits", "4"], "--kv-bits"),
        (["--method", SPEC, "--prompt-cache-bytes", "10K"], "'10K' is not a size"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "velox_cli", "serve", "--model", model_dir, *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and msg in run.stderr, run.stderr
