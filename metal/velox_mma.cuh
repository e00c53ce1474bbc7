// velox tensor-core helpers (CUDA only, sm_80 and later): fp16 fragments and mma.sync.
//
// Included after velox_kernels.h by the CUDA kernels that use tensor cores
// (decode_attention_mma.cu). The Metal bodies never include it.
#ifndef VELOX_MMA_CUH
#define VELOX_MMA_CUH

#if !defined(VX_CUDA)
#error "velox_mma.cuh is for the CUDA backend only"
#endif

VX_FN unsigned int vx_h2u(__half2 h) { return *reinterpret_cast<unsigned int*>(&h); }
// a float stored as an output's element type (float, __half or __nv_bfloat16)
template <typename T>
VX_FN void vx_store(T* p, float v) { *p = static_cast<T>(v); }
VX_FN __half2 vx_u2h(unsigned int u) { return *reinterpret_cast<__half2*>(&u); }

// Two floats as one f16x2 register (lo in the low half), rounded to nearest.
VX_FN unsigned int vx_pack_h2(float lo, float hi) { return vx_h2u(__floats2half2_rn(lo, hi)); }

// A stored 16-bit scale or zero as a float: fp16 (BF = 0) or bfloat16 (BF = 1: its bits are
// a float32's high half), read as raw 16-bit units whatever the input's declared type.
template <int BF>
VX_FN float vx_s16f(const unsigned short* p) {
  if (BF) {
    return vx_bits_to_float(static_cast<unsigned int>(*p) << 16);
  }
  return __half2float(*reinterpret_cast<const __half*>(p));
}
// Two stored 16-bit scales (or zeros) as one f16x2 pair, the first in the low half: fp16 as
// they are, bfloat16 rounded to fp16 (exact for magnitudes in [2^-14, 65504]: bfloat16's 8
// significant bits fit fp16's 11; smaller ones become fp16 subnormals, larger ones infinity).
template <int BF>
VX_FN __half2 vx_s16h2(const unsigned short* p0, const unsigned short* p1) {
  if (BF) {
    return __floats2half2_rn(vx_s16f<1>(p0), vx_s16f<1>(p1));
  }
  return __halves2half2(*reinterpret_cast<const __half*>(p0), *reinterpret_cast<const __half*>(p1));
}
// Two stored 16-bit scales (or zeros) from words of a row (two units each, the first in the
// low half) as one f16x2 pair times `mul` (a power of two, at most 1): unit `odd` of word lo
// in the low half, the same unit of word hi in the high half (one permute). fp16 as they are
// (times mul by one HMUL2 where it is not 1), bfloat16 rounded to fp16 as vx_s16h2 does.
template <int BF>
VX_FN __half2 vx_s16h2_words(unsigned int lo, unsigned int hi, int odd, float mul) {
  const unsigned int u = __byte_perm(lo, hi, odd ? 0x7632u : 0x5410u);
  if (BF) {
    return __floats2half2_rn(vx_bits_to_float(u << 16) * mul, vx_bits_to_float(u & 0xffff0000u) * mul);
  }
  return mul == 1.0f ? vx_u2h(u) : __hmul2(vx_u2h(u), __float2half2_rn(mul));
}

