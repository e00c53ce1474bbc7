// Scalar codebook quantization and bit packing (Lloyd-Max codes).
// Body written once for Metal and CUDA (see velox_kernels.h). One thread per row.
//
// Matches velox_core.ops.Codebook.encode + velox_core.ops.pack bit for bit: the code of x is
// found by a binary search over the sorted decision thresholds (x >= bounds[cand - 1] moves
// up: vx_codebook_code in velox_kernels.h), and code i of the row occupies bits
// [i*bits, (i+1)*bits) of the row's uint32 words.
//
// Template: BITS, HD (row length). Inputs: y (rows, HD) float32, contiguous;
// bounds (2^BITS - 1,) float32. Output: codes (rows, W) uint32 (row-major; the host gives it the
// input's leading shape).

constexpr int W = (HD * BITS + 31) / 32;
const int row = vx_global_x;
const int rows = y_shape[0];
if (row < rows) {
  const int64_t yb = (int64_t)row * HD;
  unsigned int words[W];
#pragma unroll
  for (int w = 0; w < W; ++w) {
    words[w] = 0u;
  }
#pragma unroll
  for (int e = 0; e < HD; ++e) {
    const float v = static_cast<float>(y[yb + e]);
    const unsigned int code = (unsigned int)vx_codebook_code<BITS>(v, bounds);
    const int bit = e * BITS;
    const int wi = bit >> 5;
    const int sh = bit & 31;
    words[wi] |= code << sh;
    if (sh + BITS > 32) {
      words[wi + 1 < W ? wi + 1 : wi] |= code >> (32 - sh);
    }
  }
#pragma unroll
  for (int w = 0; w < W; ++w) {
    codes[(int64_t)row * W + w] = words[w];
  }
}
