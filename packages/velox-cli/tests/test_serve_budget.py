"""``velox serve --prompt-cache-bytes``: the prompt cache of compressed entries stays within
its byte budget request after request, batched or served one at a time, and evicts the least
recently used entry first (issue 52). mlx-lm 0.32 parses the option and gives it to no
prompt cache: its cache outgrows the budget as requests finish.

Hits are read from each answer's ``usage.prompt_tokens_details.cached_tokens``: a prompt whose
own entry is held reuses all its tokens but the last (``uniform:bits=4,window=0,flush=1`` is
a trimmable velox cache, so mlx-lm trims the entry of a longer sequence down to the prompt).
Every prompt starts with a token no other prompt starts with, so an entry is reused only by
its own prompt or by the variant made for it."""

import subprocess
import threading
from pathlib import Path

import pytest
from serving import free_port, request, serve_cmd, stop, wait_listening

from velox_cli.data import find_shared
from velox_cli.serve import _checked_size
from velox_cli.serve_cache import _prompt_cache_class

REF = find_shared("reference-model")
SPEC = "uniform:bits=4,window=0,flush=1"  # batchable and trimmable
BUDGET = 160_000  # bytes: a few entries of these prompts (about 26-28 kB each)
LINKED_BUDGET = 400_000  # xKV's entries are about 98 kB
needs_ref = pytest.mark.skipif(REF is None, reason="needs shared/reference-model")


class FakeCache:
    """A layer cache of ``nbytes`` bytes, as the prompt cache sees one."""

    def __init__(self, nbytes: int, trimmable: bool = False):
        self.nbytes, self.trimmable = nbytes, trimmable

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        return n


def test_prompt_cache_keeps_its_budget_lru_first():
    cache = _prompt_cache_class()(max_size=100, max_bytes=250)
    for i in range(5):  # 100 bytes each: two fit
        cache.insert_cache("m", [i, 7, 7], [FakeCache(60), FakeCache(40)])
        info = cache.info()
        assert info["resident_bytes"] == cache.nbytes <= 250, info
    assert info["sequences"] == 2 and info["evicted"] == 3 and info["max_bytes"] == 250
    assert info["peak_resident_bytes"] == 200, info
    # a request that reuses entry 3 (a prefix of its prompt) makes it the most recent: the
    # next insertion evicts entry 4, where mlx-lm's order (insertion only) would evict 3
    found, rest = cache.fetch_nearest_cache("m", [3, 7, 7, 9])
    assert found is not None and rest == [9]
    cache.insert_cache("m", [5, 7, 7], [FakeCache(100)])
    assert cache.fetch_nearest_cache("m", [3, 7, 7, 9])[0] is not None
    assert cache.fetch_nearest_cache("m", [4, 7, 7, 9])[0] is None
    # an entry larger than the budget is not stored, and the others stay
    cache.insert_cache("m", [6], [FakeCache(251)])
    assert cache.fetch_nearest_cache("m", [6, 1])[0] is None
    assert cache.info()["sequences"] == 2 and cache.nbytes == 200
    assert cache.info()["evicted"] == 5


def test_prompt_cache_without_budget_and_its_sessions():
    cache = _prompt_cache_class()(max_size=3)
    assert cache.info()["max_bytes"] is None
    for key in ([1, 2], [1, 2, 3], [1, 4]):  # a prompt, it with its answer, another prompt
        cache.insert_cache("m", key, [FakeCache(10)])
    info = cache.info()
    assert info["sequences"] == 3 and info["sessions"] == 2, info
    cache.insert_cache("m", [5], [FakeCache(10)])  # over --prompt-cache-size: one evicted
    assert cache.info()["sequences"] == 3 and cache.info()["evicted"] == 1


def _filled(spec: str, tokens: int, layers: int = 2) -> list:
    import mlx.core as mx

    import velox_core

    k = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(0)).astype(mx.float16)
    caches = [velox_core.make(spec) for _ in range(layers)]
    for c in caches:
        c.update_and_fetch(k, k * 0.5)
    return caches


