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
//   signs   lane (g, t) takes the contiguous words [t W, (t + 1) W) (W = n / 128) of an n-bit
//           sketch of tokens g and 8 + g. Bits j and j + 16 of a word are one f16x2 register
//           (the word inverted and shifted left by 15 - j, its bits 15 and 31 kept and OR-ed into
//           1.0: a set bit, a positive sign, is +1; a shift and one LOP3 a pair, exact); k-step i
//           takes pairs j = 2 (i % 8) (columns 2t, 2t + 1) and j + 1 (columns 2t + 8, 2t + 9) of
//           word i / 8. Sketches of a multiple of 32 bits end in up to two shared words after the
//           4 W whole ones: a 64-bit part (n % 128 >= 64: lane t takes pairs [8 (t & 1), + 8) of
//           its word 4 W + t / 2) and a 32-bit part (n % 64: pairs [4 t, + 4) of word 4 W + 2 if
//           there is a 64-bit part, else 4 W); such a word is loaded shifted right to its lane's
//           first pair, so that k-step 8 W + i' takes pairs 2 (i' % 4), + 1 of register W + i' / 4
//           (the m = 320, m_o = 64 sketches of velox-qjl's recommended keys). The host lays out
//           S q and S's rows in that order (velox_core.kernels.sketch_mma.order), which leaves
//           every inner product unchanged.
//   S P q   per outlier block, on the tensor cores too: S P q (8 query rows x m) = (P q)^T (8
//           rows x KOUT channels, padded to 16) S_P^T (KOUT x m), one MMA a chunk of 8 sketch
//           rows: A is the query rows' outlier coordinates (fp16 hi and lo parts, two MMAs, the
//           first with a zero accumulator), B the block's KOUT columns of S (the host's kst: S's
//           rows in the kernel's order, transposed, contiguous, fp16 as the codec keeps S).
//           Chunks 2i and 2i + 1 land in the C layout exactly as k-step i's B fragment wants
//           them (lane (g, t): row g, rows 2t, 2t + 1 of the chunk), so no transpose. The main
//           sketch's score is <S q - S P q, s>: with DIFF (an outlier sketch of columns of its
//           own) a block converts S q - S P q (S q from shared memory, float32), one MMA a
//           k-step; without DIFF it is <S q, s> - <S P q, s>, two MMAs on the same A, B = S q
//           made once and a block converting only S P q, which is also the outlier sketch's B
//           (SHARE) (the host's choice: velox_core.kernels.sketch_mma.b_diff). B goes in as fp16
//           plus its rounding residual
//           (BLO 1: two MMAs a k-step; BLO 2, at most 4 query rows: the residuals in B's
//           columns 4..7, one MMA, the two columns added by one shuffle).
//   loads   a tile's words, norms, value codes, scales and zeros (and its block's outlier
//           channels) are loaded AHEAD tiles ahead of their use (1; 2 where DIFF leaves the
//           registers), into registers, through 32-bit offsets within the (b, h) slice.
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
// bits of the main and the outlier sketch: multiples of 32; SKO 0 without outliers), KOUT
// (outlier channels per block, 0 to 16), KIB (bits of a packed channel index), KGRP (tokens per
// outlier block, a multiple of 16), SHARE (1: SKO == SKM, the outlier sketch's B fragments are
// the main's S P q; else kst holds SKO more columns), NSBF / VSBF (1: the key norms / the value
// scales and zeros are bfloat16, else fp16), VBITS (2, 4, 8), VGROUP (value channels per scale),
// QMUL (float32 bits of log2(e), times the attention scale for an unscaled query), CMB / COB
// (float32 bits of c / m and c / m_o), BLO (1: B as fp16 hi and lo parts, two MMAs a k-step;
// 2: the same with the lo parts in B's columns 4..7, one MMA a k-step, MROWS <= 4; 0: B
// rounded to fp16, about 2^-12 relative per entry), BSM (1: S q's B fragments in shared
// memory, see below), DIFF (1: the main sketch's B is S q - S P q per block, see below), AHEAD
// (tiles whose loads are in flight: 1 or 2, see below), NWARPS.
// Inputs: q (B, H, MROWS, HD) any float dtype; qs (B, H, MROWS, SKM) float32 = S q in the kernel's
// order; ks (B, H, T, SKM / 32), kn (B, H, T) norms; ko (B, H, T, SKO / 32), kon (B, H, T) outlier
// norms; kix (B, H, T / KGRP, W) packed outlier channels; kst (HD, SKM [+ SKO]) fp16, contiguous; vc, va, vb
// (B, H, T, ...) value codes, scales, zeros. Outputs: ml_part, o_part.

