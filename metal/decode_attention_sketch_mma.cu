// Fused decode attention over QJL keys (sign sketches, arXiv 2406.03482) on NVIDIA tensor cores
// (sm_80 and later), with per-token affine values (2, 4 or 8 bits, fp16 or bfloat16 scales):
// the CUDA twin of decode_attention.metal's sketch keys (KKIND 3) for the layouts below. Same
// per-split partials, merged by decode_merge.metal or decode_merge_fp16.metal. A twin because
// the tensor-core fragments (mma.sync, PTX layouts) have no Metal spelling.
//
// A key's score is c/m ||k_in|| <S q - S P q, sign(S k_in)> + c/m_o ||k_o|| <S P q, sign(S k_o)>
// (P: the block's outlier channels; the outlier sketch takes the first m_o rows of S). The signs
// are +-1, so both inner products are matrix products: per 16-token tile, transposed,
// S^T (16 tokens x 8 query rows) = A (16 x m: the tokens' signs as fp16 +-1) B (m x 8: the
// sketched query), m / 16 m16n8k16 MMAs for the main sketch and m_o / 16 for the outlier one.
//
// Grid: x = split of the context, y = b * H + h. Threadgroup: NWARPS warps; warp w takes a
// contiguous run of the split's 16-token tiles, so that consecutive tiles share an outlier block.
// Lane = 4 g + t (g = groupID, t = threadID_in_group of the PTX fragment layouts).
//   signs   lane (g, t) takes the contiguous words [t W, (t + 1) W) (W = m / 128) of tokens g and
//           8 + g. Bits j and j + 16 of a word are one f16x2 register (the word inverted and
//           shifted left by 15 - j, its bits 15 and 31 kept and OR-ed into 1.0: a set bit, a
//           positive sign, is +1; a shift and one LOP3 a pair, exact); k-step i takes pairs j = 2
//           (i % 8) (columns 2t, 2t + 1) and j + 1 (columns 2t + 8, 2t + 9) of word i / 8. The
//           host lays out S q and S's rows in that order (velox_core.kernels.sketch_mma.order),
//           which leaves every inner product unchanged.
//   S P q   per outlier block, on the tensor cores too: S P q (8 query rows x m) = (P q)^T (8
//           rows x KOUT channels, padded to 16) S_P^T (KOUT x m), one MMA a chunk of 8 sketch
//           rows: A is the query rows' outlier coordinates (fp16 hi and lo parts, two MMAs into
//           one accumulator), B the block's KOUT columns of S (the host's kst: S's rows in the
//           kernel's order, transposed, fp16 as the codec keeps S). Chunks 2i and 2i + 1 land in
//           the C layout exactly as k-step i's B fragment wants them (lane (g, t): row g, rows
//           2t, 2t + 1 of the chunk), so no transpose: the main sketch's B is S q - S P q (S q
//           from shared memory, float32) and the outlier sketch's S P q, each rounded once to
//           fp16. Without outliers B is S q, made once.
//   softmax online per query row (log2 units) as decode_attention_mma.cu's: a lane's two rows,
//           a running max raised lazily (by more than RESCALE), weights rounded to fp16 and
//           made the B fragment of P^T by one transposing move per 8 x 8 block (movmatrix).
//   values  O^T (HD x 8 rows) += V^T (HD x 16 tokens) P^T: lane (g, t) decodes channels
//           [g HD/8, (g + 1) HD/8) of tokens 2t, 2t + 1, 2t + 8, 2t + 9 (the two tokens' code
//           bytes put together by one byte permute, then scale * code + zero in fp16,
//           vx_dequant_at), m-tile j taking its channels 2j and 2j + 1.
// Partials as decode_attention.metal's: o_part (B, H, S, MROWS, HD) = sum_t 2^(s_t - m) v_t,
// ml_part (B, H, S, MROWS, 2) = (m, l) in log2 units.
//
// Template constants: HD (head dim), MROWS (query rows per KV head, 1 to 8), SKM / SKO (sign
// bits of the main and the outlier sketch: multiples of 128; SKO 0 without outliers), KOUT
// (outlier channels per block, 0 to 16), KIB (bits of a packed channel index), KGRP (tokens per
// outlier block, a multiple of 16), SHARE (1: SKO == SKM, the outlier sketch's B fragments are
// the main's S P q; else kst holds SKO more columns), NSBF / VSBF (1: the key norms / the value
// scales and zeros are bfloat16, else fp16), VBITS (2, 4, 8), VGROUP (value channels per scale),
// QMUL (float32 bits of log2(e), times the attention scale for an unscaled query), CMB / COB
// (float32 bits of c / m and c / m_o), BLO (1: B as fp16 hi and lo parts, two MMAs a k-step;
// 0: B rounded to fp16, about 2^-12 relative per entry), NWARPS.
// Inputs: q (B, H, MROWS, HD) any float dtype; qs (B, H, MROWS, SKM) float32 = S q in the kernel's
// order; ks (B, H, T, SKM / 32), kn (B, H, T) norms; ko (B, H, T, SKO / 32), kon (B, H, T) outlier
// norms; kix (B, H, T / KGRP, W) packed outlier channels; kst (HD, SKM [+ SKO]) fp16; vc, va, vb
// (B, H, T, ...) value codes, scales, zeros. Outputs: ml_part, o_part.