// Codebook codes (KCB / VCB: Lloyd-Max levels) as fp16 MMA operands, looked up
// in registers with byte permutes. The 2^BITS float32 levels become fp16 once per thread:
// at 2 bits the four levels as two f16x2 words (r[0] = levels 0, 1; r[1] = 2, 3); at 4 bits
// the low bytes of the 16 levels in r[0..3] (levels 4i .. 4i + 3 in word i) and their high
// bytes in r[4..7], since a byte permute picks bytes out of 8. SYM (levels the host found
// symmetric and ascending) at 2 bits: the inner magnitude L[2] in both halves of r[0], and the
// outer one's fp16 bits less the inner one's (L[3] - L[2] as fp16 bit patterns) in r[1].
template <int BITS, int SYM>
VX_FN void vx_lut_load(unsigned int (&r)[8], const float* lev) {
  if (BITS == 2 && SYM) {
    const unsigned int u = vx_pack_h2(lev[2], lev[3]);
    r[0] = (u & 0xffffu) * 0x00010001u;
    r[1] = (u >> 16) - (u & 0xffffu);
    return;
  }
  if (BITS == 2) {
    r[0] = vx_pack_h2(lev[0], lev[1]);
    r[1] = vx_pack_h2(lev[2], lev[3]);
    return;
  }
  for (int i = 0; i < 4; ++i) {
    const unsigned int u0 = vx_pack_h2(lev[4 * i], lev[4 * i + 1]);
    const unsigned int u1 = vx_pack_h2(lev[4 * i + 2], lev[4 * i + 3]);
    r[i] = __byte_perm(u0, u1, 0x6420u);      // low bytes of levels 4i .. 4i + 3
    r[4 + i] = __byte_perm(u0, u1, 0x7531u);  // their high bytes
  }
}
// 2-bit codes: the levels of the codes at bit o (even, below 8) of each 16-bit half of x as one
// f16x2 pair (the low half's first): the two codes become the byte selector (2a, 2a + 1, 2b,
// 2b + 1) and one permute of the two level words picks both fp16 levels. 5 instructions.
VX_FN unsigned int vx_lut2_pair(unsigned int x, int o, const unsigned int (&r)[8]) {
  const unsigned int c = (x >> o) & 0x00030003u;           // a at bit 0, b at bit 16
  const unsigned int z = c * 0x22u + 0x00100010u;          // bytes 0 and 2: (2a, 2a + 1), (2b, 2b + 1)
  return __byte_perm(r[0], r[1], __byte_perm(z, 0u, 0x0020u));
}
// vx_lut2_pair for symmetric ascending levels (-L3, -L2, L2, L3, which the host checks) without
// a permute: codes 0 and 3 take the outer magnitude (bits 0 and 1 equal), added to the inner
// one's bit pattern in each half by one multiply-add, and codes 0 and 1 (bit 1 clear) the sign.
VX_FN unsigned int vx_lut2s_pair(unsigned int x, int o, const unsigned int (&r)[8]) {
  const unsigned int outer = ~(x ^ (x >> 1));  // bit 2i: code i is 0 or 3 (once a word)
  const unsigned int v = ((outer >> o) & 0x00010001u) * r[1] + r[0];
  return v ^ (~(x << (14 - o)) & 0x80008000u);  // bits o + 1 (clear: negative) to 15 and 31
}
// 4-bit codes: a word's 8 codes (a0..a3 in the low half, b0..b3 in the high half) as the four
// f16x2 pairs out[j] = (L[a_j], L[b_j]), the pairs a fragment takes (a key word's channels j
// and j + 4; a value unit pair's token pair). Per half and byte plane, one permute picks the
// bytes of levels c & 7 among 0..7, one among 8..15, and a third keeps, byte by byte, the one
// bit 3 of the code names (its selector nibble i + 4 bit3); eight permutes then interleave the
// low and high bytes into fp16 pairs. 27 instructions a word.
VX_FN void vx_lut4_word(unsigned int x, const unsigned int (&r)[8], unsigned int (&out)[4]) {
  const unsigned int xs = x >> 16;
  const unsigned int sa = x & 0x7777u, sb = xs & 0x7777u;
  const unsigned int ma = ((x >> 1) & 0x4444u) | 0x3210u;
  const unsigned int mb = ((xs >> 1) & 0x4444u) | 0x3210u;
  const unsigned int loa = __byte_perm(__byte_perm(r[0], r[1], sa), __byte_perm(r[2], r[3], sa), ma);
  const unsigned int lob = __byte_perm(__byte_perm(r[0], r[1], sb), __byte_perm(r[2], r[3], sb), mb);
  const unsigned int hia = __byte_perm(__byte_perm(r[4], r[5], sa), __byte_perm(r[6], r[7], sa), ma);
  const unsigned int hib = __byte_perm(__byte_perm(r[4], r[5], sb), __byte_perm(r[6], r[7], sb), mb);
  const unsigned int x01 = __byte_perm(loa, lob, 0x5140u);  // lo a0, lo b0, lo a1, lo b1
  const unsigned int y01 = __byte_perm(hia, hib, 0x5140u);  // hi a0, hi b0, hi a1, hi b1
  const unsigned int x23 = __byte_perm(loa, lob, 0x7362u);
  const unsigned int y23 = __byte_perm(hia, hib, 0x7362u);
  out[0] = __byte_perm(x01, y01, 0x5140u);  // lo a0, hi a0, lo b0, hi b0
  out[1] = __byte_perm(x01, y01, 0x7362u);
  out[2] = __byte_perm(x23, y23, 0x5140u);
  out[3] = __byte_perm(x23, y23, 0x7362u);
}
// vx_lut4_word for a symmetric codebook (L[15 - c] = -L[c] in fp16, which the host checks):
// L[c] = N[k] for c < 8 and -N[k] for c >= 8, with k = c ^ (7 if bit 3 of c) and N the levels
// 0..7 (their low bytes in r[0..1], high bytes in r[4..5], as vx_lut_load leaves them). One
// permute first orders the word's codes a0 a1 b0 b1 | a2 a3 b2 b3 (nibbles), so that one
// lookup a byte plane and half covers two output pairs; the codes' bits 3, moved to the tops
// of the high bytes by one permute a half, flip the signs; four permutes interleave the low
// and high bytes into the pairs. 19 instructions a word (11 PRMTs).
VX_FN void vx_lut4s_word(unsigned int x, const unsigned int (&r)[8], unsigned int (&out)[4]) {
  const unsigned int y = __byte_perm(x, 0u, 0x3120u);  // bytes (a1 a0) (b1 b0) (a3 a2) (b3 b2)
  const unsigned int k = (y ^ (((y >> 3) & 0x11111111u) * 7u)) & 0x77777777u;
  const unsigned int kh = k >> 16;
  const unsigned int y4 = y << 4;  // bits 3 of nibbles 0, 2 (4, 6) at the tops of bytes 0, 1 (2, 3)
  const unsigned int lo01 = __byte_perm(r[0], r[1], k);   // lo a0, lo a1, lo b0, lo b1
  const unsigned int lo23 = __byte_perm(r[0], r[1], kh);  // lo a2, lo a3, lo b2, lo b3
  const unsigned int hi01 = __byte_perm(r[4], r[5], k) ^ (__byte_perm(y4, y, 0x5140u) & 0x80808080u);
  const unsigned int hi23 = __byte_perm(r[4], r[5], kh) ^ (__byte_perm(y4, y, 0x7362u) & 0x80808080u);
  out[0] = __byte_perm(lo01, hi01, 0x6240u);  // lo a0, hi a0, lo b0, hi b0
  out[1] = __byte_perm(lo01, hi01, 0x7351u);
  out[2] = __byte_perm(lo23, hi23, 0x6240u);
  out[3] = __byte_perm(lo23, hi23, 0x7351u);
}
// pair j of vx_lut4_word (SYM: vx_lut4s_word; the compiler computes a word's lookups once for
// its four pairs)
template <int SYM>
VX_FN unsigned int vx_lut4_pair(unsigned int x, int j, const unsigned int (&r)[8]) {
  unsigned int out[4];
  if (SYM) {
    vx_lut4s_word(x, r, out);
  } else {
    vx_lut4_word(x, r, out);
  }
  return out[j];
}

