// Vector quantization and bit packing (a codebook per batch row and head): the nearest codeword of every
// sub-vector of GROUP channels, its index written as BITS bits of the row's stream.
// Body written once for Metal and CUDA (see velox_kernels.h). One thread per output word.
//
// Matches velox_core.ops.assign + velox_core.ops.pack: the index of the least squared
// distance sum_g (y_g - c_g)^2 (float32, first index on ties), and sub-vector s in bits
// [s*BITS, (s+1)*BITS) of the row's uint32 words. A word's thread finds the indices of every
// sub-vector whose bits overlap it (one straddling two words is found by both threads).
// The reference ranks ||c||^2 - 2 y.c from a matmul, so where two codewords are about equally
// near (within float32 rounding) the two may pick different ones.
//
// Template: BITS (index width, 1-8), GROUP (channels per sub-vector), HD (row length).
// Inputs: y (BH, T, HD) float32, contiguous; book (BH, 2^BITS, GROUP) float32, contiguous:
// the codebook of each of the BH (batch row, head) pairs. Output: codes (BH, T, W) uint32.

constexpr int S = HD / GROUP;
constexpr int W = (S * BITS + 31) / 32;
constexpr int K = 1 << BITS;
const int64_t gid = (int64_t)vx_global_x;
const int T = y_shape[1];
const int64_t total = (int64_t)y_shape[0] * T * W;
if (gid < total) {
  const int w = (int)(gid % W);
  const int64_t row = gid / W;
  const int64_t bh = row / T;
  const int64_t yb = row * HD;
  const int64_t cb = bh * K * GROUP;
  const int s0 = (w * 32) / BITS;
  const int s1 = vx_imin(S - 1, (w * 32 + 31) / BITS);
  unsigned int word = 0u;
  for (int s = s0; s <= s1; ++s) {
    float xv[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      xv[g] = static_cast<float>(y[yb + s * GROUP + g]);
    }
    float best = 3.0e38f;
    int idx = 0;
    for (int k = 0; k < K; ++k) {
      float d = 0.0f;
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float diff = xv[g] - static_cast<float>(book[cb + k * GROUP + g]);
        d = vx_fma(diff, diff, d);
      }
      if (d < best) {
        best = d;
        idx = k;
      }
    }
    const int off = s * BITS - w * 32;  // the index's first bit, relative to this word
    word |= off >= 0 ? (unsigned int)idx << off : (unsigned int)idx >> (-off);
  }
  codes[gid] = word;
}
