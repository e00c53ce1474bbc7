// CommVQ's key pass in velox-core's portable decode kernel (metal/decode_attention.metal):
// the text placed at its "@key-pass" line for table keys (velox_commvq.layout.TableLayout,
// KOWN = 1), compiled for Metal and CUDA with the rest of the body. See the contract in
// velox_core.kernels.layout.
//
// Keys: CommVQ's RoPE-commutative codes (arXiv 2506.18879). Per token, KSTG stages of
// (HD / 2) / KGROUP groups of RoPE pairs, two indices c1, c2 of KBITS bits a group (one bit
// stream: stage by stage, group by group, c1 then c2), ka the key's norm and kb its position
// (B, 1, T) int32, shared by the heads; klv_s the pairs' frequencies theta (KOLV = HD / 2
// floats, radians per position, copied to threadgroup memory by the kernel). The host passes
// the query tables in qsk (B, H, MP, E): entry (((s * HD/2 + p) * 2 + book) * 2^KBITS + k)
// * 2 + c holds, for query row m, the real (c 0) or imaginary (c 1) part of conj(q_p)
// A[s, p, k] (book 0) or conj(q_p) J B[s, p, k] (book 1). A lane owns CPL / 2 pairs (whole
// groups); per pair it adds the two looked-up 2-vectors of every stage, W_p, rotates the sum
// by the key's angle (Re(e^{i t theta_p} W_p) = cos W.re - sin W.im), adds its pairs and
// scales by the norm: the key itself is never decoded. q is not read (the merge scores the
// fp16 tokens with it).
constexpr int HP = HD / 2;                       // RoPE pairs of a head
constexpr int TPL = CPL / 2;                     // pairs a lane owns
constexpr int TNG = TPL / KGROUP;                // code groups a lane owns, per stage
constexpr int TLB = TNG * 2 * KBITS;             // bits of a lane's indices, per stage
constexpr int TSW = TLB >= 32 ? TLB / 32 : 1;    // words a lane reads, per stage
constexpr int TRW = KSTG > 0 ? KSTG * TSW : 1;   // words a lane holds per token
constexpr int TK = 1 << KBITS;                   // entries of a small codebook
const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));
const int64_t kc_b = (int64_t)b * kc_strides[0] + (int64_t)h * kc_strides[1];
const int64_t ka_b = (int64_t)b * ka_strides[0] + (int64_t)h * ka_strides[1];
const int64_t kb_b = (int64_t)b * kb_strides[0];  // positions: one row for all heads
const int64_t tq_b = (int64_t)b * qsk_strides[0] + (int64_t)h * qsk_strides[1];
for (int it = t0; it < t1; it += STEP) {
  unsigned int tw[UNROLL][TRW];
  float nv[UNROLL];
  float pv[UNROLL];
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
    for (int s = 0; s < KSTG; ++s) {
      // the lane's run of stage s starts at bit (s * LPT_REAL + jc) * TLB: whole words, or
      // (TLB dividing 32) an aligned share of one word, shifted down here
      const int bit0 = (s * LPT_REAL + jc) * TLB;
#pragma unroll
      for (int w = 0; w < TSW; ++w) {
        const unsigned int raw = static_cast<unsigned int>(
            kc[kc_b + tk * kc_strides[2] + (int64_t)((bit0 >> 5) + w) * kc_strides[3]]);
        tw[r][s * TSW + w] = ld ? (TLB < 32 ? raw >> (bit0 & 31) : raw) : 0u;
      }
    }
    const float n0 = static_cast<float>(ka[ka_b + tk * ka_strides[2]]);
    const float tp = static_cast<float>(kb[kb_b + tk * kb_strides[2]]);
    nv[r] = ld ? n0 * qmul : 0.0f;  // inactive lanes and tokens add 0
    pv[r] = tp;  // the position as float32, as the reference's angles take it
  }
#pragma unroll
  for (int r = 0; r < UNROLL; ++r) {
    float part[MB];
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      part[m] = 0.0f;
    }
#pragma unroll
    for (int pp = 0; pp < TPL; ++pp) {
      const int p = jc * TPL + pp;
      const int g = pp / KGROUP;  // the lane's group holding pair pp
      const float ang = pv[r] * klv_s[p];
      const float cs = vx_cos(ang);
      const float sn = vx_sin(ang);
      float wre[MB];
      float wim[MB];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        wre[m] = 0.0f;
        wim[m] = 0.0f;
      }
#pragma unroll
      for (int s = 0; s < KSTG; ++s) {
#pragma unroll
        for (int book = 0; book < 2; ++book) {
          const int bit = (g * 2 + book) * KBITS;
          const int wi = bit >> 5;
          const int sh = bit & 31;
          unsigned int code = tw[r][s * TSW + wi] >> sh;
          if (sh + KBITS > 32) {  // the index straddles two words
            code |= tw[r][s * TSW + (wi + 1 < TSW ? wi + 1 : wi)] << (32 - sh);
          }
          const int e = (((s * HP + p) * 2 + book) * TK + static_cast<int>(code & KMASK)) * 2;
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            const int64_t row = tq_b + (int64_t)(mblk * MB + m) * qsk_strides[2];
            wre[m] += static_cast<float>(qsk[row + (int64_t)e * qsk_strides[3]]);
            wim[m] += static_cast<float>(qsk[row + (int64_t)(e + 1) * qsk_strides[3]]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        part[m] = vx_fma(cs, wre[m], vx_fma(-sn, wim[m], part[m]));
      }
    }
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      part[m] *= nv[r];
    }
    // the token's lanes add up their rows (as the kernel's own passes do)
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
