// CPU emulation of the CUDA subset velox's CUDA-only kernels use (a test aid), standing in for
// MLX's mlx/backend/cuda/device/utils.cuh so that the source MLX's cuda_kernel generates
// compiles with g++ and runs on the CPU: every block runs as real threads (std::thread, made
// once a launch), one block at a time, with real __syncthreads / __syncwarp barriers (futexes
// on Linux: vx_emu_sync.h) and warp shuffles and votes
// through per-warp slots. `__shared__` arrays are static locals (shared by the one block that
// runs). velox_mma.cuh sees VX_CUDA_EMULATE and emulates mma.sync (each lane publishes its
// fragment registers; every lane computes its outputs from the PTX fragment layouts) and
// cp.async (a synchronous copy). What it cannot show: GPU memory ordering, speed, and the
// exact rounding of the tensor cores' float32 accumulation.
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "vx_emu_sync.h"  // metal/shim, on the include path too

#define VX_CUDA_EMULATE 1
#define MAX_NDIM 10
#define WARP_SIZE 32
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

struct __half {
  _Float16 v;
  __half() : v(0) {}
  __half(_Float16 f) : v(f) {}
  __half(float f) : v(static_cast<_Float16>(f)) {}
  operator float() const { return static_cast<float>(v); }
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  uint16_t bits_;
  __nv_bfloat16() : bits_(0) {}
  __nv_bfloat16(float f) {  // round to nearest even, as CUDA converts
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits_ = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                            : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline __half __float2half_rn(float f) { return __half(static_cast<_Float16>(f)); }
inline __half2 __floats2half2_rn(float a, float b) {
  return __half2{__float2half_rn(a), __float2half_rn(b)};
}
inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline __half2 __half2half2(__half h) { return __half2{h, h}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
// one rounding to fp16 of the exact result (fp16 products and sums are exact in double)
inline __half vx_emu_round(double d) { return __half(static_cast<_Float16>(d)); }
inline __half2 __hsub2(__half2 a, __half2 b) {
  return __half2{vx_emu_round(double(float(a.x)) - float(b.x)),
                 vx_emu_round(double(float(a.y)) - float(b.y))};
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2{vx_emu_round(double(float(a.x)) * float(b.x) + float(c.x)),
                 vx_emu_round(double(float(a.y)) * float(b.y) + float(c.y))};
}
inline __half2 __hmul2(__half2 a, __half2 b) {
  return __half2{vx_emu_round(double(float(a.x)) * float(b.x)),
                 vx_emu_round(double(float(a.y)) * float(b.y))};
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned int sel = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned int>((xy >> (8 * sel)) & 0xffu) << (8 * i);
  }
  return r;
}
inline float exp2f(float x) { return std::exp2(x); }
// device-wide memory: blocks run one after another here, so plain atomics suffice
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
inline float rintf(float x) { return std::rint(x); }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float fmaf(float a, float b, float c) { return std::fma(a, b, c); }

namespace vx_cuemu {

using Barrier = vx_emu_sync::Barrier;

struct MmaSlot {
  unsigned int a[4];
  unsigned int b[2];
  float c[4];
};

struct Warp {
  Barrier bar;
  uint64_t slot[32];
  MmaSlot mma[32];
};

struct Block {
  Barrier all;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local Block* g_block = nullptr;
inline thread_local int g_lane = 0;
inline thread_local int g_warp = 0;

inline Warp& warp() { return *g_block->warps[g_warp]; }

}  // namespace vx_cuemu

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline void __syncthreads() { vx_cuemu::g_block->all.wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { vx_cuemu::warp().bar.wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned int, T v, int lane_mask) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  return vx_emu_sync::shuffle_xor(w.bar, w.slot, vx_cuemu::g_lane, v, lane_mask);
}

template <typename T>
inline T __shfl_sync(unsigned int, T v, int src) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  return vx_emu_sync::shuffle(w.bar, w.slot, vx_cuemu::g_lane, v, src);
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }

inline int __any_sync(unsigned int, int p) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  return vx_emu_sync::any(w.bar, w.slot, vx_cuemu::g_lane, p != 0) ? 1 : 0;
}

namespace vx_cuemu {

// Run fn() for every thread of a grid of 1-D blocks (CUDA launch: grid in blocks). The
// block's threads are made once and run the blocks one after another, all of them done with
// a block (its shared memory) before any starts the next.
inline void launch(dim3 grid, dim3 block, const std::function<void()>& fn) {
  if (block.y != 1 || block.z != 1 || block.x % 32) {
    std::fprintf(stderr, "vx_cuemu: only 1-D blocks of whole warps are emulated\n");
    std::abort();
  }
  Block blk;
  blk.all.n = static_cast<int>(block.x);
  for (unsigned int w = 0; w < block.x / 32; ++w) {
    blk.warps.emplace_back(new Warp());
    blk.warps.back()->bar.n = 32;
  }
  Barrier between;
  between.n = static_cast<int>(block.x);
  std::vector<std::thread> threads;
  threads.reserve(block.x);
  for (unsigned int t = 0; t < block.x; ++t) {
    threads.emplace_back([&, t] {
      g_block = &blk;
      g_lane = static_cast<int>(t & 31);
      g_warp = static_cast<int>(t >> 5);
      threadIdx = dim3{t, 0, 0};
      blockDim = block;
      gridDim = grid;
      for (unsigned int bz = 0; bz < grid.z; ++bz) {
        for (unsigned int by = 0; by < grid.y; ++by) {
          for (unsigned int bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3{bx, by, bz};
            fn();
            between.wait();
          }
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
}

}  // namespace vx_cuemu

namespace mlx::core::cu {

using Shape = std::array<int32_t, MAX_NDIM>;
using Strides = std::array<int64_t, MAX_NDIM>;

}  // namespace mlx::core::cu
