// A codebook code's residual sketch: the sign sketch and the norm of the Lloyd-Max residual of each row.
// Body written once for Metal and CUDA (see velox_kernels.h). One thread per output word.
//
// For a row y (a rotated unit vector) with Lloyd-Max codes c_e (vx_codebook_code, the search
// of encode_codebook.metal over the same thresholds, so the codes are those the codebook kernel
// packs) and levels L, the residual is r_e = y_e - L[c_e] (one float32 subtraction, as the
// reference's y - y_hat), and
//   sign  bit i%32 of word i/32 = (S[i] . r >= 0)  for sketch rows i < M  (1 at +-0),
//   rnorm = ||r||,
// the bits of a last partial word above M zero, as velox_core.ops.pack(sign_sketch(r, S), 1)
// lays them out. Dots and the sum of squares are float32 FMAs in channel order; the
// reference's matmul sums in another order, so a sign can differ only where |S r| is within
// float32 rounding of 0, and the norm by a rounding of its dtype (as encode_sketch.metal).
//
// Threads: a row's W = ceil(M / 32) words; each walks the row's channels once (the codes
// found again by every word's thread: BITS comparisons a channel, against 32 FMAs), with 32
// accumulators for its 32 rows of S; word 0 also writes the norm. Rows past M in a partial
// word read row M - 1 of S and their bits are dropped.
//
// Template: D (row length), M (sketch rows), BITS (code bits, 1..8), NT (norm dtype).
// Inputs: y (rows, D) float32, contiguous; s (R, D) with R >= M, contiguous (any float);
// bounds (2^BITS - 1,) and levels (2^BITS,) float32 (the codebook's thresholds and levels).
// Outputs: sign (rows, W) uint32, rnorm (rows,) NT.

constexpr int W = (M + 31) / 32;
const int64_t gid = (int64_t)vx_global_x;
const int64_t rows = (int64_t)y_shape[0];
if (gid < rows * W) {
  const int w = (int)(gid % W);
  const int64_t row = gid / W;
  const int64_t yb = row * D;
  const int r0 = w * 32;
  float acc[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    acc[j] = 0.0f;
  }
  float ss = 0.0f;
  for (int c = 0; c < D; ++c) {
    const float v = static_cast<float>(y[yb + c]);
    const float r = v - static_cast<float>(levels[vx_codebook_code<BITS>(v, bounds)]);
    ss = vx_fma(r, r, ss);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int sr = vx_imin(r0 + j, M - 1);
      acc[j] = vx_fma(r, static_cast<float>(s[(int64_t)sr * D + c]), acc[j]);
    }
  }
  unsigned int word = 0u;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    word |= (acc[j] >= 0.0f && r0 + j < M) ? (1u << j) : 0u;
  }
  sign[row * W + w] = word;
  if (w == 0) {
    rnorm[row] = static_cast<NT>(vx_sqrt(ss));  // correctly rounded on both backends
  }
}