constexpr int SUB = 16;               // tokens of one MMA tile
constexpr int KSM = SKM / 16;         // k-steps of the main sketch
constexpr int KSO = SKO / 16;         // k-steps of the outlier sketch
constexpr int WM = SKM / 128;         // main sketch words per lane and token
constexpr int WO = SKO / 128;         // outlier sketch words per lane and token
constexpr int OCOL = SHARE ? 0 : SKM; // kst's first column of the outlier sketch
constexpr int VCL = HD / 8;           // value channels per lane (lane g)
constexpr int VWL = VCL * VBITS / 32; // value code words per lane and token
constexpr int VCW = 32 / VBITS;       // channels per value word
constexpr int NTM = HD / 16;          // m-tiles of the value MMA
constexpr int VG = HD / VGROUP;       // value scales per token
constexpr int NT = NWARPS * 32;
constexpr float NEG = -1.0e30f;
constexpr float RESCALE = 8.0f;
static_assert(SKM % 128 == 0 && SKO % 128 == 0 && SKM > 0, "sketches of whole 128-bit rows a lane");
static_assert(KOUT >= 0 && KOUT <= 16 && (KOUT == 0) == (SKO == 0), "0 to 16 outlier channels");
static_assert(KOUT == 0 || KGRP % SUB == 0, "outlier blocks of whole tiles");
static_assert(!SHARE || SKO == SKM, "SHARE: the outlier sketch takes the main one's columns");
static_assert(MROWS >= 1 && MROWS <= 8, "at most 8 query rows per KV head");
static_assert(HD % 16 == 0 && VWL * 32 == VCL * VBITS && VWL >= 1, "whole value words a lane");
static_assert(VCL <= VGROUP ? VGROUP % VCL == 0 : VCL % VGROUP == 0, "a lane's channels meet whole groups");

const int tid = vx_tid;
const int lane = tid & 31;
const int warp = tid >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int nsplit = vx_ngx;
const int split = vx_gx;
const int bh = vx_gy;
const int H = ks_shape[1];
const int T = ks_shape[2];
const int b = bh / H;
const int h = bh - b * H;
constexpr int ALIGN = KOUT > 0 && KGRP > SUB ? KGRP : SUB;  // splits of whole blocks
const int span = ((T + nsplit - 1) / nsplit + ALIGN - 1) / ALIGN * ALIGN;
const int t0 = split * span;
const int t1 = vx_imin(T, t0 + span);
const int ntiles = t1 > t0 ? (t1 - t0 + SUB - 1) / SUB : 0;
const int per = (ntiles + NWARPS - 1) / NWARPS;
const int my0 = vx_imin(ntiles, warp * per);
const int my1 = vx_imin(ntiles, my0 + per);

