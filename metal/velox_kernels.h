// velox kernel portability layer: one kernel body, two backends.
//
// Every velox kernel body (the *.metal files beside this header) is written once against the
// names below and instantiated for Metal (mx.fast.metal_kernel) or CUDA (mx.fast.cuda_kernel).
// The Python loader (velox_core.kernels.build) prepends `#define VX_METAL 1` or
// `#define VX_CUDA 1` and this header to the kernel header, and prepends a short backend
// prologue to the body that defines the launch indices as plain ints:
//
//   vx_tid    thread index in the threadgroup / block       (0 .. vx_ntg - 1)
//   vx_ntg    threads per threadgroup / block (x)
//   vx_gx/gy/gz   threadgroup / block index in the grid
//   vx_ngx    threadgroups / blocks along x
//   vx_global_x   thread index in the whole grid along x
//
// (the prologue must name Metal's attributes literally: MLX adds an attribute argument to the
// generated signature only when its name appears in the body).
//
// VX_ASSUME(c) tells the CUDA compiler that c holds (e.g. vx_tid < the threadgroup size a
// kernel is launched with, so that bounds tests known to pass fold away); a no-op elsewhere.
//
// VX_THREAD qualifies a reference to a thread's own (register) array in a helper's parameters
// (Metal's `thread` address space; nothing on CUDA).
//
// Shared state: VX_SHARED declares threadgroup (Metal) / __shared__ (CUDA) arrays in the body;
// VX_BARRIER() synchronizes the threadgroup. Warp/SIMD-group operations assume 32 lanes (every
// NVIDIA GPU and every Apple GPU) and full participation of the 32 lanes.
#ifndef VELOX_KERNELS_H
#define VELOX_KERNELS_H

#if defined(VX_CUDA)

#define VX_FN __device__ __forceinline__
#define VX_THREAD
#define VX_SHARED __shared__
#define VX_BARRIER() __syncthreads()

VX_FN float vx_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
VX_FN bool vx_any(bool p) { return __any_sync(0xffffffffu, p ? 1 : 0) != 0; }
VX_FN float vx_bits_to_float(unsigned int u) { return __uint_as_float(u); }
VX_FN float vx_exp2(float x) { return exp2f(x); }
VX_FN float vx_rint(float x) { return rintf(x); }
VX_FN float vx_fma(float a, float b, float c) { return fmaf(a, b, c); }
VX_FN float vx_sqrt(float x) { return __fsqrt_rn(x); }
VX_FN int vx_popcount(unsigned int x) { return __popc(x); }
// full-range sine and cosine (MLX compiles without --use_fast_math: no __sinf)
VX_FN float vx_sin(float x) { return sinf(x); }
VX_FN float vx_cos(float x) { return cosf(x); }
#if defined(VX_CUDA_EMULATE)
#define VX_ASSUME(c) ((void)0)
#else
#define VX_ASSUME(c) __builtin_assume(c)
#endif

#elif defined(VX_METAL)

#include <metal_stdlib>

#define VX_FN inline
#define VX_THREAD thread
#define VX_SHARED threadgroup
#define VX_BARRIER() metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup)

VX_FN float vx_shfl_xor(float v, int lane_mask) {
  return metal::simd_shuffle_xor(v, static_cast<ushort>(lane_mask));
}
VX_FN bool vx_any(bool p) { return metal::simd_any(p); }
VX_FN float vx_bits_to_float(uint u) { return as_type<float>(u); }
VX_FN float vx_exp2(float x) { return metal::exp2(x); }
VX_FN float vx_rint(float x) { return metal::rint(x); }
VX_FN float vx_fma(float a, float b, float c) { return metal::fma(a, b, c); }
VX_FN float vx_sqrt(float x) { return metal::precise::sqrt(x); }
VX_FN int vx_popcount(uint x) { return static_cast<int>(metal::popcount(x)); }
// full-range sine and cosine, whatever the compile's fast-math setting
VX_FN float vx_sin(float x) { return metal::precise::sin(x); }
VX_FN float vx_cos(float x) { return metal::precise::cos(x); }
#define VX_ASSUME(c) ((void)0)

