"""The kernel emulation's thread synchronization (``metal/shim/vx_emu_sync.h``): every kernel
test that runs a kernel on the CPU stands on its barrier, so it is tested on its own."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from velox_testing.emulate import shim_dir

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")

PROGRAM = r"""
#include "vx_emu_sync.h"
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

int main(int argc, char**) {
  const int n = 96, rounds = 300;
  vx_emu_sync::Barrier bar;
  bar.n = n;
  std::vector<int> seen(n * rounds, -1);
  std::atomic<int> count{0};
  uint64_t slot[96];
  std::vector<std::thread> threads;
  bool bad_shuffle = false;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < rounds; ++r) {
        count.fetch_add(1);
        bar.wait();  // every thread's increment of this round is done
        seen[t * rounds + r] = count.load();
        bar.wait();  // every thread has read it before the next round's increments
        if (vx_emu_sync::shuffle_xor(bar, slot, t, t * 10 + r, 1) != (t ^ 1) * 10 + r) {
          bad_shuffle = true;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < n; ++t) {
    for (int r = 0; r < rounds; ++r) {
      if (seen[t * rounds + r] != n * (r + 1)) {
        std::printf("thread %d round %d saw %d\n", t, r, seen[t * rounds + r]);
        return 1;
      }
    }
  }
  if (bad_shuffle) {
    std::printf("a shuffle read the wrong lane\n");
    return 1;
  }
  std::printf("ok\n");
  std::fflush(stdout);
  if (argc > 1) {  // a divergent barrier: one thread never arrives
    std::vector<std::thread> some;
    for (int t = 0; t < n - 1; ++t) some.emplace_back([&] { bar.wait(); });
    for (auto& th : some) th.join();
    std::printf("passed a barrier that a thread never reached\n");
  }
  return 0;
}
"""


def _build(tmp_path):
    src = tmp_path / "sync.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "sync"
    cmd = ["g++", "-std=c++17", "-O1", "-pthread", "-DVX_EMU_BARRIER_TIMEOUT_S=5"]
    cmd += ["-I", str(shim_dir()), str(src), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(exe)


def test_barrier_orders_rounds_and_shuffles_exchange_lanes(tmp_path):
    """96 threads, 300 rounds: after a barrier each sees every thread's work of the round and
    none of the next; a shuffle returns its partner lane's value."""
    res = subprocess.run([_build(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_barrier_aborts_when_a_thread_never_arrives(tmp_path):
    """A barrier that some thread never reaches (a divergent barrier, which hangs a GPU)
    aborts with a message after its timeout instead of hanging the test run."""
    res = subprocess.run([_build(tmp_path), "diverge"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "barrier timeout" in res.stderr
    assert "passed a barrier" not in res.stdout
