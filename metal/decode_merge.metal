// Merge of the per-split partials of decode_attention.metal: one softmax over all splits.
// Body written once for Metal and CUDA (see velox_kernels.h).
//
// Grid: x = (query row, chunk of 32 channels) per threadgroup of 256 threads (8 warps).
// The split weights w_s = 2^(m_s - M) are computed once per chunk of 1024 splits into
// threadgroup memory; lane i of every warp takes channel 32 * chunk + i, the warps take
// turns over the splits, and the warps' sums are added at the end.
//
// Inputs (contiguous): o_part (B, H, S, MP, HD), ml_part (B, H, S, MP, 2) = (max, sum), log2 units.
// Outputs: o (B, H, MP, HD) = sum_s o_s 2^(m_s - M), m (B, H, MP, 1) = M in natural-log units,
// l (B, H, MP, 1) = sum_s l_s 2^(m_s - M): the format of velox_core.cache.attention.partial.
// The host launches 256 threads per threadgroup (velox_core.kernels.decode.merge_launch).

constexpr int NTM = 256;
constexpr int NWM = NTM / 32;
constexpr int CHUNK = 1024;
constexpr float NEG = -1.0e30f;
constexpr float LN2 = 0.6931471805599453f;

const int tid = vx_tid;
const int lane = tid & 31;
const int warp = tid >> 5;
const int S = ml_part_shape[2];
const int MP = ml_part_shape[3];
const int HD = o_part_shape[4];
const int nd = (HD + 31) / 32;
const int row = vx_gx / nd;
const int dc = vx_gx - row * nd;
const int bh = row / MP;
const int mrow = row - bh * MP;
const int64_t base = (int64_t)bh * S * MP + mrow;  // (bh, s = 0, mrow) in rows of (B*H, S, MP)
const int d = dc * 32 + lane;

VX_SHARED float wsh[CHUNK];
VX_SHARED float red[NWM * 32];

// the max over the splits
float top = NEG;
for (int s = tid; s < S; s += NTM) {
  top = vx_max(top, ml_part[(base + (int64_t)s * MP) * 2]);
}
#pragma unroll
for (int off = 16; off > 0; off >>= 1) {
  top = vx_max(top, vx_shfl_xor(top, off));
}
if (lane == 0) {
  red[warp] = top;
}
VX_BARRIER();
top = NEG;
#pragma unroll
for (int w = 0; w < NWM; ++w) {
  top = vx_max(top, red[w]);
}

// weighted sums, one chunk of splits at a time
float acc = 0.0f;
float lsum = 0.0f;
for (int c0 = 0; c0 < S; c0 += CHUNK) {
  const int cn = vx_imin(CHUNK, S - c0);
  VX_BARRIER();  // the previous chunk's weights (and the max above) have been read
  for (int i = tid; i < cn; i += NTM) {
    const int64_t r = base + (int64_t)(c0 + i) * MP;
    const float w = vx_exp2(ml_part[r * 2] - top);
    wsh[i] = w;
    lsum += ml_part[r * 2 + 1] * w;
  }
  VX_BARRIER();
  if (d < HD) {
    for (int i = warp; i < cn; i += NWM) {
      acc += o_part[(base + (int64_t)(c0 + i) * MP) * HD + d] * wsh[i];
    }
  }
}
#pragma unroll
for (int off = 16; off > 0; off >>= 1) {
  lsum += vx_shfl_xor(lsum, off);
}
VX_BARRIER();  // every thread has read red[] (the max) before it is reused
red[warp * 32 + lane] = acc;
VX_BARRIER();
if (warp == 0) {
  float o_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < NWM; ++w) {
    o_sum += red[w * 32 + lane];
  }
  if (d < HD) {
    o[(int64_t)row * HD + d] = o_sum;
  }
}
VX_BARRIER();
if (lane == 0) {
  red[warp] = lsum;
}
VX_BARRIER();
if (tid == 0 && dc == 0) {
  float l_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < NWM; ++w) {
    l_sum += red[w];
  }
  m[row] = top * LN2;
  l[row] = l_sum;
}
