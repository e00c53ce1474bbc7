// Merge of a decode kernel's per-split partials with up to two fp16 segments (a cache's
// attention sinks and its recent window) into the normalized attention output: one softmax
// over the coded context and the fp16 tokens, in one launch instead of the partial of each
// fp16 segment and a log-sum-exp merge in separate MLX operations. Body written once for
// Metal and CUDA (see velox_kernels.h); decode_merge.metal is the same merge without the fp16
// segments and without the normalization.
//
// Grid: x = (query row, chunk of 32 channels) per threadgroup of 256 threads (8 warps), as
// decode_merge.metal. Each threadgroup first scores the fp16 tokens against its query row
// (the warps take tokens, the lanes channels, a shuffle reduction) into threadgroup memory,
// then takes the max over the splits and the fp16 tokens, sums the fp16 tokens' weighted
// values and the splits' weighted partials for its 32 channels, and divides by the total.
//
// Inputs: o_part (B, H, S, MP, HD) and ml_part (B, H, S, MP, 2) as decode_merge.metal;
// q (B, H, MP, HD) the queries the decode kernel took, scaled by QMUL (the float32 bits of
// log2(e), times the attention scale when q comes unscaled; any float dtype);
// ak, av (B, H, Ta, HD) and bk, bv (B, H, Tb, HD): the fp16 segments (any float dtype, read
// through their strides), used when HAS_A / HAS_B (else 8-element dummies).
// Outputs: o (B, H, MP, HD) in the output dtype, the normalized attention; m (B, H, MP, 1) the
// max in natural-log units and l (B, H, MP, 1) the sum relative to it (float32).
// rot (RD, RD) float32, used when RD > 1 (else an 8-element dummy): the decode kernel's
// partials are in a rotated domain (values mixed as rotated levels); their
// weighted sum over the splits, for every channel, is rotated back here (out = sum_j o_j
// rot[j, :]) before the fp16 tokens' values, which are in the model's domain, are added;
// q is then the unrotated query (the fp16 keys are unrotated).
// Template: HAS_A, HAS_B (0 or 1); FMAX, the most fp16 tokens (their scores are kept in
// threadgroup memory; the host checks Ta + Tb <= FMAX); QMUL (above); RD (1, or the head dim
// of rot).

constexpr int NTM = 256;
constexpr int NWM = NTM / 32;
constexpr int CHUNK = 1024;
constexpr float NEG = -1.0e30f;
constexpr float LN2 = 0.6931471805599453f;

const int tid = vx_tid;
const int lane = tid & 31;
const int warp = tid >> 5;
const int H = ml_part_shape[1];
const int S = ml_part_shape[2];
const int MP = ml_part_shape[3];
const int HD = o_part_shape[4];
const int nd = (HD + 31) / 32;
const int row = vx_gx / nd;
const int dc = vx_gx - row * nd;
const int bh = row / MP;
const int mrow = row - bh * MP;
const int b = bh / H;
const int h = bh - b * H;
const int64_t base = (int64_t)bh * S * MP + mrow;  // (bh, s = 0, mrow) in rows of (B*H, S, MP)
const int d = dc * 32 + lane;
const int na = HAS_A ? ak_shape[2] : 0;
const int nb = HAS_B ? bk_shape[2] : 0;
const int nf = na + nb;

VX_SHARED float wsh[CHUNK];
VX_SHARED float fsc[FMAX];
VX_SHARED float red[NWM * 32];
VX_SHARED float orot[RD];  // RD > 1: every channel's weighted sum of the rotated partials