constexpr int SUB = 16;               // tokens of one MMA tile
constexpr int KSM = SKM / 16;         // k-steps of the main sketch
constexpr int KSO = SKO / 16;         // k-steps of the outlier sketch
constexpr int WM = SKM / 128;         // main sketch: whole words per lane and token
constexpr int WO = SKO / 128;         // outlier sketch: whole words per lane and token
// registers of a lane's sign words of a token: the whole words, then the shared ones (see the top)
constexpr int RM = WM + (SKM % 128) / 64 + (SKM % 64) / 32;
constexpr int RO = WO + (SKO % 128) / 64 + (SKO % 64) / 32;
constexpr int OCOL = SHARE ? 0 : SKM; // kst's first column of the outlier sketch
constexpr int NCOL = SKM + (SHARE ? 0 : SKO);  // kst's columns
constexpr int VCL = HD / 8;           // value channels per lane (lane g)
constexpr int VWL = VCL * VBITS / 32; // value code words per lane and token
constexpr int VCW = 32 / VBITS;       // channels per value word
constexpr int NTM = HD / 16;          // m-tiles of the value MMA
constexpr int VNGA = VCL > VGROUP ? VCL / VGROUP : 1;  // value groups a lane's channels meet
constexpr int NT = NWARPS * 32;
constexpr float NEG = -1.0e30f;
constexpr float RESCALE = 8.0f;
static_assert(SKM % 32 == 0 && SKO % 32 == 0 && SKM > 0, "sketches of whole 32-bit words");
static_assert(KOUT >= 0 && KOUT <= 16 && (KOUT == 0) == (SKO == 0), "0 to 16 outlier channels");
static_assert(KOUT == 0 || KGRP % SUB == 0, "outlier blocks of whole tiles");
static_assert(!SHARE || SKO == SKM, "SHARE: the outlier sketch takes the main one's columns");
static_assert(MROWS >= 1 && MROWS <= 8, "at most 8 query rows per KV head");
static_assert(AHEAD == 1 || AHEAD == 2, "tiles loaded 1 or 2 ahead");
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

// ---- shared memory: S q and the query (float32), S q's B fragments (BSM), later the warps' merge -
constexpr int BW = BLO == 1 ? 4 : 2;  // words of a k-step's B fragment a lane (BLO 1: + residuals)
constexpr int NBQ = BSM ? KSM * 32 * BW : 0;
// S q and q are held for QR rows, those past MROWS zero, so that no lane tests its row
// (with BLO 2 lane (g, t) takes row g & 3, else row g: every row < QR)
constexpr int QR = BLO == 2 ? 4 : 8;
constexpr int NQS = (KOUT > 0 ? QR * (SKM + HD) : QR * SKM) + NBQ;
constexpr int RED = NWARPS * 8 * HD;
constexpr int SMEM = NQS > RED ? NQS : RED;
VX_SHARED __align__(16) float smem[SMEM];
VX_SHARED float red_m[NWARPS * 8];
VX_SHARED float red_l[NWARPS * 8];
float* const sq_s = smem;            // (QR, SKM): S q
float* const q_s = smem + QR * SKM;  // (QR, HD): q (outliers only)
// (KSM, 32 lanes, BW): S q's B fragments (BSM 1)
unsigned int* const bq_s = reinterpret_cast<unsigned int*>(q_s + (KOUT > 0 ? QR * HD : 0));
{
  const int64_t sb = (int64_t)b * qs_strides[0] + (int64_t)h * qs_strides[1];
  for (int i = tid; i < QR * SKM; i += NT) {
    const int r = i / SKM;
    const int c = i - r * SKM;
    sq_s[i] = r < MROWS ? qs[sb + (int64_t)r * qs_strides[2] + (int64_t)c * qs_strides[3]] : 0.0f;
  }
  if (KOUT > 0) {
    const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1];
    for (int i = tid; i < QR * HD; i += NT) {
      const int r = i / HD;
      const int c = i - r * HD;
      q_s[i] = r < MROWS ? static_cast<float>(q[qb + (int64_t)r * q_strides[2] + (int64_t)c * q_strides[3]])
                         : 0.0f;
    }
  }
}
VX_BARRIER();

