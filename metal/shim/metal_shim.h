// A C++17 stand-in for the subset of the Metal Shading Language that velox's kernels use, so
// that the Metal instantiation of every kernel (the full function MLX's metal_kernel
// generates) compiles with g++ on Linux, and can even run on the CPU.
//
// Compile checks: `g++ -std=c++17 -fsyntax-only -I metal/shim kernel.cpp`.
// Emulation: every threadgroup runs as real threads (std::thread, made once a dispatch and
// reused by the threadgroups, which run one at a time) with a real barrier, and
// SIMD-group shuffles exchange values through a per-SIMD-group slot array and barrier, so the
// body's cross-lane logic (reductions, votes, threadgroup memory) is exercised as written. A
// barrier or shuffle reached by only some threads deadlocks on a GPU; here it aborts after a
// timeout with a message. See velox_testing.emulate.
//
// Covered: address-space qualifiers (device, constant, thread, threadgroup -> a static local,
// shared by the threads of the one threadgroup that runs at a time), uint/ushort/uint3, half
// (float16_t, as _Float16) and bfloat16_t, as_type, and metal:: exp2, rint, fma, popcount,
// threadgroup_barrier, simd_shuffle_xor, simd_any. Not covered: anything else (a kernel that
// uses more fails to compile here, which is the point).
#ifndef VELOX_METAL_SHIM_H
#define VELOX_METAL_SHIM_H

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "vx_emu_sync.h"

typedef unsigned int uint;
typedef unsigned short ushort;

struct uint3 {
  uint x, y, z;
};

typedef _Float16 half;
typedef half float16_t;

// bfloat16 with round-to-nearest-even from float (as MLX and Metal convert)
struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() : bits_(0) {}
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits_ = static_cast<uint16_t>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits_ = static_cast<uint16_t>(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <typename T, typename U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

namespace vx_emu {

using Barrier = vx_emu_sync::Barrier;

struct Simd {
  Barrier bar;
  uint64_t slot[32];
};

struct Group {
  Barrier tg;
  std::vector<std::unique_ptr<Simd>> simd;
};

inline thread_local Group* g_group = nullptr;
inline thread_local int g_lane = 0;
inline thread_local int g_simd = 0;
inline thread_local bool g_sequential = false;

inline void no_sync_in_sequential() {
  if (g_sequential) {
    std::fprintf(stderr, "vx_emu: barrier or SIMD op in a kernel run sequentially\n");
    std::abort();
  }
}

struct Ids {
  uint3 group;
  uint3 groups;
  uint3 tg_size;
  uint tid;
};

// Run fn(ids) for every thread of a 1-D-threadgroup grid (`grid` in threads, as
// dispatchThreads). Threadgroups run one at a time; their threads run concurrently
// (`sequential`: one after another, for kernels without barriers or SIMD ops). The threads
// are made once and run the threadgroups one after another: all of them done with one (its
// threadgroup memory) before the next is set up (the last may hold fewer threads).
inline void run_grid(uint3 grid, uint3 tg, bool sequential, const std::function<void(const Ids&)>& fn) {
  if (tg.y != 1 || tg.z != 1) {
    std::fprintf(stderr, "vx_emu: only 1-D threadgroups are emulated\n");
    std::abort();
  }
  const uint ngx = (grid.x + tg.x - 1) / tg.x;
  const uint3 groups{ngx, grid.y, grid.z};
  Group group;
  for (uint s = 0; s * 32 < tg.x; ++s) {
    group.simd.emplace_back(new Simd());
  }
  auto setup = [&](uint n) {  // the group's barriers for n threads
    group.tg.n = static_cast<int>(n);
    for (uint s = 0; s * 32 < n; ++s) {
      group.simd[s]->bar.n = static_cast<int>(std::min<uint>(32, n - s * 32));
    }
  };
  auto run = [&](uint t, uint gx, uint gy, uint gz) {
    g_group = &group;
    g_lane = static_cast<int>(t & 31);
    g_simd = static_cast<int>(t >> 5);
    g_sequential = sequential;
    Ids ids{uint3{gx, gy, gz}, groups, tg, t};
    fn(ids);
  };
  if (sequential) {
    for (uint gz = 0; gz < grid.z; ++gz) {
      for (uint gy = 0; gy < grid.y; ++gy) {
        for (uint gx = 0; gx < ngx; ++gx) {
          const uint n = std::min(tg.x, grid.x - gx * tg.x);
          for (uint t = 0; t < n; ++t) {
            run(t, gx, gy, gz);
          }
        }
      }
    }
    return;
  }
  Barrier between;
  between.n = static_cast<int>(tg.x);
  setup(tg.x);
  std::vector<std::thread> threads;
  threads.reserve(tg.x);
  for (uint t = 0; t < tg.x; ++t) {
    threads.emplace_back([&, t] {
      uint held = tg.x;  // the threads the group's barriers are set up for
      for (uint gz = 0; gz < grid.z; ++gz) {
        for (uint gy = 0; gy < grid.y; ++gy) {
          for (uint gx = 0; gx < ngx; ++gx) {
            const uint n = std::min(tg.x, grid.x - gx * tg.x);
            if (n != held) {  // (a partial last threadgroup, and the full one after it)
              if (t == 0) {
                setup(n);
              }
              between.wait();  // set up before any thread runs it
              held = n;
            }
            if (t < n) {
              run(t, gx, gy, gz);
            }
            between.wait();  // every thread done with it
          }
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
}

}  // namespace vx_emu

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags) {
  vx_emu::no_sync_in_sequential();
  vx_emu::g_group->tg.wait();
}

template <typename T>
inline T simd_shuffle_xor(T v, ushort lane_mask) {
  vx_emu::no_sync_in_sequential();
  vx_emu::Simd& s = *vx_emu::g_group->simd[vx_emu::g_simd];
  return vx_emu_sync::shuffle_xor(s.bar, s.slot, vx_emu::g_lane, v, static_cast<int>(lane_mask));
}

inline bool simd_any(bool p) {
  vx_emu::no_sync_in_sequential();
  vx_emu::Simd& s = *vx_emu::g_group->simd[vx_emu::g_simd];
  return vx_emu_sync::any(s.bar, s.slot, vx_emu::g_lane, p);
}

inline float exp2(float x) { return std::exp2(x); }
inline float rint(float x) { return std::rint(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned int popcount(unsigned int x) { return static_cast<unsigned int>(__builtin_popcount(x)); }
namespace precise {
inline float sqrt(float x) { return std::sqrt(x); }
inline float sin(float x) { return std::sin(x); }
inline float cos(float x) { return std::cos(x); }
}  // namespace precise

}  // namespace metal

// Metal's address spaces (last: the standard headers above use these words)
#define device
#define constant
#define thread
#define threadgroup static

#endif  // VELOX_METAL_SHIM_H