#if !defined(VX_CUDA_EMULATE)

// (x & m) | c as one LOP3 (written in C, the compiler emits two, one per immediate constant)
VX_FN unsigned int vx_and_or(unsigned int x, unsigned int m, unsigned int c) {
  unsigned int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(x), "r"(m), "r"(c));
  return r;
}

// D = A * B + D for one m16n8k16 tile: A row-major 16 x 16 fp16 (4 registers), B column-major
// 16 x 8 fp16 (2 registers), D 16 x 8 float32 (4 registers), in the PTX fragment layouts.
VX_FN void vx_mma16816(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                       unsigned int a3, unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D = A * B for one m16n8k16 tile (no accumulator in: the C operand is zero, which ptxas
// takes from the zero register instead of four moves)
VX_FN void vx_mma16816_zc(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                          unsigned int a3, unsigned int b0, unsigned int b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

// 2^x as one MUFU.EX2 (ex2.approx.ftz: about 2 ulp, results below 2^-126 flushed to zero) for
// the softmax weights, where exp2f adds a range check and two scalings per call to keep
// subnormal results: a weight below 2^-126 vanishes beside its row's sum, which holds the
// row's max at weight 1 or more.
VX_FN float vx_exp2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// The transpose of an 8 x 8 fp16 matrix held in the C layout (lane 4 r + c / 2 holds row r,
// columns c, c + 1 as one f16x2 register): lane 4 r + c / 2 gets rows c, c + 1 of column r.
VX_FN unsigned int vx_movmatrix_trans(unsigned int x) {
  unsigned int r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Four (two) 8 x 8 matrices of 16-bit elements from shared memory (ldmatrix, sm_75+): lane
// 8 i + r gives the address of row r of matrix i (16 bytes, 16-byte aligned; with two
// matrices lanes 16 to 31 give ignored addresses). Lane 4 g + t gets, in register i, matrix
// i's row g, elements 2t and 2t + 1 (TRANS = 0), or its elements (2t, g) and (2t + 1, g)
// (TRANS = 1: row g of the transpose), the first in the low half.
template <int TRANS>
VX_FN void vx_ldmatrix_x4(unsigned int& r0, unsigned int& r1, unsigned int& r2, unsigned int& r3,
                          const void* row) {
  const unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
  }
}
template <int TRANS>
VX_FN void vx_ldmatrix_x2(unsigned int& r0, unsigned int& r1, const void* row) {
  const unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(a) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(a) : "memory");
  }
}

// Asynchronous global -> shared copies (cp.async, sm_80+): `src_bytes` of 4 copied, the rest
// of the destination zero-filled (0 reads nothing); 16-byte copies whole.
VX_FN void vx_cp_async4(void* dst, const void* src, int src_bytes) {
  const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
VX_FN void vx_cp_async16(void* dst, const void* src) {
  const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
VX_FN void vx_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
VX_FN void vx_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bulk copies (sm_90 and later): one thread copies `bytes` (a multiple of 16, both addresses
// 16-byte aligned) from global to shared memory with the tensor memory accelerator, and the
// copy's completion is counted on an mbarrier in shared memory (its transaction count). One
// instruction per contiguous block instead of one 16-byte cp.async per lane and chunk.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VX_HAS_BULK 1
VX_FN unsigned int vx_smem(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
// an mbarrier expecting `count` arrivals per phase, made visible to the bulk-copy unit
VX_FN void vx_mbar_init(unsigned long long* bar, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(vx_smem(bar)), "r"(count) : "memory");
}
VX_FN void vx_mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
// one arrival that also expects `bytes` of bulk copies in the current phase
VX_FN void vx_mbar_arrive_tx(unsigned long long* bar, unsigned int bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                   vx_smem(bar)),
               "r"(bytes)
               : "memory");
}
// one arrival (a phase whose data came another way)
VX_FN void vx_mbar_arrive(unsigned long long* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(vx_smem(bar))
               : "memory");
}
// wait until the phase of parity `parity` has completed (its bytes have landed)
VX_FN void vx_mbar_wait(unsigned long long* bar, unsigned int parity) {
  unsigned int done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(vx_smem(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
VX_FN void vx_bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          vx_smem(dst)),
      "l"(src), "r"(bytes), "r"(vx_smem(bar))
      : "memory");
}
#else
#define VX_HAS_BULK 0
#endif

#else  // CPU emulation (metal/shim/cuda_emu): the same semantics, computed lane by lane

VX_FN unsigned int vx_and_or(unsigned int x, unsigned int m, unsigned int c) { return (x & m) | c; }

VX_FN float vx_exp2_ftz(float x) {
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
}

VX_FN float vx_emu_half(unsigned int reg, int hi) {
  const __half2 h = vx_u2h(reg);
  return float(hi ? h.y : h.x);
}

// Every lane publishes its fragments; each computes its four outputs from the PTX layouts:
// A (r, k): lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2;
// B (k, n): lane 4 n + (k % 8) / 2, register (k >= 8), half k % 2;
// C/D (r, n): lane 4 (r % 8) + n / 2, element 2 (r >= 8) + n % 2.
VX_FN void vx_mma16816(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                       unsigned int a3, unsigned int b0, unsigned int b1) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  const int lane = vx_cuemu::g_lane;
  vx_cuemu::MmaSlot& mine = w.mma[lane];
  mine.a[0] = a0;
  mine.a[1] = a1;
  mine.a[2] = a2;
  mine.a[3] = a3;
  mine.b[0] = b0;
  mine.b[1] = b1;
  w.bar.wait();
  const int g = lane >> 2;
  const int t = lane & 3;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e >> 1);
    const int n = 2 * t + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const vx_cuemu::MmaSlot& sa = w.mma[4 * (r % 8) + (k % 8) / 2];
      const vx_cuemu::MmaSlot& sb = w.mma[4 * n + (k % 8) / 2];
      const float av = vx_emu_half(sa.a[(r >= 8) + 2 * (k >= 8)], k % 2);
      const float bv = vx_emu_half(sb.b[k >= 8], k % 2);
      acc += av * bv;
    }
    out[e] = acc;
  }
  w.bar.wait();
  for (int e = 0; e < 4; ++e) {
    d[e] = out[e];
  }
}

