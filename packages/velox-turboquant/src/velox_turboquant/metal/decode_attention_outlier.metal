// Fused decode attention over rotated codebook codes whose channels are split per group of
// tokens into an outlier part and the rest (TurboQuant's fractional widths: 3.5 bits = 64
// channels at 4 bits and 64 at 3 bits, chosen per group of GROUP tokens), one split of the
// context per threadgroup (flash-decoding). Body written once for Metal and CUDA.
//
// Record of one side (keys or values), per token: the hi part's codes (NH channels at BH
// bits, hc (B, H, T, WH) uint32) and norm (hn (B, H, T)), the lo part's codes (HD - NH
// channels at BL bits, lc) and norm (ln), and per group of GROUP tokens the outlier mask
// (mk (B, H, T / GROUP, ceil(HD / 32)) uint32, bit c set: channel c is in the hi part). A
// group's channel order puts the outliers first, both sets ascending; each part of that
// order was rotated by its own randomized Hadamard R x = H_blk(P(s * x)) (signs s,
// permutation P, orthonormal Hadamard blocks of BK channels) and coded as norm * levels[code]
// in the rotated domain. NH = 0: a side of one part (an integer width): no mask, all HD
// channels in the lo part.
//
// Per group the threadgroup (NT = 64 or 128 threads) does, in threadgroup memory and registers
// (each side's records are loaded ahead in two runs, the group's hi words then its lo words,
// so that each load's buffer is known at compile time):
//   A. store the group's key codes, norms and mask (loaded into registers during the
//      previous group's value mix); place the query in each key part's rotated input order
//      (channel c -> its part's slot dst[j], times s[j] / sqrt(BK); j from the mask's
//      popcounts) and run the Hadamard butterflies, each thread on EPT consecutive entries:
//      short stages in registers, longer ones across a warp's lanes by shuffles (one
//      barrier a transform): the query as this group's key codes see it;
//   B. score the group's tokens: LPT lanes per token, lane j taking a contiguous chunk of
//      each part's channels (at most 32 bits of codes, so shifts known at compile time;
//      its query values in registers), norms times level sums, the lanes' rows summed by a
//      reduce-scatter of shuffles (one shuffle a row a step while a lane holds several);
//      scores in the log2 domain (QMUL: the query is scaled once, into threadgroup memory);
//   C. online softmax: the group's max per query row, the running (max, sum) rescaled,
//      weights p = exp2(s - max) in place; the value records (loaded during A and B)
//      stored, the next group's keys loaded into registers;
//   D. values in the value parts' rotated domain: each thread takes a chunk of a part's
//      channels (at most 32 bits of codes) for a set of the group's tokens, adding
//      p * norm * level; the token sets are summed by a reduce-scatter of shuffles, each
//      set's lane storing its share into threadgroup memory;
//   E. the Hadamard butterflies on that sum (R^T = P^T H s, H symmetric), then each output
//      channel gathers its slot (times its sign) and adds it to the running output, which
//      was rescaled by the softmax's factor: the output stays in the model's domain.
// The split's partial (o = sum of p v, max, sum in log2 units) goes to decode_merge.metal or
// decode_merge_fp16.metal, as the other decode kernels' partials do.
//
// Inputs (strided: slices of cache buffers are read in place):
//   q (B, H, MP, HD): float32 with the scale applied, or any float dtype with QMUL carrying
//   the scale. khc, khn, klc, kln, kmk / vhc, vhn, vlc, vln, vmk: the records above (NH = 0:
//   the hi ones and the mask unused). kax / vax (contiguous float32), per side:
//   [s_hi / sqrt(BKH) (NH), dst_hi (NH), s_lo / sqrt(BKL) (NL), dst_lo (NL), levels_hi
//   (2^BH, NH > 0 only), levels_lo (2^BL)], dst[j] = P^-1(j) as a float.
// Outputs: o_part (B, H, S, MP, HD), ml_part (B, H, S, MP, 2). Grid: x = split (whole groups,
// ceil(G / S) each), y = b * H + h, z = block of MB query rows.