// ---- shared memory: S q and the query (float32), later the warps' merge --------------------------
constexpr int NQS = KOUT > 0 ? MROWS * (SKM + HD) : MROWS * SKM;
constexpr int RED = NWARPS * 8 * HD;
constexpr int SMEM = NQS > RED ? NQS : RED;
VX_SHARED __align__(16) float smem[SMEM];
VX_SHARED float red_m[NWARPS * 8];
VX_SHARED float red_l[NWARPS * 8];
float* const sq_s = smem;              // (MROWS, SKM): S q
float* const q_s = smem + MROWS * SKM; // (MROWS, HD): q (outliers only)
{
  const int64_t sb = (int64_t)b * qs_strides[0] + (int64_t)h * qs_strides[1];
  for (int i = tid; i < MROWS * SKM; i += NT) {
    const int r = i / SKM;
    const int c = i - r * SKM;
    sq_s[i] = qs[sb + (int64_t)r * qs_strides[2] + (int64_t)c * qs_strides[3]];
  }
  if (KOUT > 0) {
    const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1];
    for (int i = tid; i < MROWS * HD; i += NT) {
      const int r = i / HD;
      const int c = i - r * HD;
      q_s[i] = static_cast<float>(q[qb + (int64_t)r * q_strides[2] + (int64_t)c * q_strides[3]]);
    }
  }
}
VX_BARRIER();

const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));
const float cm = vx_bits_to_float(static_cast<unsigned int>(CMB)) * qmul;
const float co = vx_bits_to_float(static_cast<unsigned int>(COB)) * qmul;
const bool qrow = g < MROWS;

// B fragments of the main sketch (S q, less S P q with outliers) and of the outlier sketch;
// BLO: each as its fp16 rounding and the residual (two MMAs a k-step, about 2^-22 relative)
unsigned int bin[KSM][2], bin_lo[BLO ? KSM : 1][2];
unsigned int bo[KSO > 0 ? KSO : 1][2], bo_lo[BLO && KSO > 0 ? KSO : 1][2];
// x0, x1 as an f16x2 pair into hi[..] and (BLO) their rounding residual into lo[..]
auto split2 = [](float x0, float x1, unsigned int& hi, unsigned int& lo) {
  const __half2 hh = __floats2half2_rn(x0, x1);
  hi = vx_h2u(hh);
  if (BLO) {
    const float2 hf = __half22float2(hh);
    lo = vx_pack_h2(x0 - hf.x, x1 - hf.y);
  }
};
// k-step i's S q entries of row g: columns 16 i + 2t, + 1 (b0) and 16 i + 8 + 2t, + 1 (b1)
auto sq_at = [&](int i, int hi) {
  return qrow ? *reinterpret_cast<const float2*>(sq_s + g * SKM + 16 * i + 8 * hi + 2 * t)
              : float2{0.0f, 0.0f};
};
if (KOUT == 0) {
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float2 s = sq_at(i, hi);
      split2(s.x, s.y, bin[i][hi], bin_lo[BLO ? i : 0][hi]);
    }
  }
}

