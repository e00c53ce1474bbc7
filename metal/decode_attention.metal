// Fused decode attention over packed codes, one split of the context per threadgroup
// (flash-decoding). Body written once for Metal and CUDA (see velox_kernels.h).
//
// Grid: x = split (threadgroups), y = b * H + h, z = block of MB query rows.
// Threadgroup: NWARPS * 32 threads. Inside a warp, LPT lanes share one token (lane j holds
// channels [j*CPL, (j+1)*CPL) of it), so one load instruction of a warp reads TPW = 32 / LPT
// consecutive token rows (coalesced uint32 code words); the warps take turns over the split.
//
// Two passes over the split (at most CH = 4096 / MB tokens, so its scores fit in
// threadgroup memory), so the query registers and the value accumulators are never live
// together:
//   1. scores: each lane decodes its key codes and dots them with the query rows held in
//      registers; the LPT lanes of a token add up their rows by a reduce-scatter of shuffles
//      (each of the first min(LPT, MB) lanes ends with its share of the rows); scores (log2
//      domain: the query is multiplied by log2(e) once) go to threadgroup memory, and the
//      split's exact max is reduced over the threadgroup;
//   2. weights p = exp2(s - max) are computed once per (token, row) in place, with their sum;
//   3. values: each lane adds p times its decoded value codes to its accumulators.
// The token slots and warps are then summed (shuffles, threadgroup memory) and the split's
// partial (o, max, sum) is written for the merge kernel (decode_merge.metal).
//
// Codes: KKIND / VKIND 0 = affine per-group (x = scale * code + zero; scale/zero per
// KGROUP / VGROUP channels), 1 = codebook (x = norm * levels[code], one norm per token).
// KKIND 2 (keys only) = affine per channel (KIVI's keys): one scale and zero per channel for
// each group of KGROUP tokens (ka, kb: (B, H, T / KGROUP, HD)); each code is decoded to
// scale * code + zero before its product with the query.
// KRSK = 1 (codebook keys only): each key also carries a 1-bit sketch of
// its residual (ksg: bit e set for a positive sign of channel e of S r) and the residual's
// norm (krn), and its score gains the sign-sketch estimate of the residual's product:
// norm * (sum_e q_e levels[c_e] + rnorm * sum_e qs_e sign_e), qs = the sketched query
// (S q, times sqrt(pi/2) / D, from the host).
// KKIND / VKIND 4 = vector codes: each sub-vector of KGROUP / VGROUP channels is
// the index (KBITS / VBITS bits) of a codeword of its (batch row, KV head)'s codebook: klv /
// vlv hold B * H tables of 2^bits x group floats (contiguous), the threadgroup's own table is
// copied to threadgroup memory and every index reads its codeword from there (the query
// dotted with it; for values, p times it added to the lane's accumulators).
// KOWN = 1: the keys' layout brings its own key pass (a method package's, see
// velox_core.kernels.layout), placed at the "@key-pass" line below by the host
// (KernelSpec.inserts); KOLV floats of klv are copied to threadgroup memory (klv_s) for it,
// KFLY = 1 keeps a butterfly for its tokens' sums (every lane ends with every row), and
// splits start on whole blocks of KSPAN tokens (the host keeps a block within one split).
// Affine codes are read as 1 + code / 2^bits (an exact float bit trick, no conversion), with
// the scale and zero folded in per sub-block; codebook codes index a table in threadgroup
// memory.
//
// Inputs (strided: any layout, e.g. a slice of a larger cache buffer):
//   q   (B, H, MP, HD) float32, scale applied          kc, vc  (B, H, T, W) uint32 codes
//   ka, va  affine: scale (B, H, T, HD / group); codebook: norm (B, H, T)
//   kb, vb  affine: zero  (B, H, T, HD / group); codebook: unused
//   klv, vlv  codebook levels (2^bits, contiguous); VQ: (B, H, 2^bits, group) codebooks;
//   unused for affine
//   ksg (B, H, T, HD / 32) uint32 sign bits, krn (B, H, T) residual norms, qsk (B, H, MP, HD)
//   float32 sketched query: KRSK = 1 only (else unused); a layout's own key pass reads
//   ksg, krn, qsk, kix and kst as its query-side inputs (velox_core.kernels.layout)
// Outputs: o_part (B, H, S, MP, HD), ml_part (B, H, S, MP, 2) = (max, sum) in log2 units.
// The host must choose S >= ceil(T / CH) (velox_core.kernels.decode.choose_splits); tokens
// past CH in a split would be ignored.