// emulated: zero the accumulators, then the MMA
VX_FN void vx_mma16816_zc(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                          unsigned int a3, unsigned int b0, unsigned int b1) {
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  vx_mma16816(d, a0, a1, a2, a3, b0, b1);
}

VX_FN unsigned int vx_movmatrix_trans(unsigned int x) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  const int lane = vx_cuemu::g_lane;
  w.mma[lane].a[0] = x;
  w.bar.wait();
  const int r = lane >> 2;       // the output's row: the input's column r
  const int c = 2 * (lane & 3);  // its columns c, c + 1: the input's rows
  const __half2 lo = vx_u2h(w.mma[4 * c + r / 2].a[0]);
  const __half2 hi = vx_u2h(w.mma[4 * (c + 1) + r / 2].a[0]);
  const unsigned int out = vx_h2u(__halves2half2(r % 2 ? lo.y : lo.x, r % 2 ? hi.y : hi.x));
  w.bar.wait();
  return out;
}

// ldmatrix: every lane publishes its row address; each reads its elements through them
template <int TRANS>
VX_FN void vx_emu_ldmatrix(unsigned int* r, int n, const void* row) {
  vx_cuemu::Warp& w = vx_cuemu::warp();
  const int lane = vx_cuemu::g_lane;
  w.slot[lane] = reinterpret_cast<uint64_t>(row);
  w.bar.wait();
  const int g = lane >> 2;
  const int t = lane & 3;
  auto at = [&](int m, int rr, int c) {  // element (rr, c) of matrix m
    unsigned short e;
    std::memcpy(&e, reinterpret_cast<const unsigned char*>(w.slot[8 * m + rr]) + 2 * c, 2);
    return static_cast<unsigned int>(e);
  };
  unsigned int out[4];
  for (int m = 0; m < n; ++m) {
    out[m] = TRANS ? at(m, 2 * t, g) | (at(m, 2 * t + 1, g) << 16)
                   : at(m, g, 2 * t) | (at(m, g, 2 * t + 1) << 16);
    for (int r = 0; r < 8; ++r) {  // a row not 16-byte aligned: fp16 NaNs, so a test fails
      if (w.slot[8 * m + r] % 16 != 0) {
        out[m] = 0x7e007e00u;
      }
    }
  }
  w.bar.wait();
  for (int m = 0; m < n; ++m) {
    r[m] = out[m];
  }
}
template <int TRANS>
VX_FN void vx_ldmatrix_x4(unsigned int& r0, unsigned int& r1, unsigned int& r2, unsigned int& r3,
                          const void* row) {
  unsigned int r[4];
  vx_emu_ldmatrix<TRANS>(r, 4, row);
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}
template <int TRANS>
VX_FN void vx_ldmatrix_x2(unsigned int& r0, unsigned int& r1, const void* row) {
  unsigned int r[4];
  vx_emu_ldmatrix<TRANS>(r, 2, row);
  r0 = r[0];
  r1 = r[1];
}