// per outlier block: S P q by MMAs (see the top), then both sketches' B fragments
const int64_t kix_b = KOUT > 0 ? (int64_t)b * kix_strides[0] + (int64_t)h * kix_strides[1] : 0;
auto block_frags = [&](int blk) {
  int ix[4];  // the lane's outlier slots 2t, 2t + 1, 2t + 8, 2t + 9 (channel, or -1)
  const int64_t ib = kix_b + (int64_t)blk * kix_strides[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int slot = 2 * t + (e & 1) + 8 * (e >> 1);
    ix[e] = -1;
    if (slot < KOUT) {
      const int bit = slot * KIB;
      const int wi = bit >> 5;
      const int sh = bit & 31;
      unsigned int x = static_cast<unsigned int>(kix[ib + (int64_t)wi * kix_strides[3]]) >> sh;
      if (sh + KIB > 32) {
        x |= static_cast<unsigned int>(kix[ib + (int64_t)(wi + 1) * kix_strides[3]]) << (32 - sh);
      }
      ix[e] = static_cast<int>(x & ((1u << KIB) - 1u));
    }
  }
  // A: the query rows' outlier coordinates (row g; rows 8..15 zero), fp16 hi and lo parts
  unsigned int ahi[2], alo[2];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const float x0 = qrow && ix[2 * p] >= 0 ? q_s[g * HD + ix[2 * p]] : 0.0f;
    const float x1 = qrow && ix[2 * p + 1] >= 0 ? q_s[g * HD + ix[2 * p + 1]] : 0.0f;
    const __half2 hh = __floats2half2_rn(x0, x1);
    const float2 hf = __half22float2(hh);
    ahi[p] = vx_h2u(hh);
    alo[p] = vx_pack_h2(x0 - hf.x, x1 - hf.y);
  }
  // chunk c: lane (g, t) holds S P q of row g at the chunk's columns 2t, 2t + 1
  auto chunk = [&](int col0, float (&acc)[4]) {
    unsigned short sv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sv[e] = ix[e] >= 0 ? reinterpret_cast<const unsigned short*>(kst)[
                               (int64_t)ix[e] * kst_strides[0] + (int64_t)(col0 + g) * kst_strides[1]]
                         : static_cast<unsigned short>(0);
    }
    const unsigned int b0 = static_cast<unsigned int>(sv[0]) | (static_cast<unsigned int>(sv[1]) << 16);
    const unsigned int b1 = static_cast<unsigned int>(sv[2]) | (static_cast<unsigned int>(sv[3]) << 16);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = 0.0f;
    vx_mma16816(acc, ahi[0], 0u, ahi[1], 0u, b0, b1);
    vx_mma16816(acc, alo[0], 0u, alo[1], 0u, b0, b1);
  };
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float acc[4];
      chunk(8 * (2 * i + hi), acc);
      const float2 s = sq_at(i, hi);
      split2(s.x - acc[0], s.y - acc[1], bin[i][hi], bin_lo[BLO ? i : 0][hi]);
      if (SHARE) {
        split2(acc[0], acc[1], bo[i < KSO ? i : 0][hi], bo_lo[BLO && i < KSO ? i : 0][hi]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < (SHARE ? 0 : KSO); ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float acc[4];
      chunk(OCOL + 8 * (2 * i + hi), acc);
      split2(acc[0], acc[1], bo[i][hi], bo_lo[BLO ? i : 0][hi]);
    }
  }
};

// bits j and j + 16 of the inverted word as an f16x2 pair of +-1 (a set sign bit: +1)
auto pm = [](unsigned int nx, int j) { return vx_and_or(nx << (15 - j), 0x80008000u, 0x3C003C00u); };

const int64_t ks_b = (int64_t)b * ks_strides[0] + (int64_t)h * ks_strides[1];
const int64_t kn_b = (int64_t)b * kn_strides[0] + (int64_t)h * kn_strides[1];
const int64_t ko_b = KOUT > 0 ? (int64_t)b * ko_strides[0] + (int64_t)h * ko_strides[1] : 0;
const int64_t kon_b = KOUT > 0 ? (int64_t)b * kon_strides[0] + (int64_t)h * kon_strides[1] : 0;
const int64_t vc_b = (int64_t)b * vc_strides[0] + (int64_t)h * vc_strides[1];
const int64_t va_b = (int64_t)b * va_strides[0] + (int64_t)h * va_strides[1];
const int64_t vb_b = (int64_t)b * vb_strides[0] + (int64_t)h * vb_strides[1];
const unsigned short* const kn16 = reinterpret_cast<const unsigned short*>(kn);
const unsigned short* const kon16 = reinterpret_cast<const unsigned short*>(kon);
const unsigned short* const va16 = reinterpret_cast<const unsigned short*>(va);
const unsigned short* const vb16 = reinterpret_cast<const unsigned short*>(vb);
const int vg0 = VCL > VGROUP ? 0 : (g * VCL) / VGROUP;  // the lane's first value group

float oacc[NTM][4];
#pragma unroll
for (int j = 0; j < NTM; ++j) {
#pragma unroll
  for (int i = 0; i < 4; ++i) oacc[j][i] = 0.0f;
}
float mrow[2] = {NEG, NEG};
float lrow[2] = {0.0f, 0.0f};
int cur = -1;

