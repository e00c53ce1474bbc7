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
// ST (scale dtype). Input: x (rows, HD), contiguous, a float dtype. Outputs: codes (rows, W)
// uint32, scale and zero (rows, HD / GROUP) in ST (row-major; the host gives them the input's
// leading shape).
// VX_ENCODE_PAIR (velox_core.kernels.encode.AFFINE_ENCODE_PAIR): two record sets of one shape
// and codec in one launch (a cache update's keys and values): a second input y and outputs
// codes_y, scale_y, zero_y; threads rows .. 2 rows - 1 encode y's rows.

constexpr int W = (HD * BITS + 31) / 32;
constexpr int NG = HD / GROUP;
const int rows = x_shape[0];
const int gx = vx_global_x;
#if defined(VX_ENCODE_PAIR)
const bool second = gx >= rows;
const int row = second ? gx - rows : gx;
auto src = second ? y : x;
auto codes_o = second ? codes_y : codes;
auto scale_o = second ? scale_y : scale;
auto zero_o = second ? zero_y : zero;
const int nrows = 2 * rows;
#else
const int row = gx;
auto src = x;
auto codes_o = codes;
auto scale_o = scale;
auto zero_o = zero;
const int nrows = rows;
#endif
if (gx < nrows) {
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
    float lo = static_cast<float>(src[xb + g * GROUP]);
    float hi = lo;
#pragma unroll
    for (int i = 1; i < GROUP; ++i) {
      const float v = static_cast<float>(src[xb + g * GROUP + i]);
      lo = vx_min(lo, v);
      hi = vx_max(hi, v);
    }
    lo = lo * clip;
    hi = hi * clip;
    const ST sc = static_cast<ST>(vx_max((hi - lo) / levels, 1e-8f));
    const ST zr = static_cast<ST>(lo);
    scale_o[(int64_t)row * NG + g] = sc;
    zero_o[(int64_t)row * NG + g] = zr;
    const float sf = static_cast<float>(sc);
    const float zf = static_cast<float>(zr);
#pragma unroll
    for (int i = 0; i < GROUP; ++i) {
      const float v = static_cast<float>(src[xb + g * GROUP + i]);
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
    codes_o[(int64_t)row * W + w] = words[w];
  }
}