def test_prompt_cache_reuses_a_longer_entrys_prefix_where_velox_caches_keep_it():
    """mlx-lm trims a longer entry to a new prompt's shared prefix only where every layer is
    exactly trimmable; a velox cache with a window is not (coded tokens stay coded), so
    mlx-lm's own prompt cache reuses nothing of it. velox serve's does (reuses_prefix), and a
    longer entry replaces the entries that are prefixes of it."""
    from mlx_lm.models.cache import LRUPromptCache

    long_key, prompt = list(range(100)), [*range(60), 500, 501]
    entry = _filled("uniform:bits=4", 100)
    assert not entry[0].is_trimmable() and entry[0].reuses_prefix()
    plain = LRUPromptCache(max_size=10)
    plain.insert_cache("m", long_key, entry)
    assert plain.fetch_nearest_cache("m", prompt) == (None, prompt)

    cache = _prompt_cache_class()(max_size=10)
    cache.insert_cache("m", long_key[:80], _filled("uniform:bits=4", 80))
    cache.insert_cache("m", long_key, entry)  # its prefix entry goes
    assert cache.info()["sequences"] == 1 and cache.nbytes == sum(c.nbytes for c in entry)
    got, rest = cache.fetch_nearest_cache("m", prompt)
    assert rest == [500, 501] and [c.offset for c in got] == [60, 60]
    assert [c.offset for c in entry] == [100, 100]  # the stored entry is a copy's source
    held, kept = entry[0].keys_and_values()[0], got[0].keys_and_values()[0]
    assert mx_close(kept, held[:, :, :60])

    # the prefix entry goes before the budget evicts anything: the other session stays
    other = _filled("uniform:bits=4", 90)
    size = sum(c.nbytes for c in entry) + sum(c.nbytes for c in other)
    held = _prompt_cache_class()(max_size=10, max_bytes=size)
    held.insert_cache("m", [7] * 90, other)
    held.insert_cache("m", long_key[:80], _filled("uniform:bits=4", 80))
    held.insert_cache("m", long_key, entry)
    assert held.info()["sequences"] == 2 and held.info()["evicted"] == 0 and held.nbytes == size
    assert held.fetch_nearest_cache("m", [7] * 90)[1] == []

    # an evicting cache's trim cannot give back what its policy dropped: nothing reused
    evicting = _prompt_cache_class()(max_size=10)
    evicting.insert_cache("m", long_key, _filled("snapkv:budget=64", 100))
    assert evicting.fetch_nearest_cache("m", prompt) == (None, prompt)


def mx_close(a, b) -> bool:
    import mlx.core as mx

    return a.shape == b.shape and mx.allclose(a, b, rtol=0, atol=1e-2).item()