for (int tile = my0; tile < my1; ++tile) {
  const int tb = t0 + tile * SUB;
  if (KOUT > 0) {
    const int blk = tb / KGRP;
    if (blk != cur) {
      block_frags(blk);
      cur = blk;
    }
  }
  // ---- scores: tokens g, 8 + g (rows clamped into the context; their weights are zeroed)
  int tk[2];
  unsigned int wm[2][WM], wo[2][WO > 0 ? WO : 1];
  float nm[2], no[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    tk[n] = vx_imin(tb + 8 * n + g, T - 1);
#pragma unroll
    for (int w = 0; w < WM; ++w) {
      wm[n][w] = ~static_cast<unsigned int>(
          ks[ks_b + (int64_t)tk[n] * ks_strides[2] + (int64_t)(t * WM + w) * ks_strides[3]]);
    }
#pragma unroll
    for (int w = 0; w < WO; ++w) {
      wo[n][w] = ~static_cast<unsigned int>(
          ko[ko_b + (int64_t)tk[n] * ko_strides[2] + (int64_t)(t * WO + w) * ko_strides[3]]);
    }
    nm[n] = vx_s16f<NSBF>(kn16 + kn_b + (int64_t)tk[n] * kn_strides[2]) * cm;
    no[n] = KOUT > 0 ? vx_s16f<NSBF>(kon16 + kon_b + (int64_t)tk[n] * kon_strides[2]) * co : 0.0f;
  }
  float sa[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  float so[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
    const int w = i / 8;
    const int j = 2 * (i % 8);
    const unsigned int a0 = pm(wm[0][w], j), a1 = pm(wm[1][w], j);
    const unsigned int a2 = pm(wm[0][w], j + 1), a3 = pm(wm[1][w], j + 1);
    vx_mma16816(sa[BLO ? 0 : i & 1], a0, a1, a2, a3, bin[i][0], bin[i][1]);
    if (BLO) {
      vx_mma16816(sa[1], a0, a1, a2, a3, bin_lo[BLO ? i : 0][0], bin_lo[BLO ? i : 0][1]);
    }
  }
#pragma unroll
  for (int i = 0; i < KSO; ++i) {
    const int w = i / 8;
    const int j = 2 * (i % 8);
    const unsigned int a0 = pm(wo[0][w], j), a1 = pm(wo[1][w], j);
    const unsigned int a2 = pm(wo[0][w], j + 1), a3 = pm(wo[1][w], j + 1);
    vx_mma16816(so, a0, a1, a2, a3, bo[i][0], bo[i][1]);
    if (BLO) {
      vx_mma16816(so, a0, a1, a2, a3, bo_lo[BLO ? i : 0][0], bo_lo[BLO ? i : 0][1]);
    }
  }
  // element i: token g + 8 (i >> 1), query row 2t + (i & 1)
  float s4[4];
  bool v4[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = i >> 1;
    s4[i] = nm[n] * (sa[0][i] + sa[1][i]) + (KOUT > 0 ? no[n] * so[i] : 0.0f);
    v4[i] = tb + 8 * n + g < t1;
  }

  // ---- online softmax of rows 2t and 2t + 1 (decode_attention_mma.cu's lazy max)
  float lmax[2] = {NEG, NEG};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lmax[i & 1] = v4[i] ? vx_max(lmax[i & 1], s4[i]) : lmax[i & 1];
  }
  if (vx_any(lmax[0] > mrow[0] + RESCALE || lmax[1] > mrow[1] + RESCALE)) {
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float tmax = vx_max(lmax[c], vx_shfl_xor(lmax[c], 4));
      tmax = vx_max(tmax, vx_shfl_xor(tmax, 8));
      tmax = vx_max(tmax, vx_shfl_xor(tmax, 16));
      const float mnew = vx_max(mrow[c], tmax);
      alpha[c] = vx_exp2_ftz(mrow[c] - mnew);
      lrow[c] *= alpha[c];
      mrow[c] = mnew;
    }
#pragma unroll
    for (int j = 0; j < NTM; ++j) {
      oacc[j][0] *= alpha[0];
      oacc[j][1] *= alpha[1];
      oacc[j][2] *= alpha[0];
      oacc[j][3] *= alpha[1];
    }
  }
  unsigned int pb[2];  // P^T's B fragment: tokens 2t, 2t + 1 and 2t + 8, 2t + 9 of row g
  {
    float p4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p4[i] = v4[i] ? vx_exp2_ftz(s4[i] - mrow[i & 1]) : 0.0f;
      lrow[i & 1] += p4[i];
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      pb[n] = vx_movmatrix_trans(vx_pack_h2(p4[2 * n], p4[2 * n + 1]));
    }
  }

  // ---- values: the lane's words of tokens 2t, 2t + 1, 2t + 8, 2t + 9, scales as token pairs
  unsigned int vw[4][VWL];
  __half2 vs2[2][VCL > VGROUP ? VCL / VGROUP : 1], vz2[2][VCL > VGROUP ? VCL / VGROUP : 1];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int tr = vx_imin(tb + 2 * t + (n & 1) + 8 * (n >> 1), T - 1);