const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));
const float cm = vx_bits_to_float(static_cast<unsigned int>(CMB)) * qmul;
const float co = vx_bits_to_float(static_cast<unsigned int>(COB)) * qmul;
// BLO = 2: B columns 4..7 hold the residuals of rows 0..3 (lane (g, t): query row g & 3, its
// residual where g >= 4), so one MMA a k-step scores both parts, added by one shuffle
auto qrow_of = [](int gl) { return BLO == 2 ? (gl & 3) : gl; };
const int qr = qrow_of(g);
const bool lo_lane = BLO == 2 && g >= 4;
static_assert(BLO != 2 || MROWS <= 4, "BLO = 2: the residuals take B's columns 4..7");

// B fragments: S q (made once), and per outlier block S P q over the main sketch's columns
// (bsp; with SHARE also the outlier sketch's) and over the outlier sketch's own (bo, without
// SHARE). The main sketch's score is <S q, s> - <S P q, s> (the same A fragments twice), so
// a block converts only S P q. BLO 1: each as its fp16 rounding and the residual (two MMAs a
// k-step, about 2^-22 relative); BLO 2: the residual in the lanes of B's columns 4..7 (one MMA
// a k-step). BSM 1: S q's fragments are made once by the threadgroup into shared memory (one
// 8- or 16-byte load a k-step and lane), which leaves the registers to S P q's (for sketches
// whose fragments do not fit in registers together: velox_core.kernels.sketch_mma.frags_shared).
// DIFF 1 (outliers with sketch columns of their own): a block converts S q - S P q (S q from
// shared memory, float32) into bsp, the main sketch's whole B (one MMA a k-step for its score
// instead of two), and S q has no fragments
constexpr bool DIFFON = DIFF && KOUT > 0;
constexpr int KSP = KOUT > 0 ? KSM : 1;
constexpr int KSB = KOUT > 0 && !SHARE ? KSO : 1;
constexpr int KSQ = BSM || DIFFON ? 1 : KSM;
static_assert(!(DIFFON && (BSM || SHARE)), "DIFF: outlier columns of their own, no S q fragments");
unsigned int bin[KSQ][2], bin_lo[BLO == 1 ? KSQ : 1][2];
unsigned int bsp[KSP][2], bsp_lo[BLO == 1 ? KSP : 1][2];
unsigned int bo[KSB][2], bo_lo[BLO == 1 ? KSB : 1][2];
// x0, x1 as an f16x2 pair into hi[..] and (BLO 1) their rounding residual into lo[..] (BLO 2:
// the residual into hi[..] in a lane of B's columns 4..7, lol)
auto split2 = [&](float x0, float x1, unsigned int& hi, unsigned int& lo, bool lol) {
  const __half2 hh = __floats2half2_rn(x0, x1);
  hi = vx_h2u(hh);
  if (BLO) {
    const float2 hf = __half22float2(hh);
    const unsigned int r = vx_pack_h2(x0 - hf.x, x1 - hf.y);
    if (BLO == 1) {
      lo = r;
    } else if (lol) {
      hi = r;
    }
  }
};
// k-step i's S q entries of lane (gl, tl)'s query row: columns 16 i + 2 tl, + 1 (b0) and
// 16 i + 8 + 2 tl, + 1 (b1)
auto sq_at = [&](int i, int hi, int gl, int tl) {
  return *reinterpret_cast<const float2*>(sq_s + qrow_of(gl) * SKM + 16 * i + 8 * hi + 2 * tl);
};
if (BSM) {
  for (int e = tid; e < KSM * 32; e += NT) {  // e: k-step e / 32, lane e % 32
    const int gl = (e & 31) >> 2;
    unsigned int f[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float2 s = sq_at(e >> 5, hi, gl, e & 3);
      split2(s.x, s.y, f[hi], f[2 + hi], BLO == 2 && gl >= 4);
    }
#pragma unroll
    for (int w = 0; w < BW; ++w) {
      bq_s[e * BW + w] = f[w];
    }
  }
  VX_BARRIER();
} else if (!DIFFON) {
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float2 s = sq_at(i, hi, g, t);
      split2(s.x, s.y, bin[KSQ > 1 ? i : 0][hi], bin_lo[BLO == 1 && KSQ > 1 ? i : 0][hi], lo_lane);
    }
  }
}

