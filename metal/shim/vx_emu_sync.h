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

namespace vx_emu_sync {

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
    if (!cv.wait_for(lk, std::chrono::seconds(60), [&] { return gen != g; })) {
      std::fprintf(stderr, "vx_emu: barrier timeout: not every thread reached it\n");
      std::abort();
    }
  }
};

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