#else
#error "define VX_METAL or VX_CUDA before including velox_kernels.h"
#endif

// Portable helpers (no library overload resolution differences between the backends).

// The float 1 + c / 2^bits of the `bits`-bit code c at bit `sh` of word w (sh + bits <= 32):
// the code is moved to the top of the mantissa of 1.0 with one shift and one masked OR. With
// `sh` and `bits` known at compile time (unrolled loops) this is two integer instructions.
VX_FN float vx_code_unit(unsigned int w, int sh, int bits) {
  const int pos = 23 - bits;
  const unsigned int v = sh >= pos ? (w >> (sh - pos)) : (w << (pos - sh));
  const unsigned int mask = ((1u << bits) - 1u) << pos;
  return vx_bits_to_float((v & mask) | 0x3F800000u);
}

// +1.0f where bit `i` of w is set, -1.0f where it is clear: the bit moved to the sign
// position and flipped into -1.0f (with `i` known at compile time, a shift and a LOP).
VX_FN float vx_sign_unit(unsigned int w, int i) {
  return vx_bits_to_float(0xBF800000u ^ ((w << (31 - i)) & 0x80000000u));
}

// Reduce-scatter of VN partial sums over the VL lanes whose lane indices differ only in the
// bits below VL (VN, VL powers of two; jj = lane % VL): while a lane holds more than one
// value, each step halves them (the lane with bit `off` set keeps the upper half, its
// partner the lower: one shuffle a kept value), then the remaining steps add the one value
// left. A butterfly would take VN shuffles a step. After it, s[0 .. VN / min(VN, VL)) holds
// the sums of the indices from vx_scatter_first<VN, VL>(jj) on (lanes whose jj agree in the
// bits below min(VN, VL) hold the same ones); the rest of s is spent.
template <int VN, int VL>
VX_FN void vx_reduce_scatter(VX_THREAD float (&s)[VN], int jj) {
#pragma unroll
  for (int off = 1; off < VL; off <<= 1) {
    if (off < VN) {
      const int n = VN / (2 * off);  // values a lane keeps after this step
      const bool up = (jj & off) != 0;
#pragma unroll
      for (int e = 0; e < VN / 2; ++e) {
        if (e < n) {
          const float send = up ? s[e] : s[e + n];
          const float keep = up ? s[e + n] : s[e];
          s[e] = keep + vx_shfl_xor(send, off);
        }
      }
    } else {
      s[0] += vx_shfl_xor(s[0], off);
    }
  }
}

// the first index whose sum vx_reduce_scatter<VN, VL> leaves in s[0] of lane jj
template <int VN, int VL>
VX_FN int vx_scatter_first(int jj) {
  int idx = 0;
#pragma unroll
  for (int off = 1; off < VL && off < VN; off <<= 1) {
    idx += (jj & off) != 0 ? VN / (2 * off) : 0;
  }
  return idx;
}

// The Lloyd-Max code of v: a binary search over the 2^BITS - 1 ascending thresholds of a
// codebook (v >= bounds[cand - 1] moves up), the comparisons velox_core.ops.Codebook.encode
// makes; `bounds` points to them in device memory.
template <int BITS, typename P>
VX_FN int vx_codebook_code(float v, P bounds) {
  int idx = 0;
#pragma unroll
  for (int k = BITS - 1; k >= 0; --k) {
    const int cand = idx + (1 << k);
    idx = v >= static_cast<float>(bounds[cand - 1]) ? cand : idx;
  }
  return idx;
}

VX_FN float vx_max(float a, float b) { return a > b ? a : b; }
VX_FN float vx_min(float a, float b) { return a < b ? a : b; }
VX_FN int vx_imin(int a, int b) { return a < b ? a : b; }

#endif  // VELOX_KERNELS_H