constexpr int LPT_REAL = HD / CPL;
constexpr int LPT =
    LPT_REAL <= 1 ? 1
  : LPT_REAL <= 2 ? 2
  : LPT_REAL <= 4 ? 4
  : LPT_REAL <= 8 ? 8
  : LPT_REAL <= 16 ? 16
  : 32;
constexpr int TPW = 32 / LPT;
constexpr int NT = NWARPS * 32;
constexpr int STEP = NWARPS * TPW * UNROLL;
constexpr int KCODES = KKIND == 4 ? CPL / KGROUP : CPL;  // codes a lane holds per token
constexpr int VCODES = VKIND == 4 ? CPL / VGROUP : CPL;
// (a layout's own key pass reads its own words)
constexpr int KW = KOWN ? 1 : KCODES * KBITS / 32;
constexpr int VW = VCODES * VBITS / 32;
constexpr int KSUB = (KKIND == 0 && KGROUP < CPL) ? KGROUP : CPL;
constexpr int KNSUB = CPL / KSUB;
constexpr int VSUB = (VKIND == 0 && VGROUP < CPL) ? VGROUP : CPL;
constexpr int VNSUB = CPL / VSUB;
constexpr int KLV = KKIND == 1 ? (1 << KBITS)
                  : KKIND == 4 ? (1 << KBITS) * KGROUP
                  : KOLV > 0 ? KOLV
                  : 1;
constexpr int VLV = VKIND == 1 ? (1 << VBITS) : VKIND == 4 ? (1 << VBITS) * VGROUP : 1;
constexpr unsigned int KMASK = (1u << KBITS) - 1u;
constexpr unsigned int VMASK = (1u << VBITS) - 1u;
constexpr float KPOW = (float)(1 << KBITS);
constexpr float VPOW = (float)(1 << VBITS);
constexpr float NEG = -1.0e30f;
// a scored token's lanes that reduce-scatter its rows' sums (LPT), and those of them that
// hold the sums after it (SRL, SRN rows each); a key pass with KFLY keeps a butterfly
// (every lane ends with every row: SLN 1)
constexpr int SLN = KFLY ? 1 : LPT;
constexpr int SRL = SLN < MB ? SLN : MB;
constexpr int SRN = MB / SRL;
constexpr int SC = 4096;                // (token, row) score slots in threadgroup memory
constexpr int CH = SC / MB;             // most tokens per split
constexpr int RED = NWARPS * MB * HD;   // the final warp merge (reuses the score slots)
constexpr int SMEM = SC > RED ? SC : RED;

const int tid = vx_tid;
const int lane = tid & 31;
const int warp = tid >> 5;
const int slot = lane / LPT;
const int j = lane - slot * LPT;
const bool act = j < LPT_REAL;
const int jc = act ? j : LPT_REAL - 1;  // in-bounds lane for unconditional loads
const int nsplit = vx_ngx;
const int split = vx_gx;
const int bh = vx_gy;
const int mblk = vx_gz;
const int H = kc_shape[1];
const int T = kc_shape[2];
const int MP = q_shape[2];
const int b = bh / H;
const int h = bh - b * H;
const int span0 = (T + nsplit - 1) / nsplit;
// splits of whole blocks of KSPAN tokens (the host keeps a block within CH tokens)
const int span = KSPAN > 1 ? (span0 + KSPAN - 1) / KSPAN * KSPAN : span0;
const int t0 = split * span;
const int t1 = vx_imin(vx_imin(T, t0 + span), t0 + CH);

VX_SHARED float smem[SMEM];
VX_SHARED float red_ml[NWARPS * MB];
VX_SHARED float red_top[MB];
VX_SHARED float klv_s[KLV];
VX_SHARED float vlv_s[VLV];
// VQ: this (batch row, KV head)'s codebook; a layout's own key pass: its KOLV floats
if (KKIND == 1 || KKIND == 4 || KOLV > 0) {
  const int64_t base = KKIND == 4 ? (int64_t)bh * KLV : 0;
  for (int i = tid; i < KLV; i += NT) {
    klv_s[i] = static_cast<float>(klv[base + i]);
  }
}
if (VKIND == 1 || VKIND == 4) {
  const int64_t base = VKIND == 4 ? (int64_t)bh * VLV : 0;
  for (int i = tid; i < VLV; i += NT) {
    vlv_s[i] = static_cast<float>(vlv[base + i]);
  }
}
VX_BARRIER();