// per outlier block: S P q by MMAs (see the top), then both sketches' B fragments
const int64_t kix_b = KOUT > 0 ? (int64_t)b * kix_strides[0] + (int64_t)h * kix_strides[1] : 0;
// the lane's outlier slots 2t, 2t + 1, 2t + 8, 2t + 9 of block blk (channel, or -1)
auto load_ix = [&](int blk, int (&ix)[4]) {
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
};
auto block_frags = [&](const int (&ix)[4]) {
  // A: the query rows' outlier coordinates (row g; rows 8..15 zero), fp16 hi and lo parts
  unsigned int ahi[2], alo[2];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const float x0 = ix[2 * p] >= 0 ? q_s[qr * HD + ix[2 * p]] : 0.0f;
    const float x1 = ix[2 * p + 1] >= 0 ? q_s[qr * HD + ix[2 * p + 1]] : 0.0f;
    const __half2 hh = __floats2half2_rn(x0, x1);
    const float2 hf = __half22float2(hh);
    ahi[p] = vx_h2u(hh);
    alo[p] = vx_pack_h2(x0 - hf.x, x1 - hf.y);
  }
  // chunk c: lane (g, t) holds S P q of row g at the chunk's columns 2t, 2t + 1
  // the lane's slots' rows of kst (contiguous, NCOL columns), at its column g: a chunk's
  // loads are these pointers at a constant offset (an unused slot reads row 0, times 0)
  const unsigned short* sp[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    sp[e] = reinterpret_cast<const unsigned short*>(kst) + (ix[e] < 0 ? 0 : ix[e]) * NCOL + g;
  }
  auto chunk = [&](int col0, float (&acc)[4]) {
    unsigned short sv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // slots 2t + 8.. exist only past 8 outliers
      sv[e] = KOUT > 8 || e < 2 ? sp[e][col0] : static_cast<unsigned short>(0);
    }
    const unsigned int b0 = static_cast<unsigned int>(sv[0]) | (static_cast<unsigned int>(sv[1]) << 16);
    const unsigned int b1 = static_cast<unsigned int>(sv[2]) | (static_cast<unsigned int>(sv[3]) << 16);
    vx_mma16816_zc(acc, ahi[0], 0u, ahi[1], 0u, b0, b1);
    vx_mma16816(acc, alo[0], 0u, alo[1], 0u, b0, b1);
  };
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float acc[4];
      chunk(8 * (2 * i + hi), acc);
      const int ip = KOUT > 0 ? i : 0;
      if (DIFFON) {
        const float2 sq = sq_at(i, hi, g, t);
        split2(sq.x - acc[0], sq.y - acc[1], bsp[ip][hi], bsp_lo[BLO == 1 ? ip : 0][hi], lo_lane);
      } else {
        split2(acc[0], acc[1], bsp[ip][hi], bsp_lo[BLO == 1 ? ip : 0][hi], lo_lane);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < (SHARE ? 0 : KSO); ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float acc[4];
      chunk(OCOL + 8 * (2 * i + hi), acc);
      split2(acc[0], acc[1], bo[KSB > 1 ? i : 0][hi], bo_lo[BLO == 1 && KSB > 1 ? i : 0][hi], lo_lane);
    }
  }
};