constexpr int NWARPS = NT / 32;
constexpr int KNL = HD - KNH;
constexpr int VNL = HD - VNH;
constexpr int KWH = (KNH * KBH + 31) / 32;
constexpr int KWL = (KNL * KBL + 31) / 32;
constexpr int KW = KWH + KWL;
constexpr int VWH = (VNH * VBH + 31) / 32;
constexpr int VWL = (VNL * VBL + 31) / 32;
constexpr int VW = VWH + VWL;
constexpr int CW = KW > VW ? KW : VW;
// words a thread loads ahead, per part (the hi words of the group's tokens, then the lo ones:
// each load's buffer is known at compile time)
constexpr int KWHD = KWH > 0 ? KWH : 1;
constexpr int VWHD = VWH > 0 ? VWH : 1;
constexpr int KPH = (GROUP * KWH + NT - 1) / NT;
constexpr int KPL = (GROUP * KWL + NT - 1) / NT;
constexpr int VPH = (GROUP * VWH + NT - 1) / NT;
constexpr int VPL = (GROUP * VWL + NT - 1) / NT;
constexpr int NPT = (2 * GROUP + NT - 1) / NT;  // norms a thread loads ahead
constexpr int MW = (HD + 31) / 32;
constexpr int KLVH = KNH > 0 ? (1 << KBH) : 0;
constexpr int VLVH = VNH > 0 ? (1 << VBH) : 0;
constexpr int KAX = 2 * HD + KLVH + (1 << KBL);
constexpr int VAX = 2 * HD + VLVH + (1 << VBL);
constexpr unsigned int KMH = (1u << KBH) - 1u;
constexpr unsigned int KML = (1u << KBL) - 1u;
constexpr unsigned int VMH = (1u << VBH) - 1u;
constexpr unsigned int VML = (1u << VBL) - 1u;
constexpr int KCH = KNH / LPT;  // hi channels a scoring lane holds (the host: LPT divides)
constexpr int KCL = KNL / LPT;
constexpr int TPP = NT / LPT;               // tokens scored per pass
constexpr int VCH = VNH > 0 ? VCHH : 1;   // value channels a chunk holds (hi part; the host's)
constexpr int VCM = VCH > VCL ? VCH : VCL;
constexpr int OR = (MB * HD + NT - 1) / NT; // (row, channel) outputs per thread
constexpr int CPT = NT % HD == 0 ? 1 : (HD % NT == 0 ? HD / NT : OR);  // channels among them
constexpr int SRL = LPT < MB ? LPT : MB;  // a token's lanes holding rows after the reduce-scatter
constexpr int SRN = MB / SRL;             // rows each of them holds
constexpr int VRL = VTS < VCM * MB ? VTS : VCM * MB;  // as SRL, SRN for the value sums
constexpr int VRN = VCM * MB / VRL;
constexpr int EPT = MB * HD / NT;  // butterfly entries per thread (the host: NT divides MB HD)
constexpr int KBK = KBKH > KBKL ? KBKH : KBKL;
constexpr int VBK = VBKH > VBKL ? VBKH : VBKL;
constexpr float NEG = -1.0e30f;

const int tid = vx_tid;
VX_ASSUME(tid >= 0 && tid < NT);  // (the host launches NT threads a threadgroup)
const int lane = tid & 31;
const int warp = tid >> 5;
const int nsplit = vx_ngx;
const int split = vx_gx;
const int bh = vx_gy;
const int mblk = vx_gz;
const int H = klc_shape[1];
const int T = klc_shape[2];
const int MP = q_shape[2];
const int b = bh / H;
const int h = bh - b * H;
const int ngroups = T / GROUP;
const int gspan = (ngroups + nsplit - 1) / nsplit;
const int g0 = split * gspan;
const int g1 = vx_imin(ngroups, g0 + gspan);
const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));