def test_sizes_are_read_as_mlx_lm_reads_them_and_bad_ones_refused():
    import argparse

    from mlx_lm.utils import _parse_size

    size = _checked_size(_parse_size)
    assert size("1000") == 1000
    assert size("1.5G") == 1_500_000_000
    assert size("20MB") == size("20 mb") == 20_000_000
    assert size("0") == 0
    for bad in ("10K", "-1", "abc", "", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            size(bad)


def _prompts(n: int, skip: int = 0) -> list[str]:
    """``n`` prompts whose first tokens differ from each other's (after the first ``skip``
    such prompts, so that two calls with other ``skip`` give disjoint sets)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(REF))
    out, firsts = [], set()
    for tid in range(256, tok.vocab_size):
        word = tok.decode([tid])
        if not (word.isascii() and word.isalpha() and len(word) >= 3):
            continue
        prompt = _prompt(word, len(out))
        first = tok.encode(prompt)[0]
        if first != tid or first in firsts:
            continue
        firsts.add(first)
        out.append(prompt)
        if len(out) == skip + n:
            return out[skip:]
    raise AssertionError(f"only {len(out)} prompts of distinct first tokens")


def _prompt(word: str, i: int, last: str = "return") -> str:
    return f"{word} = table[{i}]\nprint({word}, {i})\n{last} {word}"


def _variant(prompt: str) -> str:
    """The prompt with its last line changed: it reuses a prefix of the prompt's entry."""
    return prompt.replace("\nreturn ", "\nraise ")


class Client:
    """Completions against one server, each followed by a look at ``/v1/velox`` (every
    reading is kept)."""

    def __init__(self, port: int, seeded: bool):
        self.port, self.seeded = port, seeded
        self.readings: list[dict] = []

    def ask(self, prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        if self.seeded:  # mlx-lm serves a request with a seed one at a time
            body["seed"] = 0
        status, got = request(self.port, "/v1/completions", body)
        assert status == 200, (status, got)
        return got["usage"]

    def look(self) -> dict:
        status, info = request(self.port, "/v1/velox")
        assert status == 200, info
        pc = info["prompt_cache"]
        self.readings.append(pc)
        return pc

    def hit(self, prompt: str) -> bool:
        """Whether the prompt found its own entry (all its tokens but the last reused)."""
        usage = self.ask(prompt)
        self.look()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return cached == usage["prompt_tokens"] - 1


def _check_budget(readings: list[dict], budget: int) -> None:
    for pc in readings:
        assert pc["max_bytes"] == budget, pc
        assert pc["resident_bytes"] <= budget, pc
        # the bytes counted when the entries were stored are what they hold now
        assert pc["resident_bytes"] == sum(t["n_bytes"] for t in pc["by_type"].values()), pc
    last = readings[-1]
    assert last["peak_resident_bytes"] <= budget, last  # after every insertion and trim
    assert last["evicted"] > 0, last


def _burst(client: Client, prompts: list[str], width: int) -> None:
    """The prompts, ``width`` requests at a time (batched together where the server
    batches), a reading after each group."""
    for at in range(0, len(prompts), width):
        threads = [threading.Thread(target=client.ask, args=(p,)) for p in prompts[at : at + width]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client.look()


class Server:
    """``velox serve`` with the reference model, its log in a file (hundreds of requests
    would fill a pipe nobody reads, and block the server's logging)."""

    def __init__(self, spec: str, budget: int, log: Path):
        self.port, self.log = free_port(), log
        cmd = serve_cmd("--method", spec, "--model", str(REF), "--port", str(self.port))
        extra = ["--prompt-cache-bytes", str(budget), "--prompt-cache-size", "1000"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [*cmd, *extra, "--max-tokens", "2"], stdout=out, stderr=subprocess.STDOUT
            )
        wait_listening(self.proc, self.port, log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> str:
        stop(self.proc)
        return self.output()


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory):
    if REF is None:
        pytest.skip("needs shared/reference-model")
    server = Server(SPEC, BUDGET, tmp_path_factory.mktemp("serve") / "server.log")
    yield server.port
    server.stop()


@pytest.mark.slow
@needs_ref
@pytest.mark.parametrize(
    "path, n, width, skip",
    [("batched", 200, 4, 0), ("one at a time", 40, 1, 200)],
)
def test_prompt_cache_stays_within_budget_and_evicts_lru(budget_server, path, n, width, skip):
    client = Client(budget_server, seeded=path == "one at a time")
    prompts = _prompts(n + 9, skip)
    load, fresh, last = prompts[:n], prompts[n:-1], prompts[-1]

    _burst(client, load, width)  # distinct prompts: the cache fills and evicts
    _check_budget(client.readings, BUDGET)
    assert not client.hit(load[0])  # the oldest entry is long gone

    # fresh entries, in order; the newest is reused (a hit), then one more is stored
    for p in fresh:
        client.ask(p)
        client.look()
    assert client.hit(fresh[-1])
    client.ask(last)
    held = client.look()["sequences"]
    order = [*fresh, last]  # least recently used first
    assert 3 <= held < len(order), client.readings[-1]  # several entries fit, not all
    oldest, next_oldest = order[-held], order[-held + 1]
    # a request reusing a prefix of the oldest entry makes it the most recent: storing that
    # request's own entry evicts the entry after it
    usage = client.ask(_variant(oldest))
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 1
    client.look()
    assert client.hit(oldest)
    assert not client.hit(next_oldest)
    _check_budget(client.readings, BUDGET)


@pytest.mark.slow
@needs_ref
def test_method_served_one_at_a_time_stays_within_budget(tmp_path):
    """xKV's layers share state: velox serve serves it one request at a time, mlx-lm's
    path without any byte limit of its own. velox-xkv is not among velox-cli's dependencies:
    the cross-package tests (``tests/test_serve_batching.py``) run this test where it is."""
    pytest.importorskip("velox_xkv", reason="needs velox-xkv (run by the cross-package tests)")
    server = Server("xkv", LINKED_BUDGET, tmp_path / "server.log")
    try:
        client = Client(server.port, seeded=False)
        prompts = _prompts(30)
        for p in prompts:
            client.ask(p)
            client.look()
        _check_budget(client.readings, LINKED_BUDGET)
        assert 2 <= client.readings[-1]["sequences"] < len(prompts), client.readings[-1]
    finally:
        log = server.stop()
    assert "requests are served one at a time" in log, log[-2000:]