// ================= pass 1: scores of the split's tokens -> smem[(t - t0) * MB + m] =========
// the lane's running max of the rows it holds after a token's reduce-scatter (srow on)
const int srow = vx_scatter_first<MB, SLN>(lane & (SLN - 1));
float wmax[SRN];
#pragma unroll
for (int e = 0; e < SRN; ++e) {
  wmax[e] = NEG;
}
if (KOWN) {
  // @key-pass
} else {
  // query rows of this block in registers, in the log2 domain (QMUL: the float32 bits of
  // log2(e), times the attention scale when q comes unscaled)
  const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));
  float qr[MB][CPL];
  const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
      const int64_t off = qb + (int64_t)(mblk * MB + m) * q_strides[2] +
                          (int64_t)(jc * CPL + e) * q_strides[3];
      const float qv = static_cast<float>(q[off]);
      qr[m][e] = act ? qv * qmul : 0.0f;
    }
  }
  // the sketched query (KRSK), in the same log2 domain
  constexpr int QS_M = KRSK ? MB : 1;
  constexpr int QS_C = KRSK ? CPL : 1;
  float qs[QS_M][QS_C];
  if (KRSK) {
    const int64_t sb0 = (int64_t)b * qsk_strides[0] + (int64_t)h * qsk_strides[1];
#pragma unroll
    for (int m = 0; m < QS_M; ++m) {
#pragma unroll
      for (int e = 0; e < QS_C; ++e) {
        const int64_t off = sb0 + (int64_t)(mblk * MB + m) * qsk_strides[2] +
                            (int64_t)(jc * CPL + e) * qsk_strides[3];
        qs[m][e] = act ? static_cast<float>(qsk[off]) * qmul : 0.0f;
      }
    }
  }
  const int64_t ksg_b = KRSK ? (int64_t)b * ksg_strides[0] + (int64_t)h * ksg_strides[1] : 0;
  const int64_t krn_b = KRSK ? (int64_t)b * krn_strides[0] + (int64_t)h * krn_strides[1] : 0;
  // per sub-block query sums (affine keys: zero point and the 1 + c / 2^bits offset)
  float kqs[MB][KNSUB];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int sb = 0; sb < KNSUB; ++sb) {
      float acc_q = 0.0f;
#pragma unroll
      for (int e2 = 0; e2 < KSUB; ++e2) {
        acc_q += qr[m][sb * KSUB + e2];
      }
      kqs[m][sb] = acc_q;
    }
  }
  const int64_t kc_b = (int64_t)b * kc_strides[0] + (int64_t)h * kc_strides[1];
  const int64_t ka_b = KKIND != 4 ? (int64_t)b * ka_strides[0] + (int64_t)h * ka_strides[1] : 0;
  const int64_t kb_b =
      KKIND != 1 && KKIND != 4 ? (int64_t)b * kb_strides[0] + (int64_t)h * kb_strides[1] : 0;

  for (int it = t0; it < t1; it += STEP) {
    unsigned int kw[UNROLL][KW];
    unsigned int ksw[UNROLL];  // KRSK: the lane's CPL sign bits, in the low bits
    float krv[UNROLL];         // KRSK: the residual norm
    float ksc[UNROLL][KNSUB];
    float kzr[UNROLL][KNSUB];
    int tok[UNROLL];
    bool tv[UNROLL];
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      tok[r] = it + (warp * UNROLL + r) * TPW + slot;
      tv[r] = tok[r] < t1;
      const bool ld = tv[r] && act;
      // unconditional loads from in-bounds addresses (clamped token and lane), then masked
      const int64_t tk = (int64_t)vx_imin(tok[r], t1 - 1);
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const unsigned int raw = static_cast<unsigned int>(
            kc[kc_b + tk * kc_strides[2] + (int64_t)(jc * KW + w) * kc_strides[3]]);
        kw[r][w] = ld ? raw : 0u;
      }
      if (KRSK) {
        const int bit0 = jc * CPL;
        const unsigned int sw = static_cast<unsigned int>(
            ksg[ksg_b + tk * ksg_strides[2] + (int64_t)(bit0 >> 5) * ksg_strides[3]]);
        const float rv = static_cast<float>(krn[krn_b + tk * krn_strides[2]]);
        ksw[r] = ld ? (sw >> (bit0 & 31)) : 0u;
        krv[r] = ld ? rv : 0.0f;
      } else {
        ksw[r] = 0u;
        krv[r] = 0.0f;
      }