VX_SHARED float kax_s[KAX];
VX_SHARED float vax_s[VAX];
VX_SHARED float buf[MB * HD];
VX_SHARED float qs[MB * HD];
VX_SHARED unsigned int cw[GROUP * CW + 1];  // (+1: a chunk's second word)
VX_SHARED float nrm[2 * GROUP];
VX_SHARED float sc[GROUP * MB];
VX_SHARED unsigned int kmk_s[MW];
VX_SHARED unsigned int vmk_s[MW];
VX_SHARED float run_max[MB];
VX_SHARED float run_sum[MB];
VX_SHARED float alpha[MB];

for (int i = tid; i < KAX; i += NT) {
  kax_s[i] = kax[i];
}
for (int i = tid; i < VAX; i += NT) {
  vax_s[i] = vax[i];
}
if (tid < MB) {
  run_max[tid] = NEG;
  run_sum[tid] = 0.0f;
}

const int64_t q_b = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1];
for (int i = tid; i < MB * HD; i += NT) {
  const int m = i / HD;
  const int c = i - m * HD;
  qs[i] = static_cast<float>(q[q_b + (int64_t)(mblk * MB + m) * q_strides[2] +
                               (int64_t)c * q_strides[3]]) * qmul;
}
if (tid == 0) {
  cw[GROUP * CW] = 0u;
}

const int64_t khc_b = KNH > 0 ? (int64_t)b * khc_strides[0] + (int64_t)h * khc_strides[1] : 0;
const int64_t khn_b = KNH > 0 ? (int64_t)b * khn_strides[0] + (int64_t)h * khn_strides[1] : 0;
const int64_t kmk_b = KNH > 0 ? (int64_t)b * kmk_strides[0] + (int64_t)h * kmk_strides[1] : 0;
const int64_t klc_b = (int64_t)b * klc_strides[0] + (int64_t)h * klc_strides[1];
const int64_t kln_b = (int64_t)b * kln_strides[0] + (int64_t)h * kln_strides[1];
const int64_t vhc_b = VNH > 0 ? (int64_t)b * vhc_strides[0] + (int64_t)h * vhc_strides[1] : 0;
const int64_t vhn_b = VNH > 0 ? (int64_t)b * vhn_strides[0] + (int64_t)h * vhn_strides[1] : 0;
const int64_t vmk_b = VNH > 0 ? (int64_t)b * vmk_strides[0] + (int64_t)h * vmk_strides[1] : 0;
const int64_t vlc_b = (int64_t)b * vlc_strides[0] + (int64_t)h * vlc_strides[1];
const int64_t vln_b = (int64_t)b * vln_strides[0] + (int64_t)h * vln_strides[1];

// the running output: (row, channel) pairs tid + NT r, in the model's domain
float out[OR];
#pragma unroll
for (int r = 0; r < OR; ++r) {
  out[r] = 0.0f;
}

