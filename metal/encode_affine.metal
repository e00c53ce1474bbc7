// Affine per-token-group quantization and bit packing (velox_core.Uniform, axis="token").
// Body written once for Metal and CUDA (see velox_kernels.h). One thread per token row.
//
// Matches velox_core.ops.affine_quantize + velox_core.ops.pack bit for bit:
//   lo = min(group) * clip, hi = max(group) * clip
//   scale = ST(max((hi - lo) / (2^bits - 1), 1e-8)), zero = ST(lo)
//   code = clip(rint((x - float(zero)) / float(scale)), 0, 2^bits - 1)   (ties to even)
// and code i of the row occupies bits [i*bits, (i+1)*bits) of the row's uint32 words.
//
// Template: BITS, HD (row length), GROUP (channels per group), CLIPB (float32 bits of clip),
// ST (scale dtype). Inputs: x (rows, HD), contiguous, any float dtype.
// Outputs: codes (rows, W) uint32, scale and zero (rows, HD / GROUP) in ST (row-major; the host
// gives them the input's leading shape).

constexpr int W = (HD * BITS + 31) / 32;
constexpr int NG = HD / GROUP;
const int row = vx_global_x;
const int rows = x_shape[0];
if (row < rows) {
  const float clip = vx_bits_to_float((unsigned int)CLIPB);
  const float levels = (float)((1 << BITS) - 1);
  const int64_t xb = (int64_t)row * HD;
  unsigned int words[W];
#pragma unroll
  for (int w = 0; w < W; ++w) {
    words[w] = 0u;
  }
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    float lo = static_cast<float>(x[xb + g * GROUP]);
    float hi = lo;
#pragma unroll
    for (int i = 1; i < GROUP; ++i) {
      const float v = static_cast<float>(x[xb + g * GROUP + i]);
      lo = vx_min(lo, v);
      hi = vx_max(hi, v);
    }
    lo = lo * clip;
    hi = hi * clip;
    const ST sc = static_cast<ST>(vx_max((hi - lo) / levels, 1e-8f));
    const ST zr = static_cast<ST>(lo);
    scale[(int64_t)row * NG + g] = sc;
    zero[(int64_t)row * NG + g] = zr;
    const float sf = static_cast<float>(sc);
    const float zf = static_cast<float>(zr);
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      const float v = static_cast<float>(x[xb + g * GROUP + i]);
      const float c = vx_min(vx_max(vx_rint((v - zf) / sf), 0.0f), levels);
      const unsigned int code = (unsigned int)c;
      const int bit = (g * GROUP + i) * BITS;
      const int wi = bit >> 5;
      const int sh = bit & 31;
      words[wi] |= code << sh;
      if (sh + BITS > 32) {
        words[wi + 1 < W ? wi + 1 : wi] |= code >> (32 - sh);
      }
    }
  }
#pragma unroll
  for (int w = 0; w < W; ++w) {
    codes[(int64_t)row * W + w] = words[w];
  }
}