#pragma unroll
      for (int sb = 0; sb < KNSUB; ++sb) {
        if (KKIND == 0) {
          const int64_t gi = (int64_t)((jc * CPL + sb * KSUB) / KGROUP);
          const float sv = static_cast<float>(ka[ka_b + tk * ka_strides[2] + gi * ka_strides[3]]);
          const float zv = static_cast<float>(kb[kb_b + tk * kb_strides[2] + gi * kb_strides[3]]);
          ksc[r][sb] = ld ? sv : 0.0f;
          kzr[r][sb] = ld ? zv : 0.0f;
        } else if (KKIND == 1) {
          const float nv = static_cast<float>(ka[ka_b + tk * ka_strides[2]]);
          ksc[r][sb] = ld ? nv : 0.0f;
          kzr[r][sb] = 0.0f;
        } else {  // per-channel scales are read with each code (below); VQ has none
          ksc[r][sb] = 0.0f;
          kzr[r][sb] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      float part[MB];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        part[m] = 0.0f;
      }
      // KKIND 2: the token's group row of the per-channel scales and zeros
      const int64_t kgrp = KKIND == 2 ? (int64_t)(vx_imin(tok[r], t1 - 1) / KGROUP) : 0;
      if (KKIND == 4) {
        // the lane's sub-vectors: each index reads its codeword from threadgroup memory
#pragma unroll
        for (int u = 0; u < KCODES; ++u) {
          const int bit = u * KBITS;
          const int wi = bit >> 5;
          const int sh = bit & 31;
          unsigned int code = kw[r][wi] >> sh;
          if (sh + KBITS > 32) {  // the index straddles two words
            code |= kw[r][wi + 1 < KW ? wi + 1 : wi] << (32 - sh);
          }
          const int cw = static_cast<int>(code & KMASK) * KGROUP;
#pragma unroll
          for (int g = 0; g < KGROUP; ++g) {
            const float f = klv_s[cw + g];
#pragma unroll
            for (int m = 0; m < MB; ++m) {
              part[m] = vx_fma(qr[m][u * KGROUP + g], f, part[m]);
            }
          }
        }
      }
#pragma unroll
      for (int sb = 0; sb < (KKIND == 4 ? 0 : KNSUB); ++sb) {
        float dot[MB];
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          dot[m] = 0.0f;
        }
#pragma unroll
        for (int e2 = 0; e2 < KSUB; ++e2) {
          const int e = sb * KSUB + e2;
          const int bit = e * KBITS;
          const int wi = bit >> 5;
          const int sh = bit & 31;
          float f;
          if (KKIND == 0 && sh + KBITS <= 32) {
            f = vx_code_unit(kw[r][wi], sh, KBITS);  // 1 + code / 2^bits
          } else {
            unsigned int code = kw[r][wi] >> sh;
            if (sh + KBITS > 32) {  // the code straddles two words
              code |= kw[r][wi + 1 < KW ? wi + 1 : wi] << (32 - sh);
            }
            code &= KMASK;
            if (KKIND == 2) {
              const int64_t ch = (int64_t)(jc * CPL + e);
              const float sv = static_cast<float>(ka[ka_b + kgrp * ka_strides[2] + ch * ka_strides[3]]);
              const float zv = static_cast<float>(kb[kb_b + kgrp * kb_strides[2] + ch * kb_strides[3]]);
              f = vx_fma(sv, static_cast<float>(code), zv);
            } else {
              f = KKIND == 0 ? vx_bits_to_float(0x3F800000u | (code << (23 - KBITS))) : klv_s[code];
            }
          }
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            dot[m] = vx_fma(qr[m][e], f, dot[m]);
          }
        }
        if (KKIND == 0) {
          // sum_e q (s c + z) = a * dot + (z - a) * sum_e q, with a = s * 2^bits
          const float a = ksc[r][sb] * KPOW;
          const float bz = kzr[r][sb] - a;
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            part[m] = vx_fma(a, dot[m], vx_fma(bz, kqs[m][sb], part[m]));
          }
        } else {
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            part[m] += dot[m];
          }
        }
      }
      if (KRSK) {
        // the residual's sketch against the sketched query: sum_e qs_e (+1 | -1)
#pragma unroll
        for (int m = 0; m < QS_M; ++m) {
          float sd = 0.0f;
#pragma unroll
          for (int e = 0; e < QS_C; ++e) {
            sd += ((ksw[r] >> e) & 1u) ? qs[m][e] : -qs[m][e];
          }
          part[m] = vx_fma(krv[r], sd, part[m]);
        }
      }
      if (KKIND == 1) {
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          part[m] *= ksc[r][0];
        }
      }
      // the token's lanes add up their rows by a reduce-scatter (velox_kernels.h): lanes
      // j < SRL end with SRN rows each, from srow on
      vx_reduce_scatter<MB, LPT>(part, j);
      if (tv[r]) {
#pragma unroll
        for (int e = 0; e < SRN; ++e) {
          wmax[e] = vx_max(wmax[e], part[e]);
        }
        if (j < SRL) {
#pragma unroll
          for (int e = 0; e < SRN; ++e) {
            smem[(tok[r] - t0) * MB + srow + e] = part[e];
          }
        }
      }
    }
  }
}