VX_FN void vx_cp_async4(void* dst, const void* src, int src_bytes) {
  unsigned char buf[4] = {0, 0, 0, 0};
  if (src_bytes > 0) {
    std::memcpy(buf, src, src_bytes);
  }
  std::memcpy(dst, buf, 4);
}
VX_FN void vx_cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
VX_FN void vx_cp_commit() {}
template <int N>
VX_FN void vx_cp_wait() {}

// bulk copies: synchronous copies, the mbarrier bookkeeping has nothing to wait for (the warp
// barrier that follows every wait orders the lanes)
#define VX_HAS_BULK 1
VX_FN void vx_mbar_init(unsigned long long* bar, unsigned int) { *bar = 0; }
VX_FN void vx_mbar_fence_init() {}
VX_FN void vx_mbar_arrive_tx(unsigned long long*, unsigned int) {}
VX_FN void vx_mbar_arrive(unsigned long long*) {}
VX_FN void vx_mbar_wait(unsigned long long*, unsigned int) {}
VX_FN void vx_bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long*) {
  std::memcpy(dst, src, bytes);
}

#endif  // VX_CUDA_EMULATE

// The codes at bits [o, o + bits) and [16 + o, 16 + o + bits) of x (o + bits <= 10), decoded to
// scale * code + zero in both halves without a shift: the masked code is OR-ed into the
// mantissa of 2^(10 - o), whose mantissa unit at bit o is 1, giving 2^(10 - o) + code
// exactly; subtracting 2^(10 - o) leaves the code, and one fp16 FMA applies scale and zero.
// Three instructions per pair (LOP3, HADD2, HFMA2), constants folded where o is known.
VX_FN unsigned int vx_dequant_at(unsigned int x, int o, int bits, __half2 s2, __half2 z2) {
  const unsigned int m = (((1u << bits) - 1u) << o) * 0x00010001u;
  const unsigned int magic = ((25u - static_cast<unsigned int>(o)) << 10) * 0x00010001u;
  const __half2 c = __hsub2(vx_u2h(vx_and_or(x, m, magic)), vx_u2h(magic));
  return vx_h2u(__hfma2(c, s2, z2));
}

