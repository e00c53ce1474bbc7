// QJL's key pass in velox-core's portable decode kernel (metal/decode_attention.metal): the
// text placed at its "@key-pass" line for sketch keys (velox_qjl.layout.SketchLayout,
// KOWN = 1), compiled for Metal and CUDA with the rest of the body. See the contract in
// velox_core.kernels.layout.
//
// Inputs it reads: ksg (B, H, T, KOSK / 32) outlier sign bits, qsk (B, H, MP, KSK) = S q
// (lanes' order), kix (B, H, T / KGROUP, W) packed outlier channels, kst (HD, C) S^T (lanes'
// order), ka the norms ||k_in||, kb the outlier norms.
//
// Keys: QJL's sketch keys (KKIND 3, keys only). kc holds m = KSK sign bits of S k_in per
// token, ka its norm ||k_in||; per block of KGROUP tokens KOUT outlier channels (kix: their
// indices, KIB bits each) carry their own sketch of KOSK bits (ksg) and norm (kb), made with
// the first rows of the same S. The score is
//   c/m ||k_in|| <S q - S P q, sign(S k_in)> + c/m_o ||k_o|| <S P q, sign(S k_o)>
// (P: the block's outlier channels; KCIN, KCOUT: float32 bits of c/m and c/m_o). KLPT lanes
// share a token, lane j holding its sketches' bits [j SB, (j + 1) SB) (SB = KSK / KLPT; the
// same with KOSK) and as many weights per query row. S comes transposed, in the lanes' order
// (kst (HD, C): row j SB + i of S in column i KLPT + j; the outlier sketch's rows after the
// KSK main ones unless both sketches take the same rows), and the host passes S q in the
// same order (qsk (B, H, MP, KSK)), so a warp's lanes read contiguous runs. Each warp takes
// whole blocks: it forms S P q on its lanes' rows from the block's indices, then scores the
// block's tokens.
// Splits start on whole blocks (KSPAN = KGROUP with outliers: the kernel rounds its span up
// to them). The token's sums are added by a butterfly (KFLY: every lane ends with every row):
// on an H200 the reduce-scatter took the paper's sketch keys from 166 to 176 registers,
// three threadgroups an SM to two, and 8-13% more time.
constexpr int KL = KLPT > 0 ? KLPT : 1;           // lanes per token
constexpr int KTP = 32 / KL;                      // tokens per warp and load
constexpr int SB = KSK / KL > 0 ? KSK / KL : 1;   // main-sketch bits per lane
constexpr int OB = KOUT > 0 ? KOSK / KL : 1;      // outlier-sketch bits per lane
constexpr int SWN = SB >= 32 ? SB / 32 : 1;       // words per lane
constexpr int OWN = OB >= 32 ? OB / 32 : 1;
// a share below 32 bits that does not divide 32 may straddle two words
constexpr bool SSTR = SB < 32 && 32 % SB != 0;
constexpr bool OSTR = OB < 32 && 32 % OB != 0;
constexpr int SROW = (KSK + 31) / 32;             // words of a token's sketch
constexpr int OROW = KOUT > 0 ? (KOSK + 31) / 32 : 1;
constexpr int NO = KOUT > 0 ? KOUT : 1;
constexpr int KCH = KOUT > 0 ? KGROUP : KTP * UNROLL;  // tokens per chunk (one block)
constexpr bool SAME = KOUT > 0 && KSK == KOSK;    // both sketches take the same rows of S
constexpr unsigned int IMASK = KIB > 0 ? (1u << KIB) - 1u : 0u;
const int ks = lane / KL;
const int kj = lane - ks * KL;
const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));
const float cin = vx_bits_to_float(static_cast<unsigned int>(KCIN));
const float cot = vx_bits_to_float(static_cast<unsigned int>(KCOUT));
const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1];
const int64_t sqb = (int64_t)b * qsk_strides[0] + (int64_t)h * qsk_strides[1];
const int64_t kc_b = (int64_t)b * kc_strides[0] + (int64_t)h * kc_strides[1];
const int64_t ka_b = (int64_t)b * ka_strides[0] + (int64_t)h * ka_strides[1];
const int64_t kb_b = KOUT > 0 ? (int64_t)b * kb_strides[0] + (int64_t)h * kb_strides[1] : 0;
const int64_t ksg_b = KOUT > 0 ? (int64_t)b * ksg_strides[0] + (int64_t)h * ksg_strides[1] : 0;
const int64_t kix_b = KOUT > 0 ? (int64_t)b * kix_strides[0] + (int64_t)h * kix_strides[1] : 0;
// the lane's first word and its bits' offset in it
const int sw0 = SB >= 32 ? kj * SWN : (kj * SB) >> 5;
const int ssh = SB >= 32 ? 0 : (kj * SB) & 31;
const int ow0 = OB >= 32 ? kj * OWN : (kj * OB) >> 5;
const int osh = OB >= 32 ? 0 : (kj * OB) & 31;
// the weights of the lane's sign bits, per query row, in the log2 domain:
// c/m (S q - S P q) for the main sketch and c/m_o S P q for the outlier sketch
float din[MB][SB];
float dout[MB][OB];
#pragma unroll
for (int m = 0; m < MB; ++m) {
#pragma unroll
  for (int i = 0; i < SB; ++i) {
    din[m][i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < OB; ++i) {
    dout[m][i] = 0.0f;
  }
}
if (KOUT == 0) {  // no outliers: the weights hold for every token
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const int64_t off = sqb + (int64_t)(mblk * MB + m) * qsk_strides[2] +
                          (int64_t)(i * KL + kj) * qsk_strides[3];
      din[m][i] = static_cast<float>(qsk[off]) * qmul * cin;
    }
  }
}
const int nch = t1 > t0 ? (t1 - t0 + KCH - 1) / KCH : 0;
for (int c = warp; c < nch; c += NWARPS) {
  const int cs = t0 + c * KCH;
  const int ce = vx_imin(cs + KCH, t1);
  if (KOUT > 0) {
    // the block's outlier channels and the query's coordinates on them
    const int64_t wb = kix_b + (int64_t)(cs / KGROUP) * kix_strides[2];
    int oc[NO];
    float qo[MB][NO];
#pragma unroll
    for (int o = 0; o < NO; ++o) {
      const int bit = o * KIB;
      const int wi = bit >> 5;
      const int sh = bit & 31;
      unsigned int w = static_cast<unsigned int>(kix[wb + (int64_t)wi * kix_strides[3]]) >> sh;
      if (sh + KIB > 32) {  // the index straddles two words
        w |= static_cast<unsigned int>(kix[wb + (int64_t)(wi + 1) * kix_strides[3]])
             << (32 - sh);
      }
      oc[o] = static_cast<int>(w & IMASK);
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        const int64_t off =
            qb + (int64_t)(mblk * MB + m) * q_strides[2] + (int64_t)oc[o] * q_strides[3];
        qo[m][o] = static_cast<float>(q[off]) * qmul;
      }
    }
    // S P q on the lane's rows of S: the main sketch's weights (and the outlier sketch's
    // when both take the same rows)
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const int col = i * KL + kj;  // row kj * SB + i of S
      float sv[NO];
#pragma unroll
      for (int o = 0; o < NO; ++o) {
        sv[o] = static_cast<float>(
            kst[(int64_t)oc[o] * kst_strides[0] + (int64_t)col * kst_strides[1]]);
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        float sp = 0.0f;
#pragma unroll
        for (int o = 0; o < NO; ++o) {
          sp = vx_fma(sv[o], qo[m][o], sp);
        }
        const int64_t off =
            sqb + (int64_t)(mblk * MB + m) * qsk_strides[2] + (int64_t)col * qsk_strides[3];
        din[m][i] = cin * (static_cast<float>(qsk[off]) * qmul - sp);
        if (SAME) {
          dout[m][i < OB ? i : 0] = cot * sp;
        }
      }
    }
    if (!SAME) {
#pragma unroll
      for (int i = 0; i < OB; ++i) {
        const int col = KSK + i * KL + kj;  // row kj * OB + i of S, after the main rows
        float sv[NO];
#pragma unroll
        for (int o = 0; o < NO; ++o) {
          sv[o] = static_cast<float>(
              kst[(int64_t)oc[o] * kst_strides[0] + (int64_t)col * kst_strides[1]]);
        }
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          float sp = 0.0f;
#pragma unroll
          for (int o = 0; o < NO; ++o) {
            sp = vx_fma(sv[o], qo[m][o], sp);
          }
          dout[m][i] = cot * sp;
        }
      }
    }
  }
  for (int it = cs; it < ce; it += KTP * UNROLL) {
    unsigned int sw[UNROLL][SWN];
    unsigned int ow[UNROLL][OWN];
    float nv[UNROLL];
    float onv[UNROLL];
    int tok[UNROLL];
    bool tv[UNROLL];
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      tok[r] = it + r * KTP + ks;
      tv[r] = tok[r] < ce;
      // unconditional loads from in-bounds addresses (clamped token), then masked
      const int64_t tk = (int64_t)vx_imin(tok[r], ce - 1);
#pragma unroll
      for (int w = 0; w < SWN; ++w) {
        const unsigned int raw = static_cast<unsigned int>(
            kc[kc_b + tk * kc_strides[2] + (int64_t)(sw0 + w) * kc_strides[3]]);
        unsigned int bits = raw >> ssh;
        if (SSTR && ssh > 0) {  // the next word's low bits (clamped: unused past the row)
          const int64_t w1 = (int64_t)vx_imin(sw0 + 1, SROW - 1);
          bits |= static_cast<unsigned int>(kc[kc_b + tk * kc_strides[2] + w1 * kc_strides[3]])
                  << (32 - ssh);
        }
        sw[r][w] = tv[r] ? bits : 0u;
      }
      const float n0 = static_cast<float>(ka[ka_b + tk * ka_strides[2]]);
      nv[r] = tv[r] ? n0 : 0.0f;
#pragma unroll
      for (int w = 0; w < OWN; ++w) {
        ow[r][w] = 0u;
      }
      onv[r] = 0.0f;
      if (KOUT > 0) {
#pragma unroll
        for (int w = 0; w < OWN; ++w) {
          const unsigned int raw = static_cast<unsigned int>(
              ksg[ksg_b + tk * ksg_strides[2] + (int64_t)(ow0 + w) * ksg_strides[3]]);
          unsigned int bits = raw >> osh;
          if (OSTR && osh > 0) {
            const int64_t w1 = (int64_t)vx_imin(ow0 + 1, OROW - 1);
            bits |= static_cast<unsigned int>(
                        ksg[ksg_b + tk * ksg_strides[2] + w1 * ksg_strides[3]])
                    << (32 - osh);
          }
          ow[r][w] = tv[r] ? bits : 0u;
        }
        const float n1 = static_cast<float>(kb[kb_b + tk * kb_strides[2]]);
        onv[r] = tv[r] ? n1 : 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      float part[MB];
      float opart[MB];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        part[m] = 0.0f;
        opart[m] = 0.0f;
      }
      // sum_i sign_i d_i, sign_i = +1 where the bit is set (S k >= 0), else -1: the bit
      // moved to the sign of -1.0f (two integer instructions a bit, shared by the rows),
      // then one FMA a bit and row
#pragma unroll
      for (int i = 0; i < SB; ++i) {
        const float sg = vx_sign_unit(sw[r][i >> 5], i & 31);
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          part[m] = vx_fma(sg, din[m][i], part[m]);
        }
      }
      if (KOUT > 0) {
#pragma unroll
        for (int i = 0; i < OB; ++i) {
          const float sg = vx_sign_unit(ow[r][i >> 5], i & 31);
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            opart[m] = vx_fma(sg, dout[m][i], opart[m]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        part[m] = vx_fma(nv[r], part[m], onv[r] * opart[m]);
      }
#pragma unroll
      for (int off = KL / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          part[m] += vx_shfl_xor(part[m], off);
        }
      }
      if (tv[r]) {  // SRN = MB here: every lane holds the token's scores; one stores them
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          wmax[m] = vx_max(wmax[m], part[m]);
        }
        if (kj == 0) {
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            smem[(tok[r] - t0) * MB + m] = part[m];
          }
        }
      }
    }
  }
}