// the fp16 tokens' scores against this row's query (log2 units)
{
  const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1] +
                     (int64_t)mrow * q_strides[2];
  for (int f = warp; f < nf; f += NWM) {
    float s = 0.0f;
    if (HAS_A && f < na) {
      const int64_t kb0 = (int64_t)b * ak_strides[0] + (int64_t)h * ak_strides[1] +
                          (int64_t)f * ak_strides[2];
      for (int c = lane; c < HD; c += 32) {
        s += static_cast<float>(q[qb + (int64_t)c * q_strides[3]]) *
             static_cast<float>(ak[kb0 + (int64_t)c * ak_strides[3]]);
      }
    } else if (HAS_B) {
      const int64_t kb0 = (int64_t)b * bk_strides[0] + (int64_t)h * bk_strides[1] +
                          (int64_t)(f - na) * bk_strides[2];
      for (int c = lane; c < HD; c += 32) {
        s += static_cast<float>(q[qb + (int64_t)c * q_strides[3]]) *
             static_cast<float>(bk[kb0 + (int64_t)c * bk_strides[3]]);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      s += vx_shfl_xor(s, off);
    }
    if (lane == 0) {
      fsc[f] = s * vx_bits_to_float(static_cast<unsigned int>(QMUL));
    }
  }
}
VX_BARRIER();

// the max over the splits and the fp16 tokens
float top = NEG;
for (int s = tid; s < S; s += NTM) {
  top = vx_max(top, ml_part[(base + (int64_t)s * MP) * 2]);
}
for (int f = tid; f < nf; f += NTM) {
  top = vx_max(top, fsc[f]);
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

// the fp16 tokens: weights in place (and their sum), then their weighted values
float lsum = 0.0f;
for (int f = tid; f < nf; f += NTM) {
  const float p = vx_exp2(fsc[f] - top);
  fsc[f] = p;
  lsum += p;
}
VX_BARRIER();
float acc = 0.0f;
if (d < HD) {
  for (int f = warp; f < nf; f += NWM) {
    float v;
    if (HAS_A && f < na) {
      v = static_cast<float>(av[(int64_t)b * av_strides[0] + (int64_t)h * av_strides[1] +
                                (int64_t)f * av_strides[2] + (int64_t)d * av_strides[3]]);
    } else {
      v = HAS_B ? static_cast<float>(bv[(int64_t)b * bv_strides[0] + (int64_t)h * bv_strides[1] +
                                        (int64_t)(f - na) * bv_strides[2] +
                                        (int64_t)d * bv_strides[3]])
                : 0.0f;
    }
    acc += fsc[f] * v;
  }
}

// the splits, one chunk of them at a time
if (RD > 1) {
  for (int j = tid; j < RD; j += NTM) {
    orot[j] = 0.0f;
  }
}
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
  if (RD > 1) {  // rotated partials: every channel (one thread each), rotated back below
    for (int j = tid; j < RD; j += NTM) {
      float sj = orot[j];
      for (int i = 0; i < cn; ++i) {
        sj += o_part[(base + (int64_t)(c0 + i) * MP) * HD + j] * wsh[i];
      }
      orot[j] = sj;
    }
  } else if (d < HD) {
    for (int i = warp; i < cn; i += NWM) {
      acc += o_part[(base + (int64_t)(c0 + i) * MP) * HD + d] * wsh[i];
    }
  }
}

// the total sum first, then the channels divided by it
#pragma unroll
for (int off = 16; off > 0; off >>= 1) {
  lsum += vx_shfl_xor(lsum, off);
}
VX_BARRIER();  // every thread has read red[] (the max) before it is reused
if (lane == 0) {
  red[warp] = lsum;
}
VX_BARRIER();
float l_tot = 0.0f;
#pragma unroll
for (int w = 0; w < NWM; ++w) {
  l_tot += red[w];
}
VX_BARRIER();  // every thread has read the sums
red[warp * 32 + lane] = acc;
VX_BARRIER();
if (warp == 0) {
  float o_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < NWM; ++w) {
    o_sum += red[w * 32 + lane];
  }
  if (RD > 1 && d < HD) {  // the splits' sum rotated back: sum_j orot[j] rot[j, d]
    for (int j = 0; j < RD; ++j) {
      o_sum += orot[j] * rot[(int64_t)j * RD + d];
    }
  }
  if (d < HD) {
    o[(int64_t)row * HD + d] = o_sum / l_tot;
  }
}
if (tid == 0 && dc == 0) {
  m[row] = top * LN2;
  l[row] = l_tot;
}
