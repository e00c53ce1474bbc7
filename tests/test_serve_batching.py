"""``velox serve`` with methods whose caches cannot be batched by mlx-lm (issue 55): xKV and
MiniCache share state across layers (mlx-lm batches each layer alone), and Q-Filters' caches
were copied without their fitted filters. The first request used to kill mlx-lm's generation
thread; every later request was answered 404. Now such a method is served one request at a
time (decided when the model loads), and a request a cache cannot serve fails alone."""

import os
import urllib.error
import urllib.request

import pytest
from serving import free_port, request, serve_cmd, start, stop

# velox serve's byte budget with a method served one request at a time: the test lives with
# velox-cli's, whose own session lacks velox-xkv; collected here, where every package is
from test_serve_budget import test_method_served_one_at_a_time_stays_within_budget  # noqa: F401

from velox_cli.data import find_shared

pytestmark = pytest.mark.slow

REF = find_shared("reference-model")
ARTIFACTS = find_shared("artifacts")


def _serve(spec: str, port: int):
    env = dict(os.environ)
    if ARTIFACTS is not None:  # Q-Filters' filters fitted for the reference model
        dirs = [d for d in env.get("VELOX_ARTIFACTS", "").split(":") if d]
        env["VELOX_ARTIFACTS"] = ":".join([*dirs, str(ARTIFACTS)])
    cmd = serve_cmd("--method", spec, "--model", str(REF), "--port", str(port), "--max-tokens", "4")
    return start(cmd, port, env)


@pytest.mark.skipif(REF is None, reason="needs shared/reference-model")
@pytest.mark.parametrize(
    "spec",
    ["xkv", "minicache", pytest.param("qfilters:budget=128", id="qfilters")],
)
def test_method_that_cannot_batch_serves_every_request(spec):
    if spec.startswith("qfilters") and ARTIFACTS is None:
        pytest.skip("needs shared/artifacts (Q-Filters' filters for the reference model)")
    port = free_port()
    proc = _serve(spec, port)
    log = ""
    try:
        for prompt in ("def add(a, b):\n    return", "class Point:\n    def"):
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            status, got = request(port, "/v1/completions", body)
            assert status == 200, (status, got)
            assert got["choices"][0]["text"] and got["usage"]["completion_tokens"] >= 1, got
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        log = stop(proc)
    assert "generation thread died" not in log, log[-3000:]


def test_request_error_fails_that_request_and_generation_goes_on():
    """An error raised on the generation thread while a request is in flight answers that
    request with the error and restarts the loop (mlx-lm's thread would die)."""
    from queue import Queue

    from velox_cli.serve_errors import _survive_request_errors, _track_requests

    taken = [Queue(), Queue()]

    class Generator:
        _stop = False
        _is_distributed = False
        _generation_failed = False
        runs = 0

        def _next_request(self, timeout=None):
            return (taken.pop(0), "request", "args") if taken else None

        def _generate(self):
            self.runs += 1
            request = self._next_request()
            if request is not None:
                raise ValueError("qfilters: no filters for this cache\nmore")

    Generator._next_request = _track_requests(Generator._next_request)
    Generator._run_generate = _survive_request_errors(None)
    first, second = taken
    g = Generator()
    g._run_generate()
    assert g.runs == 3 and not g._generation_failed  # two failed requests, then a clean exit
    for q in (first, second):
        error = q.get_nowait()
        assert isinstance(error, RuntimeError) and "no filters for this cache" in str(error)
        assert q.empty()

    class Broken(Generator):  # an error with no request in flight still ends the thread
        def _generate(self):
            self.runs += 1
            raise ValueError("broken")

    b = Broken()
    b._run_generate()
    assert b.runs == 1 and b._generation_failed