// the split's max of every row: over the lanes that hold the same rows (lane bits from SRL
// up), then lanes 0 .. SRL - 1 store theirs
#pragma unroll
for (int e = 0; e < SRN; ++e) {
#pragma unroll
  for (int off = 16; off >= SRL; off >>= 1) {
    wmax[e] = vx_max(wmax[e], vx_shfl_xor(wmax[e], off));
  }
}
if (lane < SRL) {
#pragma unroll
  for (int e = 0; e < SRN; ++e) {
    red_ml[warp * MB + srow + e] = wmax[e];
  }
}
VX_BARRIER();
if (tid < MB) {
  float top = NEG;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    top = vx_max(top, red_ml[w * MB + tid]);
  }
  red_top[tid] = top;
}
VX_BARRIER();

// ================= weights, once per (token, row), in place; thread sums its row tid % MB ===
float lsum = 0.0f;
{
  const float mytop = red_top[tid % MB];
  const int n = (t1 > t0 ? t1 - t0 : 0) * MB;
  for (int i = tid; i < n; i += NT) {
    const float p = vx_exp2(smem[i] - mytop);
    smem[i] = p;
    lsum += p;
  }
}
VX_BARRIER();

// ================= pass 2: value mix ======================================================
float acc[MB][CPL];
{
  float accz[MB][VNSUB];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
      acc[m][e] = 0.0f;
    }