#pragma unroll
    for (int w = 0; w < VWL; ++w) {
      vw[n][w] = vc[vc_b + (int64_t)tr * vc_strides[2] + (int64_t)(g * VWL + w) * vc_strides[3]];
    }
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int64_t ta = vx_imin(tb + 2 * t + 8 * n, T - 1);
    const int64_t tc = vx_imin(tb + 2 * t + 8 * n + 1, T - 1);
#pragma unroll
    for (int lg = 0; lg < (VCL > VGROUP ? VCL / VGROUP : 1); ++lg) {
      const int gi = VCL > VGROUP ? (g * VCL) / VGROUP + lg : vg0;
      vs2[n][lg] = vx_s16h2<VSBF>(va16 + va_b + ta * va_strides[2] + (int64_t)gi * va_strides[3],
                                  va16 + va_b + tc * va_strides[2] + (int64_t)gi * va_strides[3]);
      vz2[n][lg] = vx_s16h2<VSBF>(vb16 + vb_b + ta * vb_strides[2] + (int64_t)gi * vb_strides[3],
                                  vb16 + vb_b + tc * vb_strides[2] + (int64_t)gi * vb_strides[3]);
    }
  }
#pragma unroll
  for (int j = 0; j < NTM; ++j) {
    unsigned int af[4];  // A fragment of V^T: (channel 2j | 2j + 1) x (token pair 0 | 1)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ch = 2 * j + (e & 1);
      const int n = e >> 1;
      const int wl = ch / VCW;
      const int bit = (ch - wl * VCW) * VBITS;
      const int bi = bit >> 3;
      const int sel = bi | (bi << 4) | ((4 + bi) << 8) | ((4 + bi) << 12);
      const int lg = VCL > VGROUP ? ch / VGROUP : 0;
      const unsigned int y = __byte_perm(vw[2 * n][wl], vw[2 * n + 1][wl], sel);
      af[e] = vx_dequant_at(y, bit & 7, VBITS, vs2[n][lg], vz2[n][lg]);
    }
    vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[0], pb[1]);
  }
}

// ---- merge the warps: row r's (m, l) and its HD outputs, through shared memory -------------------
#pragma unroll
for (int c = 0; c < 2; ++c) {
  lrow[c] += vx_shfl_xor(lrow[c], 4);
  lrow[c] += vx_shfl_xor(lrow[c], 8);
  lrow[c] += vx_shfl_xor(lrow[c], 16);
}
VX_BARRIER();  // every warp is done with S q and the query: the buffer becomes the merge's
float* const red_o = smem;
#pragma unroll
for (int j = 0; j < NTM; ++j) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    red_o[(warp * 8 + 2 * t + (i & 1)) * HD + g * VCL + 2 * j + (i >> 1)] = oacc[j][i];
  }
}
if (g == 0) {
  red_m[warp * 8 + 2 * t] = mrow[0];
  red_m[warp * 8 + 2 * t + 1] = mrow[1];
  red_l[warp * 8 + 2 * t] = lrow[0];
  red_l[warp * 8 + 2 * t + 1] = lrow[1];
}
VX_BARRIER();
const int64_t row0 = ((int64_t)bh * nsplit + split) * MROWS;
for (int i = tid; i < MROWS * HD; i += NT) {
  const int r = i / HD;
  const int d = i - r * HD;
  float top = NEG;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    top = vx_max(top, red_m[w * 8 + r]);
  }
  float o_sum = 0.0f;
  float l_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    const float wt = vx_exp2(red_m[w * 8 + r] - top);
    o_sum += red_o[(w * 8 + r) * HD + d] * wt;
    l_sum += red_l[w * 8 + r] * wt;
  }
  o_part[(row0 + r) * HD + d] = o_sum;
  if (d == 0) {
    ml_part[(row0 + r) * 2] = top;
    ml_part[(row0 + r) * 2 + 1] = l_sum;
  }
}