// bits j and j + 16 of the inverted word as an f16x2 pair of +-1 (a set sign bit: +1)
auto pm = [](unsigned int nx, int j) { return vx_and_or(nx << (15 - j), 0x80008000u, 0x3C003C00u); };
// register r of the lane's sign words of a token's n-bit sketch row (inverted; the shared words
// shifted to the lane's pairs) and, for k-step i, its register and pair (see the top)
auto sign_word = [&](const unsigned int* row, int s3, int n, int r) {
  const int w = n / 128;
  if (r < w) {
    return ~static_cast<unsigned int>(row[(t * w + r) * s3]);
  }
  if (r == w && n % 128 >= 64) {
    return ~static_cast<unsigned int>(row[(4 * w + (t >> 1)) * s3]) >> (8 * (t & 1));
  }
  return ~static_cast<unsigned int>(row[(4 * w + 2 * (n % 128 / 64)) * s3]) >> (4 * t);
};
auto kreg = [](int i, int n) { return i < n / 128 * 8 ? i / 8 : n / 128 + (i - n / 128 * 8) / 4; };
auto kpair = [](int i, int n) { return 2 * (i < n / 128 * 8 ? i % 8 : (i - n / 128 * 8) % 4); };

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
// each input's (b, h) slice and its strides within it as 32-bit ints (a head's slice of a
// cache buffer holds fewer than 2^31 elements)
const unsigned int* const ksh = ks + ks_b;
const unsigned int* const koh = KOUT > 0 ? ko + ko_b : ks;
const unsigned short* const knh = kn16 + kn_b;
const unsigned short* const konh = KOUT > 0 ? kon16 + kon_b : kn16;
const unsigned int* const vch = vc + vc_b;
const unsigned short* const vah = va16 + va_b;
const unsigned short* const vbh = vb16 + vb_b;
const int ks_s2 = static_cast<int>(ks_strides[2]), ks_s3 = static_cast<int>(ks_strides[3]);
const int ko_s2 = KOUT > 0 ? static_cast<int>(ko_strides[2]) : 0;
const int ko_s3 = KOUT > 0 ? static_cast<int>(ko_strides[3]) : 0;
const int kn_s2 = static_cast<int>(kn_strides[2]);
const int kon_s2 = KOUT > 0 ? static_cast<int>(kon_strides[2]) : 0;
const int vc_s2 = static_cast<int>(vc_strides[2]), vc_s3 = static_cast<int>(vc_strides[3]);
const int va_s2 = static_cast<int>(va_strides[2]), va_s3 = static_cast<int>(va_strides[3]);
const int vb_s2 = static_cast<int>(vb_strides[2]), vb_s3 = static_cast<int>(vb_strides[3]);

float oacc[NTM][4];
#pragma unroll
for (int j = 0; j < NTM; ++j) {
#pragma unroll
  for (int i = 0; i < 4; ++i) oacc[j][i] = 0.0f;
}
float mrow[2] = {NEG, NEG};
float lrow[2] = {0.0f, 0.0f};
int cur = -1;

// A tile's inputs as loaded (raw words and 16-bit units), AHEAD tiles ahead of their use: the
// loads of tile k + 1 (and k + 2) are in flight while tile k is computed
struct Raw {
  unsigned int wm[2][RM];                 // main sketch words of tokens g, 8 + g (sign_word)
  unsigned int wo[2][RO > 0 ? RO : 1];    // outlier sketch words
  unsigned short nm[2], no[2];            // norms of tokens g, 8 + g
  unsigned int vw[4][VWL];                // value words of tokens 2t, 2t + 1, 2t + 8, 2t + 9
  unsigned short vs[4][VNGA], vz[4][VNGA];  // their scales and zeros
  int ix[4];                              // the tile's outlier block's slots (load_ix)
};
auto load_tile = [&](int tb, Raw& r) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int tk = vx_imin(tb + 8 * n + g, T - 1);
#pragma unroll
    for (int w = 0; w < RM; ++w) {
      r.wm[n][w] = sign_word(ksh + tk * ks_s2, ks_s3, SKM, w);
    }
#pragma unroll
    for (int w = 0; w < RO; ++w) {
      r.wo[n][w] = sign_word(koh + tk * ko_s2, ko_s3, SKO, w);
    }
    r.nm[n] = knh[tk * kn_s2];
    r.no[n] = KOUT > 0 ? konh[tk * kon_s2] : static_cast<unsigned short>(0);
  }
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int tr = vx_imin(tb + 2 * t + (n & 1) + 8 * (n >> 1), T - 1);
#pragma unroll
    for (int w = 0; w < VWL; ++w) {
      r.vw[n][w] = vch[tr * vc_s2 + (g * VWL + w) * vc_s3];
    }