// The codes at bits [o, o + bits) and [16 + o, 16 + o + bits) of x masked in place (one LOP3):
// with o + bits <= 10 no exponent bit is set, so each half is the fp16 subnormal
// code * 2^(o - 24), exactly, and fp16 MMAs take subnormal operands exactly (checked on an
// H200: tests/test_gpu_attention.py). A product with such codes carries the factor
// 2^(o - 24), taken out by the other operand (the query's channels times 2^-o) or by the sum
// (the value accumulators times 2^(24 - o)); no power of two is added, so nothing cancels.
VX_FN unsigned int vx_code_sub(unsigned int x, int o, int bits) {
  return x & ((((1u << bits) - 1u) << o) * 0x00010001u);
}

// ---- shared by the tensor-core decode kernels (decode_attention_mma.cu, _sketch_mma.cu) --------
// Lane 4 g + t holds the C layout's columns 2t, 2t + 1: two query rows, with a running max
// mrow and sum lrow each and, per m-tile j, the output accumulators oacc[j] (elements 0, 2 of
// row 2t, 1, 3 of row 2t + 1).

// One online-softmax step of the lane's two rows with a lazy max: where any lane's new scores
// (its maxima lmax) exceed its rows' running max by more than `rescale` (one vote), the rows'
// maxima are reduced over the 8 lanes of t and raised, and lrow and oacc rescaled; returns
// whether they were, with the factors in alpha (for the caller's other accumulators).
template <int NTM>
VX_FN bool vx_softmax_raise(const float (&lmax)[2], float (&mrow)[2], float (&lrow)[2],
                            float (&oacc)[NTM][4], float rescale, float (&alpha)[2]) {
  if (!vx_any(lmax[0] > mrow[0] + rescale || lmax[1] > mrow[1] + rescale)) {
    return false;
  }
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
  return true;
}

// A warp's rows' (m, l) into the threadgroup's red_m / red_l (8 rows a warp), from the lanes of
// g = 0 (lrow already summed over the 8 lanes of t).
VX_FN void vx_store_warp_rows(float* red_m, float* red_l, int warp, int g, int t,
                              const float (&mrow)[2], const float (&lrow)[2]) {
  if (g == 0) {
    red_m[warp * 8 + 2 * t] = mrow[0];
    red_m[warp * 8 + 2 * t + 1] = mrow[1];
    red_l[warp * 8 + 2 * t] = lrow[0];
    red_l[warp * 8 + 2 * t + 1] = lrow[1];
  }
}

// The threadgroup's partial of its MROWS rows from its warps' (m, l) and outputs red_o
// (NWARPS * 8 rows of HD), all in shared memory: o_part[(row0 + r) HD + d] and
// ml_part[(row0 + r) 2 + {0, 1}] = (m, l) in log2 units (call after a barrier).
template <int NWARPS, int MROWS, int HD, int NT>
VX_FN void vx_merge_warps(int tid, const float* red_m, const float* red_l, const float* red_o,
                          float* o_part, float* ml_part, int64_t row0) {
  for (int i = tid; i < MROWS * HD; i += NT) {
    const int r = i / HD;
    const int d = i - r * HD;
    float top = -1.0e30f;
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
}

#endif  // VELOX_MMA_CUH
