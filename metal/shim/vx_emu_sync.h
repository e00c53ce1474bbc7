// Thread synchronization shared by the CPU emulations of the GPU kernels (metal_shim.h for
// Metal, cuda_emu/.../utils.cuh for CUDA): a reusable barrier that aborts instead of hanging
// when some threads never arrive (a divergent barrier or shuffle), and the SIMD-group / warp
// shuffle and vote built on it, exchanging values through one slot per lane.
#ifndef VX_EMU_SYNC_H
#define VX_EMU_SYNC_H

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#endif

// Seconds a barrier waits for every thread before it aborts (a test may compile it shorter).
#ifndef VX_EMU_BARRIER_TIMEOUT_S
#define VX_EMU_BARRIER_TIMEOUT_S 60
#endif

namespace vx_emu_sync {

#if defined(__linux__)
// On Linux: an arrival counter and a generation word the waiters sleep on (futex), so that a
// barrier costs each waiter one sleep and the last arrival one wake-up (a mutex and condition
// variable cost every waiter the mutex twice, and most of the emulated kernels' time went to
// those system calls). A waiter first yields a few times: with more threads than cores, the
// others usually arrive meanwhile.
struct Barrier {
  int n = 1;
  std::atomic<int> waiting{0};
  std::atomic<int> gen{0};
  void wait() {
    const int g = gen.load(std::memory_order_acquire);
    if (waiting.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      waiting.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_acq_rel);
      syscall(SYS_futex, reinterpret_cast<int*>(&gen), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
      return;
    }
    for (int i = 0; i < 4; ++i) {
      if (gen.load(std::memory_order_acquire) != g) {
        return;
      }
      sched_yield();
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(VX_EMU_BARRIER_TIMEOUT_S);
    while (gen.load(std::memory_order_acquire) == g) {
      timespec ts{1, 0};
      syscall(SYS_futex, reinterpret_cast<int*>(&gen), FUTEX_WAIT_PRIVATE, g, &ts, nullptr, 0);
      if (gen.load(std::memory_order_acquire) == g && std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "vx_emu: barrier timeout: not every thread reached it\n");
        std::abort();
      }
    }
  }
};
#else
struct Barrier {
  std::mutex mu;
  std::condition_variable cv;
  int n = 1;
  int waiting = 0;
  long gen = 0;
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    const long g = gen;
    if (++waiting == n) {
      waiting = 0;
      ++gen;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lk, std::chrono::seconds(VX_EMU_BARRIER_TIMEOUT_S), [&] { return gen != g; })) {
      std::fprintf(stderr, "vx_emu: barrier timeout: not every thread reached it\n");
      std::abort();
    }
  }
};
#endif

// The value of lane `src` among the `bar.n` lanes that share `slot` and `bar`.
template <typename T>
inline T shuffle(Barrier& bar, uint64_t* slot, int lane, T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle: type too large");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slot[lane] = bits;
  bar.wait();
  if (src < 0 || src >= bar.n) {
    std::fprintf(stderr, "vx_emu: a shuffle reads an inactive lane\n");
    std::abort();
  }
  const uint64_t got = slot[src];
  bar.wait();
  T r;
  std::memcpy(&r, &got, sizeof(T));
  return r;
}

// The value of lane `lane ^ mask`.
template <typename T>
inline T shuffle_xor(Barrier& bar, uint64_t* slot, int lane, T v, int mask) {
  return shuffle(bar, slot, lane, v, lane ^ mask);
}

// Whether `p` holds in any of the `bar.n` lanes.
inline bool any(Barrier& bar, uint64_t* slot, int lane, bool p) {
  slot[lane] = p ? 1u : 0u;
  bar.wait();
  bool found = false;
  for (int i = 0; i < bar.n; ++i) {
    found = found || slot[i] != 0;
  }
  bar.wait();
  return found;
}

}  // namespace vx_emu_sync

#endif  // VX_EMU_SYNC_H