// records are loaded into registers one phase ahead of their use (the next group's keys
// during this group's values, this group's values during its scoring), so the loads'
// latency overlaps the other phases; the loop starts one group early to load the first keys
unsigned int kpre[KPH + KPL];
unsigned int vpre[VPH + VPL];
float knpre[NPT];
float vnpre[NPT];
unsigned int kmpre = 0u;
unsigned int vmpre = 0u;
for (int g = g0 - 1; g < g1; ++g) {
  const int t0 = g * GROUP;
  if (g >= g0) {  // (g = g0 - 1: the first group's keys are only loaded, below)
    // ---- A. key records to threadgroup memory (this group's values loaded); the query --
    // the key records loaded ahead, to threadgroup memory
#pragma unroll
    for (int r = 0; r < KPH; ++r) {
      const int i = tid + NT * r;
      if (i < GROUP * KWH) {
        const int tok = i / KWHD;
        cw[tok * CW + (i - tok * KWHD)] = kpre[r];
      }
    }
#pragma unroll
    for (int r = 0; r < KPL; ++r) {
      const int i = tid + NT * r;
      if (i < GROUP * KWL) {
        const int tok = i / KWL;
        cw[tok * CW + KWH + (i - tok * KWL)] = kpre[KPH + r];
      }
    }
#pragma unroll
    for (int r = 0; r < NPT; ++r) {
      const int i = tid + NT * r;
      if (i < 2 * GROUP) {
        nrm[i] = knpre[r];
      }
    }
    if (KNH > 0 && tid < MW) {
      kmk_s[tid] = kmpre;
    }
    {  // value codes, norms and mask of group g into registers
      const int tq = t0;
      const int64_t hg = vhc_b + (int64_t)tq * (VNH > 0 ? vhc_strides[2] : 0);
      const int64_t lg = vlc_b + (int64_t)tq * vlc_strides[2];
#pragma unroll
      for (int r = 0; r < VPH; ++r) {
        const int i = tid + NT * r;
        const int tok = i / VWHD;
        vpre[r] = i < GROUP * VWH ? vhc[hg + (int64_t)tok * vhc_strides[2] +
                                        (int64_t)(i - tok * VWHD) * vhc_strides[3]]
                                  : 0u;
      }
#pragma unroll
      for (int r = 0; r < VPL; ++r) {
        const int i = tid + NT * r;
        const int tok = i / VWL;
        vpre[VPH + r] = i < GROUP * VWL ? vlc[lg + (int64_t)tok * vlc_strides[2] +
                                              (int64_t)(i - tok * VWL) * vlc_strides[3]]
                                        : 0u;
      }
#pragma unroll
      for (int r = 0; r < NPT; ++r) {
        const int i = tid + NT * r;
        float nv = 0.0f;
        if (i < GROUP) {
          if (VNH > 0) {
            nv = static_cast<float>(vhn[vhn_b + (int64_t)(tq + i) * vhn_strides[2]]);
          }
        } else if (i < 2 * GROUP) {
          nv = static_cast<float>(vln[vln_b + (int64_t)(tq + i - GROUP) * vln_strides[2]]);
        }
        vnpre[r] = nv;
      }
      if (VNH > 0 && tid < MW) {
        vmpre = vmk[vmk_b + (int64_t)(g) * vmk_strides[2] + (int64_t)tid * vmk_strides[3]];
      }
    }
    VX_BARRIER();
    {
      // entry i = tid + NT r: row i / HD, channel i % HD, whose slot comes from the mask's
      // popcounts; a thread's entries cycle through CPT channels (one where NT is a multiple
      // of HD, HD / NT where NT divides HD), so each channel's slot is found once
      int dsts[CPT];
      float fs[CPT];
#pragma unroll
      for (int r = 0; r < OR; ++r) {
        const int i = tid + NT * r;
        if (i < MB * HD) {
          const int m = i / HD;
          const int c = i - m * HD;
          const int k = r % CPT;
          if (r < CPT) {
            int j = c;
            bool hi = false;
            if (KNH > 0) {
              const int wc = c >> 5;
              const unsigned int below = kmk_s[wc] & ((1u << (c & 31)) - 1u);
              int rank = vx_popcount(below);
#pragma unroll
              for (int w = 0; w < MW - 1; ++w) {
                rank += w < wc ? vx_popcount(kmk_s[w]) : 0;
              }
              hi = ((kmk_s[wc] >> (c & 31)) & 1u) != 0u;
              j = hi ? vx_imin(rank, KNH - 1) : vx_imin(c - rank, KNL - 1);
            }
            dsts[k] = hi ? (int)kax_s[KNH + j] : KNH + (int)kax_s[2 * KNH + KNL + j];
            fs[k] = kax_s[hi ? j : 2 * KNH + j];
          }
          buf[m * HD + dsts[k]] = qs[i] * fs[k];
        }
      }
    }
    VX_BARRIER();
    {
      // each thread holds EPT consecutive entries of the (rows x channels) buffer: stages
      // shorter than EPT in registers, shorter than 32 EPT across the warp's lanes (shuffles),
      // longer ones through threadgroup memory
      float x[EPT];
      const int e0 = tid * EPT;
      const int blk = e0 % HD < KNH ? KBKH : KBKL;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        x[e] = buf[e0 + e];
      }
#pragma unroll
      for (int hs = 1; hs < KBK; hs <<= 1) {
        if (hs < EPT) {
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            if ((e & hs) == 0 && hs < blk) {
              const float x0 = x[e];
              const float x1 = x[e + hs];
              x[e] = x0 + x1;
              x[e + hs] = x0 - x1;
            }
          }
        } else if (hs < 32 * EPT) {
          const int lm = hs / EPT;
          const bool lower = (lane & lm) == 0;
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            const float y = vx_shfl_xor(x[e], lm);
            if (hs < blk) {
              x[e] = lower ? x[e] + y : y - x[e];
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            buf[e0 + e] = x[e];
          }
          VX_BARRIER();
          const bool lower = (e0 & hs) == 0;
          float y[EPT];
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            y[e] = buf[(e0 + e) ^ hs];
          }
          VX_BARRIER();
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            if (hs < blk) {
              x[e] = lower ? x[e] + y[e] : y[e] - x[e];
            }
          }
        }
      }
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        buf[e0 + e] = x[e];
      }
    }
    VX_BARRIER();
    // ---- B. scores of the group's tokens -> sc[tok * MB + m] ----------------------------
    // lane jj of a token takes channels [jj KCH, (jj + 1) KCH) of the hi part and
    // [jj KCL, (jj + 1) KCL) of the lo part: one chunk of at most 32 bits each (the host's
    // choice of LPT), so the codes come out at shifts known at compile time
    {
      const int ts = tid / LPT;
      const int jj = tid - ts * LPT;
      float qh[MB][KCH > 0 ? KCH : 1];
      float ql[MB][KCL];
#pragma unroll
      for (int m = 0; m < MB; ++m) {
#pragma unroll
        for (int e = 0; e < KCH; ++e) {
          qh[m][e] = buf[m * HD + jj * KCH + e];
        }
#pragma unroll
        for (int e = 0; e < KCL; ++e) {
          ql[m][e] = buf[m * HD + KNH + jj * KCL + e];
        }
      }
      const int hb = jj * (KCH * KBH);
      const int lb = KWH * 32 + jj * (KCL * KBL);
#pragma unroll 2
      for (int base = 0; base < GROUP; base += TPP) {
        const int tok = vx_imin(base + ts, GROUP - 1);
        const int rb = tok * CW;
        float s[MB];
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          s[m] = 0.0f;
        }
        if (KCH > 0) {
          const int wi = rb + (hb >> 5);
          const int sh = hb & 31;
          const unsigned int chunk = sh == 0 ? cw[wi] : (cw[wi] >> sh) | (cw[wi + 1] << (32 - sh));
          float dh[MB];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            dh[m] = 0.0f;
          }
#pragma unroll
          for (int e = 0; e < KCH; ++e) {
            const float f = kax_s[2 * HD + ((chunk >> (e * KBH)) & KMH)];
#pragma unroll
            for (int m = 0; m < MB; ++m) {
              dh[m] = vx_fma(qh[m][e], f, dh[m]);
            }
          }
          const float nh = nrm[tok];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            s[m] = nh * dh[m];
          }
        }
        {
          const int wi = rb + (lb >> 5);
          const int sh = lb & 31;
          const unsigned int chunk = sh == 0 ? cw[wi] : (cw[wi] >> sh) | (cw[wi + 1] << (32 - sh));
          float dl[MB];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            dl[m] = 0.0f;
          }