#pragma unroll
    for (int lg = 0; lg < VNGA; ++lg) {
      const int gi = VCL > VGROUP ? (g * VCL) / VGROUP + lg : vg0;
      r.vs[n][lg] = vah[tr * va_s2 + gi * va_s3];
      r.vz[n][lg] = vbh[tr * vb_s2 + gi * vb_s3];
    }
  }
  if (KOUT > 0) {
    load_ix(tb / KGRP, r.ix);
  }
};
// a stored 16-bit norm as a float; two stored scales (zeros) as an f16x2 pair (vx_s16h2)
auto n16f = [](unsigned short u) {
  return NSBF ? vx_bits_to_float(static_cast<unsigned int>(u) << 16)
              : __half2float(*reinterpret_cast<const __half*>(&u));
};
auto s16h2 = [](unsigned short a, unsigned short c) {
  if (VSBF) {
    return __floats2half2_rn(vx_bits_to_float(static_cast<unsigned int>(a) << 16),
                             vx_bits_to_float(static_cast<unsigned int>(c) << 16));
  }
  return vx_u2h(static_cast<unsigned int>(a) | (static_cast<unsigned int>(c) << 16));
};

// AHEAD 2: two tiles ahead (rn holds tile k + 1, loaded during tile k - 1; rn2 tile k + 2)
Raw rc, rn, rn2;
if (my0 < my1) {
  load_tile(t0 + my0 * SUB, rc);
}
if (AHEAD == 2 && my0 + 1 < my1) {
  load_tile(t0 + (my0 + 1) * SUB, rn);
}
for (int tile = my0; tile < my1; ++tile) {
  const int tb = t0 + tile * SUB;
  if (tile + AHEAD < my1) {
    load_tile(tb + AHEAD * SUB, AHEAD == 2 ? rn2 : rn);
  }
  if (KOUT > 0) {
    const int blk = tb / KGRP;
    if (blk != cur) {
      block_frags(rc.ix);
      cur = blk;
    }
  }
  // ---- scores: tokens g, 8 + g (rows clamped into the context; their weights are zeroed)
  float nm[2], no[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    nm[n] = n16f(rc.nm[n]) * cm;
    no[n] = KOUT > 0 ? n16f(rc.no[n]) * co : 0.0f;
  }
  // independent accumulator chains: <S q, s_in> (sa), <S P q, s_in> (sp), <S P q, s_o> (so);
  // BLO 1: hi parts and residuals in chains of their own
  float sa[2][4], sp[2][4], so[2][4];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sa[c][e] = 0.0f;
      sp[c][e] = 0.0f;
      so[c][e] = 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < KSM; ++i) {
    const int w = kreg(i, SKM);
    const int j = kpair(i, SKM);
    const unsigned int a0 = pm(rc.wm[0][w], j), a1 = pm(rc.wm[1][w], j);
    const unsigned int a2 = pm(rc.wm[0][w], j + 1), a3 = pm(rc.wm[1][w], j + 1);
    const int c = BLO == 1 ? 0 : i & 1;
    unsigned int bf[4];  // S q's B fragment (BLO 1: and its residuals); DIFF: S q - S P q
    if (DIFFON) {
      const int ip = KOUT > 0 ? i : 0;
      bf[0] = bsp[ip][0], bf[1] = bsp[ip][1];
      bf[2] = bsp_lo[BLO == 1 ? ip : 0][0], bf[3] = bsp_lo[BLO == 1 ? ip : 0][1];
    } else if (BSM && BLO == 1) {
      const uint4 f = reinterpret_cast<const uint4*>(bq_s)[i * 32 + lane];
      bf[0] = f.x, bf[1] = f.y, bf[2] = f.z, bf[3] = f.w;
    } else if (BSM) {
      const uint2 f = reinterpret_cast<const uint2*>(bq_s)[i * 32 + lane];
      bf[0] = f.x, bf[1] = f.y;
    } else {
      bf[0] = bin[KSQ > 1 ? i : 0][0], bf[1] = bin[KSQ > 1 ? i : 0][1];
      bf[2] = bin_lo[BLO == 1 && KSQ > 1 ? i : 0][0], bf[3] = bin_lo[BLO == 1 && KSQ > 1 ? i : 0][1];
    }
    vx_mma16816(sa[c], a0, a1, a2, a3, bf[0], bf[1]);
    if (BLO == 1) {
      vx_mma16816(sa[1], a0, a1, a2, a3, bf[2], bf[3]);
    }
    if (KOUT > 0 && !DIFFON) {
      const int ip = KOUT > 0 ? i : 0;
      vx_mma16816(sp[c], a0, a1, a2, a3, bsp[ip][0], bsp[ip][1]);
      if (BLO == 1) {
        vx_mma16816(sp[1], a0, a1, a2, a3, bsp_lo[BLO == 1 ? ip : 0][0], bsp_lo[BLO == 1 ? ip : 0][1]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < KSO; ++i) {
    const int w = kreg(i, SKO);
    const int j = kpair(i, SKO);
    const unsigned int a0 = pm(rc.wo[0][w], j), a1 = pm(rc.wo[1][w], j);
    const unsigned int a2 = pm(rc.wo[0][w], j + 1), a3 = pm(rc.wo[1][w], j + 1);
    const int c = BLO == 1 ? 0 : i & 1;
    // SHARE: the outlier sketch's B is the main one's S P q
    const unsigned int* b = SHARE ? bsp[KSP > 1 ? i : 0] : bo[KSB > 1 ? i : 0];
    vx_mma16816(so[c], a0, a1, a2, a3, b[0], b[1]);
    if (BLO == 1) {
      const unsigned int* bl = SHARE ? bsp_lo[BLO == 1 && KSP > 1 ? i : 0]
                                     : bo_lo[BLO == 1 && KSB > 1 ? i : 0];
      vx_mma16816(so[1], a0, a1, a2, a3, bl[0], bl[1]);
    }
  }
  // (BLO 2: lane t < 2 adds the residuals' columns from lane t + 2, which adds its own)
  float s4[4];
  bool v4[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = i >> 1;
    float ra = (sa[0][i] + sa[1][i]) - (KOUT > 0 && !DIFFON ? sp[0][i] + sp[1][i] : 0.0f);
    float ro = so[0][i] + so[1][i];
    if (BLO == 2) {
      ra += vx_shfl_xor(ra, 2);
      ro += KOUT > 0 ? vx_shfl_xor(ro, 2) : 0.0f;
    }
    s4[i] = nm[n] * ra + (KOUT > 0 ? no[n] * ro : 0.0f);
    v4[i] = tb + 8 * n + g < t1;
  }

  // ---- online softmax of rows 2t and 2t + 1 (decode_attention_mma.cu's lazy max)
  float lmax[2] = {NEG, NEG};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lmax[i & 1] = v4[i] ? vx_max(lmax[i & 1], s4[i]) : lmax[i & 1];
  }
  float alpha[2];
  vx_softmax_raise<NTM>(lmax, mrow, lrow, oacc, RESCALE, alpha);
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
  __half2 vs2[2][VNGA], vz2[2][VNGA];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int lg = 0; lg < VNGA; ++lg) {
      vs2[n][lg] = s16h2(rc.vs[2 * n][lg], rc.vs[2 * n + 1][lg]);
      vz2[n][lg] = s16h2(rc.vz[2 * n][lg], rc.vz[2 * n + 1][lg]);
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
      const unsigned int y = __byte_perm(rc.vw[2 * n][wl], rc.vw[2 * n + 1][wl], sel);
      af[e] = vx_dequant_at(y, bit & 7, VBITS, vs2[n][lg], vz2[n][lg]);
    }
    vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[0], pb[1]);
  }
  rc = rn;
  if (AHEAD == 2) {
    rn = rn2;
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
vx_store_warp_rows(red_m, red_l, warp, g, t, mrow, lrow);
VX_BARRIER();
const int64_t row0 = ((int64_t)bh * nsplit + split) * MROWS;
vx_merge_warps<NWARPS, MROWS, HD, NT>(tid, red_m, red_l, red_o, o_part, ml_part, row0);