#pragma unroll
    for (int sb = 0; sb < VNSUB; ++sb) {
      accz[m][sb] = 0.0f;
    }
  }
  const int64_t vc_b = (int64_t)b * vc_strides[0] + (int64_t)h * vc_strides[1];
  const int64_t va_b = VKIND != 4 ? (int64_t)b * va_strides[0] + (int64_t)h * va_strides[1] : 0;
  const int64_t vb_b = VKIND == 0 ? (int64_t)b * vb_strides[0] + (int64_t)h * vb_strides[1] : 0;

  for (int it = t0; it < t1; it += STEP) {
    unsigned int vw[UNROLL][VW];
    float vsc[UNROLL][VNSUB];
    float vzr[UNROLL][VNSUB];
    int tok[UNROLL];
    bool tv[UNROLL];
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      tok[r] = it + (warp * UNROLL + r) * TPW + slot;
      tv[r] = tok[r] < t1;
      const bool ld = tv[r] && act;
      // unconditional loads from in-bounds addresses (clamped token and lane), then masked
      const int64_t tk = (int64_t)vx_imin(tok[r], t1 - 1);
#pragma unroll
      for (int w = 0; w < VW; ++w) {
        const unsigned int raw = static_cast<unsigned int>(
            vc[vc_b + tk * vc_strides[2] + (int64_t)(jc * VW + w) * vc_strides[3]]);
        vw[r][w] = ld ? raw : 0u;
      }
#pragma unroll
      for (int sb = 0; sb < VNSUB; ++sb) {
        if (VKIND == 0) {
          const int64_t gi = (int64_t)((jc * CPL + sb * VSUB) / VGROUP);
          const float sv = static_cast<float>(va[va_b + tk * va_strides[2] + gi * va_strides[3]]);
          const float zv = static_cast<float>(vb[vb_b + tk * vb_strides[2] + gi * vb_strides[3]]);
          vsc[r][sb] = ld ? sv : 0.0f;
          vzr[r][sb] = ld ? zv : 0.0f;
        } else if (VKIND == 1) {
          const float nv = static_cast<float>(va[va_b + tk * va_strides[2]]);
          vsc[r][sb] = ld ? nv : 0.0f;
          vzr[r][sb] = 0.0f;
        } else {  // VQ: no per-token scale
          vsc[r][sb] = 0.0f;
          vzr[r][sb] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      float p[MB];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        p[m] = tv[r] ? smem[(tok[r] - t0) * MB + m] : 0.0f;
      }
      if (VKIND == 0) {
#pragma unroll
        for (int sb = 0; sb < VNSUB; ++sb) {
          // p (s c + z) = (p a) (1 + c / 2^bits) + p (z - a), with a = s * 2^bits
          const float a = vsc[r][sb] * VPOW;
          const float bz = vzr[r][sb] - a;
          float pa[MB];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            pa[m] = p[m] * a;
            accz[m][sb] = vx_fma(p[m], bz, accz[m][sb]);
          }
#pragma unroll
          for (int e2 = 0; e2 < VSUB; ++e2) {
            const int e = sb * VSUB + e2;
            const int bit = e * VBITS;
            const int wi = bit >> 5;
            const int sh = bit & 31;
            float f;
            if (sh + VBITS <= 32) {
              f = vx_code_unit(vw[r][wi], sh, VBITS);  // 1 + code / 2^bits
            } else {  // the code straddles two words
              unsigned int code = vw[r][wi] >> sh;
              code |= vw[r][wi + 1 < VW ? wi + 1 : wi] << (32 - sh);
              code &= VMASK;
              f = vx_bits_to_float(0x3F800000u | (code << (23 - VBITS)));
            }
#pragma unroll
            for (int m = 0; m < MB; ++m) {
              acc[m][e] = vx_fma(pa[m], f, acc[m][e]);
            }
          }
        }
      } else if (VKIND == 4) {
        // the lane's sub-vectors: p times each index's codeword
#pragma unroll
        for (int u = 0; u < VCODES; ++u) {
          const int bit = u * VBITS;
          const int wi = bit >> 5;
          const int sh = bit & 31;
          unsigned int code = vw[r][wi] >> sh;
          if (sh + VBITS > 32) {  // the index straddles two words
            code |= vw[r][wi + 1 < VW ? wi + 1 : wi] << (32 - sh);
          }
          const int cw = static_cast<int>(code & VMASK) * VGROUP;
#pragma unroll
          for (int g = 0; g < VGROUP; ++g) {
            const float f = vlv_s[cw + g];
#pragma unroll
            for (int m = 0; m < MB; ++m) {
              acc[m][u * VGROUP + g] = vx_fma(p[m], f, acc[m][u * VGROUP + g]);
            }
          }
        }
      } else {
        float pn[MB];
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          pn[m] = p[m] * vsc[r][0];
        }
#pragma unroll
        for (int e = 0; e < CPL; ++e) {
          const int bit = e * VBITS;
          const int wi = bit >> 5;
          const int sh = bit & 31;
          unsigned int code = vw[r][wi] >> sh;
          if (sh + VBITS > 32) {
            code |= vw[r][wi + 1 < VW ? wi + 1 : wi] << (32 - sh);
          }
          code &= VMASK;
          const float f = vlv_s[code];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            acc[m][e] = vx_fma(pn[m], f, acc[m][e]);
          }
        }
      }
    }
  }
  if (VKIND == 0) {
#pragma unroll
    for (int m = 0; m < MB; ++m) {
#pragma unroll
      for (int e = 0; e < CPL; ++e) {
        acc[m][e] += accz[m][e / VSUB];
      }
    }
  }
}

// ================= sum the token slots, the warps; write the split's partial ==============
#pragma unroll
for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
      acc[m][e] += vx_shfl_xor(acc[m][e], off);
    }
  }
}
#pragma unroll
for (int off = MB; off < 32; off <<= 1) {
  lsum += vx_shfl_xor(lsum, off);
}
VX_BARRIER();  // every weight has been read: smem becomes the warp-merge buffer
if (slot == 0 && act) {
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int e = 0; e < CPL; ++e) {
      smem[(warp * MB + m) * HD + j * CPL + e] = acc[m][e];
    }
  }
}
if (lane < MB) {
  red_ml[warp * MB + lane] = lsum;  // lane m holds the warp's sum of row m
}
VX_BARRIER();
const int64_t row0 = ((int64_t)bh * nsplit + split) * MP + (int64_t)mblk * MB;
for (int i = tid; i < MB * HD; i += NT) {
  const int m = i / HD;
  const int d = i - m * HD;
  float o = 0.0f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) {
    o += smem[(w * MB + m) * HD + d];
  }
  o_part[(row0 + m) * HD + d] = o;
  if (d == 0) {
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      l += red_ml[w * MB + m];
    }
    ml_part[(row0 + m) * 2] = red_top[m];
    ml_part[(row0 + m) * 2 + 1] = l;
  }
}