#pragma unroll
          for (int e = 0; e < KCL; ++e) {
            const float f = kax_s[2 * HD + KLVH + ((chunk >> (e * KBL)) & KML)];
#pragma unroll
            for (int m = 0; m < MB; ++m) {
              dl[m] = vx_fma(ql[m][e], f, dl[m]);
            }
          }
          const float nl = nrm[GROUP + tok];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            s[m] = vx_fma(nl, dl[m], s[m]);
          }
        }
        // the token's LPT lanes add up their rows by a reduce-scatter (velox_kernels.h):
        // lanes jj < SRL end with SRN rows each
        vx_reduce_scatter<MB, LPT>(s, jj);
        if (jj < SRL && base + ts < GROUP) {
          const int row = vx_scatter_first<MB, LPT>(jj);
#pragma unroll
          for (int e = 0; e < SRN; ++e) {
            sc[tok * MB + row + e] = s[e];
          }
        }
      }
    }
    VX_BARRIER();
    // ---- C. online softmax over the group; value codes, norms and mask staged ------------
    for (int m = warp; m < MB; m += NWARPS) {
      float top = NEG;
      for (int tok = lane; tok < GROUP; tok += 32) {
        top = vx_max(top, sc[tok * MB + m]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        top = vx_max(top, vx_shfl_xor(top, off));
      }
      const float old = run_max[m];
      const float nm = vx_max(old, top);
      float sum = 0.0f;
      for (int tok = lane; tok < GROUP; tok += 32) {
        const float p = vx_exp2(sc[tok * MB + m] - nm);
        sc[tok * MB + m] = p;
        sum += p;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        sum += vx_shfl_xor(sum, off);
      }
      if (lane == 0) {
        const float a = vx_exp2(old - nm);
        alpha[m] = a;
        run_sum[m] = run_sum[m] * a + sum;
        run_max[m] = nm;
      }
    }
    // the value records loaded ahead, to threadgroup memory
#pragma unroll
    for (int r = 0; r < VPH; ++r) {
      const int i = tid + NT * r;
      if (i < GROUP * VWH) {
        const int tok = i / VWHD;
        cw[tok * CW + (i - tok * VWHD)] = vpre[r];
      }
    }
#pragma unroll
    for (int r = 0; r < VPL; ++r) {
      const int i = tid + NT * r;
      if (i < GROUP * VWL) {
        const int tok = i / VWL;
        cw[tok * CW + VWH + (i - tok * VWL)] = vpre[VPH + r];
      }
    }
#pragma unroll
    for (int r = 0; r < NPT; ++r) {
      const int i = tid + NT * r;
      if (i < 2 * GROUP) {
        nrm[i] = vnpre[r];
      }
    }
    if (VNH > 0 && tid < MW) {
      vmk_s[tid] = vmpre;
    }
  }
  if (g + 1 < g1) {  // key codes, norms and mask of group g + 1 into registers
    {
      const int tq = t0 + GROUP;
      const int64_t hg = khc_b + (int64_t)tq * (KNH > 0 ? khc_strides[2] : 0);
      const int64_t lg = klc_b + (int64_t)tq * klc_strides[2];
#pragma unroll
      for (int r = 0; r < KPH; ++r) {
        const int i = tid + NT * r;
        const int tok = i / KWHD;
        kpre[r] = i < GROUP * KWH ? khc[hg + (int64_t)tok * khc_strides[2] +
                                        (int64_t)(i - tok * KWHD) * khc_strides[3]]
                                  : 0u;
      }
#pragma unroll
      for (int r = 0; r < KPL; ++r) {
        const int i = tid + NT * r;
        const int tok = i / KWL;
        kpre[KPH + r] = i < GROUP * KWL ? klc[lg + (int64_t)tok * klc_strides[2] +
                                              (int64_t)(i - tok * KWL) * klc_strides[3]]
                                        : 0u;
      }
#pragma unroll
      for (int r = 0; r < NPT; ++r) {
        const int i = tid + NT * r;
        float nv = 0.0f;
        if (i < GROUP) {
          if (KNH > 0) {
            nv = static_cast<float>(khn[khn_b + (int64_t)(tq + i) * khn_strides[2]]);
          }
        } else if (i < 2 * GROUP) {
          nv = static_cast<float>(kln[kln_b + (int64_t)(tq + i - GROUP) * kln_strides[2]]);
        }
        knpre[r] = nv;
      }
      if (KNH > 0 && tid < MW) {
        kmpre = kmk[kmk_b + (int64_t)(g + 1) * kmk_strides[2] + (int64_t)tid * kmk_strides[3]];
      }
    }
  }
  if (g >= g0) {
    VX_BARRIER();
    // ---- D. weighted sum of the value levels, in the value parts' rotated domain ---------
    // thread tid takes chunk tid / VTS of the parts' channels (VCH hi or VCL lo channels, at
    // most 32 bits of codes: shifts known at compile time) for the tokens tid % VTS,
    // tid % VTS + VTS, ...; the VTS token sets' sums are added by shuffles
    {
      const int ts = tid & (VTS - 1);
      const int ck = tid / VTS;
      const bool vhi = ck < VNH / VCH;
      const bool vact = ck < VNH / VCH + (HD - VNH) / VCL;
      float acc[VCM * MB];  // (channel e, row m) at e MB + m
#pragma unroll
      for (int e = 0; e < VCM * MB; ++e) {
        acc[e] = 0.0f;
      }
      if (vact) {
        const int cb = vhi ? ck * (VCH * VBH) : VWH * 32 + (ck - VNH / VCH) * (VCL * VBL);
        const int wi0 = cb >> 5;
        const int sh = cb & 31;
#pragma unroll 2
        for (int tok = ts; tok < GROUP; tok += VTS) {
          const int wi = tok * CW + wi0;
          const unsigned int chunk =
              sh == 0 ? cw[wi] : (cw[wi] >> sh) | (cw[wi + 1] << (32 - sh));
          const float nv = vhi ? nrm[tok] : nrm[GROUP + tok];
          float pn[MB];
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            pn[m] = sc[tok * MB + m] * nv;
          }
          if (vhi) {
#pragma unroll
            for (int e = 0; e < VCH; ++e) {
              const float f = vax_s[2 * HD + ((chunk >> (e * VBH)) & VMH)];
#pragma unroll
              for (int m = 0; m < MB; ++m) {
                acc[e * MB + m] = vx_fma(pn[m], f, acc[e * MB + m]);
              }
            }
          } else {
#pragma unroll
            for (int e = 0; e < VCL; ++e) {
              const float f = vax_s[2 * HD + VLVH + ((chunk >> (e * VBL)) & VML)];
#pragma unroll
              for (int m = 0; m < MB; ++m) {
                acc[e * MB + m] = vx_fma(pn[m], f, acc[e * MB + m]);
              }
            }
          }
        }
      }
      // the VTS token sets' sums by a reduce-scatter over the VCM MB accumulators (as the
      // scores' lanes above): sets ts < VRL end with VRN of them each
      vx_reduce_scatter<VCM * MB, VTS>(acc, ts);
      if (vact && ts < VRL) {
        const int c0 = vhi ? ck * VCH : VNH + (ck - VNH / VCH) * VCL;
        const int n = vhi ? VCH : VCL;
        const int idx = vx_scatter_first<VCM * MB, VTS>(ts);
#pragma unroll
        for (int e = 0; e < VRN; ++e) {
          const int ce = (idx + e) / MB;  // channel and row of the accumulator
          const int m = (idx + e) - ce * MB;
          if (ce < n) {
            buf[m * HD + c0 + ce] = acc[e];
          }
        }
      }
    }
    VX_BARRIER();
    // ---- E. back to the model's domain: butterflies, then each channel gathers its slot --
    {
      // each thread holds EPT consecutive entries of the (rows x channels) buffer: stages
      // shorter than EPT in registers, shorter than 32 EPT across the warp's lanes (shuffles),
      // longer ones through threadgroup memory
      float x[EPT];
      const int e0 = tid * EPT;
      const int blk = e0 % HD < VNH ? VBKH : VBKL;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        x[e] = buf[e0 + e];
      }
