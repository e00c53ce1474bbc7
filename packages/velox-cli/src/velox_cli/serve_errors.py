"""``velox serve``'s answers to errors raised while requests are generated: the requests in
flight get the error and the generation thread serves on, where mlx-lm's would die (see
:mod:`velox_cli.serve`).
"""

from __future__ import annotations

import json
import logging
import weakref

__all__: list[str] = []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _inflight(generator) -> weakref.WeakSet:
    """The response queues of the requests the generation thread has taken (weakly: a
    finished request's queue goes with its handler)."""
    found = generator.__dict__.get("_velox_inflight")
    if found is None:
        found = generator.__dict__["_velox_inflight"] = weakref.WeakSet()
    return found


def _track_requests(original):
    """``ResponseGenerator._next_request`` remembering each request's response queue."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is not None:
            _inflight(self).add(request[0])
        return request

    return _next_request


def _survive_request_errors(original):
    """``ResponseGenerator._run_generate`` that outlives an error raised while serving
    requests (a cache that cannot serve one, say): the requests in flight get the error (each
    is answered with it) and the generation loop starts again, where mlx-lm's thread would
    die and the server answer every later request with an error. An error with no request in
    flight, or in a distributed server, still ends the thread as mlx-lm's does."""

    def _run_generate(self):
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                queues = list(_inflight(self))
                _inflight(self).clear()
                if self._stop or self._is_distributed or not queues:
                    logging.exception(f"mlx_lm.server generation thread died: {e}")
                    self._generation_failed = True
                    return
                logging.exception(
                    f"velox serve: {len(queues)} request(s) failed: {_first_line(e)}; serving on"
                )
                error = RuntimeError(f"velox serve: the request failed: {_first_line(e)}")
                for q in queues:
                    q.put(error)

    return _run_generate


def _error_responses(original):
    """``APIHandler.handle_completion`` answering an error raised while its request was
    generated (see :func:`_survive_request_errors`) with a 500 and the reason, where mlx-lm
    would drop the connection: a JSON body while the status line is unsent, else (a stream)
    a last ``data: {"error": ...}`` event."""

    def handle_completion(self, request, stop_words):
        try:
            return original(self, request, stop_words)
        except Exception as e:
            body = json.dumps({"error": _first_line(e)})
            try:
                if getattr(self, "_headers_buffer", None):  # the 200 is not sent yet
                    self._headers_buffer = []
                    self._set_completion_headers(500)
                    self.end_headers()
                    self.wfile.write(body.encode())
                else:
                    self.wfile.write(f"data: {body}\n\n".encode())
                self.wfile.flush()
            except OSError:  # the client went away
                pass
            return None

    return handle_completion