#pragma unroll
      for (int hs = 1; hs < VBK; hs <<= 1) {
        if (hs < EPT) {
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            if ((e & hs) == 0 && hs < blk) {
              const float x0 = x[e];
              const float x1 = x[e + hs];
              x[e] = x0 + x1;
              x[e + hs] = x0 - x1;
            }
          }
        } else if (hs < 32 * EPT) {
          const int lm = hs / EPT;
          const bool lower = (lane & lm) == 0;
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            const float y = vx_shfl_xor(x[e], lm);
            if (hs < blk) {
              x[e] = lower ? x[e] + y : y - x[e];
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            buf[e0 + e] = x[e];
          }
          VX_BARRIER();
          const bool lower = (e0 & hs) == 0;
          float y[EPT];
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            y[e] = buf[(e0 + e) ^ hs];
          }
          VX_BARRIER();
#pragma unroll
          for (int e = 0; e < EPT; ++e) {
            if (hs < blk) {
              x[e] = lower ? x[e] + y[e] : y[e] - x[e];
            }
          }
        }
      }
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        buf[e0 + e] = x[e];
      }
    }
    VX_BARRIER();
    {
      // (as the query's placement: each of a thread's CPT channels' slots found once)
      int srcs[CPT];
      float fs[CPT];
#pragma unroll
      for (int r = 0; r < OR; ++r) {
        const int i = tid + NT * r;
        if (i < MB * HD) {
          const int m = i / HD;
          const int c = i - m * HD;
          const int k = r % CPT;
          if (r < CPT) {
            int j = c;
            bool hi = false;
            if (VNH > 0) {
              const int wc = c >> 5;
              const unsigned int below = vmk_s[wc] & ((1u << (c & 31)) - 1u);
              int rank = vx_popcount(below);
#pragma unroll
              for (int w = 0; w < MW - 1; ++w) {
                rank += w < wc ? vx_popcount(vmk_s[w]) : 0;
              }
              hi = ((vmk_s[wc] >> (c & 31)) & 1u) != 0u;
              j = hi ? vx_imin(rank, VNH - 1) : vx_imin(c - rank, VNL - 1);
            }
            srcs[k] = hi ? (int)vax_s[VNH + j] : VNH + (int)vax_s[2 * VNH + VNL + j];
            fs[k] = vax_s[hi ? j : 2 * VNH + j];
          }
          out[r] = vx_fma(out[r], alpha[m], buf[m * HD + srcs[k]] * fs[k]);
        }
      }
    }
    // (the next group's first writes to buf, cw, nrm and the masks follow a barrier that every
    // thread reaches after this gather)
  }
}

// ---- the split's partial --------------------------------------------------------------
const int64_t row0 = ((int64_t)bh * nsplit + split) * MP + (int64_t)mblk * MB;
#pragma unroll
for (int r = 0; r < OR; ++r) {
  const int i = tid + NT * r;
  if (i < MB * HD) {
    const int m = i / HD;
    const int c = i - m * HD;
    o_part[(row0 + m) * HD + c] = out[r];
  }
}
VX_BARRIER();
if (tid < MB) {
  ml_part[(row0 + tid) * 2] = run_max[tid];
  ml_part[(row0 + tid) * 2 + 1] = run_sum[tid];
}
