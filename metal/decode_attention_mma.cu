// Fused decode attention over packed affine codes on NVIDIA tensor cores (sm_80 and later):
// the CUDA twin of decode_attention.metal for per-token affine codes at 2, 4 and 8 bits with
// fp16 or bfloat16 scales, the case a decode step of a Uniform / KIVI-style cache takes. Same
// inputs (minus the codebook levels) and the same per-split partial, merged by decode_merge.metal
// or decode_merge_fp16.metal.
// A twin because the tensor-core fragments (mma.sync, PTX layouts) have no Metal spelling;
// everything else goes through the portable body.
//
// Grid: x = split of the context, y = b * H + h. Threadgroup: NWARPS warps. Each warp walks
// the split's tiles of 16 NSUB tokens (warp w takes tiles w, w + NWARPS, ...) with its own online
// softmax. Each warp streams its tiles through a private ring of NSTAGE tiles in shared memory
// (the tiles ahead are in flight while it computes one: the bytes in flight that keep the
// memory system busy do not cost registers), filled by bulk copies (sm_90: one per plane and
// tile, counted on the stage's mbarrier) or by cp.async; the warps are merged at the end
// through shared memory. With PIPE, a step issues the next step's score MMAs before its own
// softmax and value MMAs (a software pipeline: the score chain's latency runs under them).
//
// Per 16-token tile, with lane = 4 g + t (g = groupID, t = threadID_in_group of the PTX
// fragment layouts) and m16n8k16 fp16 MMAs accumulating in float32:
//   scores  transposed, S^T (16 tokens x 8 query rows) = K (16 x HD) Q^T: the keys are the A
//           fragment (lane (g, t) decodes tokens g and 8 + g, channels [t HD/4, (t+1) HD/4):
//           whole words, coalesced; the code OR-ed into the mantissa of a power of two, minus
//           that power, then scale * code + zero in one fp16 FMA: the key rounded once to
//           fp16, as an fp16 cache holds it) and the query rows the B fragment (n = 8: one MMA
//           per k-step, no padding rows in registers). An fp16 or bf16 query (QLO = 0) goes
//           in as it is (converted to fp16); any other is split into its fp16 rounding and
//           the residual, two MMAs per k-step into two chains, so S_hi + S_lo is the score of the float32 query to about
//           2^-22 (QLO = 1; with KFOLD about 2^-15: see there). The head dim is permuted consistently in Q and K (a pair of halves
//           holds channels j and j + 16/bits of one code word), which leaves every dot product
//           unchanged. Lane (g, t) ends with tokens g, 8 + g of query rows 2t, 2t + 1.
//           KFOLD = 1 folds the key scales and zeros out of the MMA instead: lane t takes words
//           t, 4 + t, ... of a token's row, so each k-step's 16 channels lie in one scale
//           group, and per group q.k = s (q.c) + z sum(q). The codes go in masked in place (one
//           LOP3 a pair: the fp16 subnormals c 2^(o - 24)), the query's channels times 2^-o,
//           one accumulator chain per group (at most two), and after the MMAs each score is
//           2^24 (s0 acc0 + s1 acc1) + z0 Q0 + z1 Q1 in float32 (Q: the query's sum over the
//           group). The keys are then not rounded to fp16 (closer to the float32 reference).
//           The factor 2^-o takes query channels below 2^(o - 14) into fp16 subnormals, whose
//           spacing (2^-24) rounds them: at most 2^(-25 + o) absolute per channel (2^-19 at
//           2 bits), and a split query's lo part keeps about 2^-15 of it instead of 2^-22.
//           KCH = 1 takes per-channel keys (KIVI's: a scale and zero per channel and group of
//           KGROUP tokens, planes (B, H, T / KGROUP, HD)): KFOLD's lane layout and its codes
//           masked in place, with the scales folded into the query instead. A 16-token tile
//           lies in one group (KGROUP % 16 == 0), so its scores are S^T = C (Q s)^T + Q z:
//           per group, lane (g, t) forms its B fragments as the fp16 products q s 2^-o of
//           query row g and the group's scales of its channels (QLO: plus the products'
//           residuals and the lo parts times s, a second chain; else rounded once, about
//           2^-12 relative per product, as an fp16 key's rounding), and one MMA chain of the
//           group's zeros (the same in every token row, as fp16 z 2^(o - KOMAX)) times the
//           query fragments gives Q z in the C layout, which starts the tile's score
//           accumulators (times 2^(KOMAX - 24)); each score is then 2^24 (acc0 + acc1). A
//           step of NSUB tiles may meet several groups: the stage holds the KCR scale and
//           zero rows it meets (copied with its codes), and the fragments are formed again
//           where a tile starts a group. The query fragments then live in shared memory
//           (qsh, written once), so that the registers hold the group's q s instead. The
//           factor 2^-o rounds products below 2^(o - 14) to fp16 subnormals: at most
//           2^(o - 25) c absolute per channel of a score.
//   softmax online per query row (log2 domain): p = exp2(s - m) (one MUFU.EX2 each,
//           vx_exp2_ftz: weights below 2^-126 flush to zero) against a running max m that
//           is raised lazily (the accumulators are rescaled only when a score exceeds m by
//           more than RESCALE, found with one vote and no reduction), so the partial's m is at
//           most RESCALE below the true max (any m gives the same merged softmax). A lane's two
//           rows are its accumulators' two columns: rescaling needs no shuffles. The weights,
//           8 x 8 fp16 blocks in the C layout, become P^T's B fragment by one transposing
//           move per block (movmatrix).
//   copies  of whole tiles from dense planes (rows back to back, 16-byte aligned): on sm_90 one
//           bulk copy per plane (lane i < 6 copies plane i), else 16-byte cp.async copies at
//           offsets fixed per lane (scales and zeros too); only a split's last, partial tile
//           clamps its rows one by one (cp.async).
//   values  O^T (HD x 8 rows) += V^T (HD x 16 tokens) P^T: transposed, so that the query rows
//           are the MMA's n = 8 (no padding rows: HD/16 MMAs per 16 tokens, 4 accumulators
//           per lane and 16 channels); P goes in rounded to fp16 (PLO = 0) or as fp16 hi and
//           lo parts, two MMAs into the same accumulators (PLO = 1). The V^T fragments hold
//           two tokens of one channel, put together with a byte permute of the two tokens'
//           code words. Lane (g, t) decodes tokens 2t, 2t + 1, 2t + 8, 2t + 9, channels
//           [g HD/8, (g+1) HD/8) (VFOLD: words g, 8 + g, ..., bytes at 2 bits); m-tile j
//           takes its channels 2j (row g) and 2j + 1 (row g + 8).
//           VFOLD = 1 folds each value group's scale and zero into the weights instead of
//           decoding every code: per group V^T P^T = C^T (P s) + 1 (P z). The codes go into the
//           MMA masked in place (one LOP3 a pair: the fp16 subnormals c 2^(o - 24)), the B
//           fragment is P s (the weights times the tokens' scales, per group), the float32
//           sums of p z per row and group are kept beside it, and at the end each channel's sum
//           is multiplied by 2^(24 - o) and its group's p z added. For this each m-tile's 16
//           channels must lie in one group: lane g takes units g, 8 + g, ... of a token's row:
//           16-bit units with LDSM (VLD: a transposing ldmatrix hands the lane unit g of tokens
//           2t and 2t + 1 in one register, the fragment's token pair, with no byte permute),
//           else words (4 and 8 bits) or bytes (2 bits: a word holds 16 channels). The running
//           max is then exact (RESCALE = 0: p <= 1, so P s stays in fp16 range).
//   codes   are decoded without shifts where they sit in the low byte of a 16-bit half
//           (vx_dequant_at: the code OR-ed into the mantissa of 2^(10 - bit offset)), so a
//           pair of decoded halves costs three instructions (KFOLD keys, VFOLD values: one).
// Partials as decode_attention.metal's: o_part (B, H, S, MROWS, HD) = sum_t 2^(s_t - m) v_t,
// ml_part (B, H, S, MROWS, 2) = (m, l) in log2 units; the host merges the splits (FUSE = 0) or
// the last threadgroup of each (batch, head) does (FUSE = 1: out, mlo and count, see the end).
// With FUSE = 1 all of them live in the launch's one output, the float32 workspace `ws` (see
// the end): one output, so the one fill the launch needs (its counts start at zero) is one
// launch. With FUSE = 0 the host declares two outputs (VX_MMA_PARTS): ml_part is `ws`, o_part
// `wo`, each of its own shape, so the merge launch reads them without views.
//
// Template constants: HD (head dim), KBITS / VBITS in {2, 4, 8}, KGROUP / VGROUP (channels per
// scale), MROWS (query rows per KV head, 1 to 8), NWARPS, NSTAGE (steps per warp ring),
// QMUL (the float32 bits of the factor applied to q: log2(e), times the attention scale when
// q comes unscaled, in any float dtype), QLO (1: split the query into fp16 hi and lo rows, for
// queries not exact in fp16; 0: an fp16 query as it is, its factor applied to the scores),
// PLO (1: the weights P as fp16 plus their rounding residual, two value MMAs; 0: P rounded
// to fp16, one MMA, as flash attention does: about 2^-11 relative per weight),
// NSUB (16-token MMA tiles per loop step: more independent work between the softmax steps),
// PIPE (1: score one step ahead; needs NSTAGE >= 3, and the host sets it only with PLO = 0),
// KFOLD (1: key scales and zeros folded out of the score MMA: groups of 4 whole words, one or
// two per token), VFOLD (1: value scales and zeros folded into the weights: groups of 8 whole
// units of a lane, 16-bit units with LDSM where they fit (VLD), else words, or bytes at 2
// bits; at most four per token, PLO = 0), FUSE (1: the split merge at the end of this launch), OT (the merged
// output's type, FUSE = 1), FCHUNK (0, or the most splits whose weights the merge at the end
// holds at once, fewer than fit: a test of its chunks), LDSM (1: the code words through
// ldmatrix, see KLD / VLD below); KSBF / VSBF (1: that side's scales and zeros are bfloat16,
// else fp16: both are read as 16-bit units, to float32 where a fold applies them, to fp16 pairs
// where the codes are decoded or P s is formed; see vx_s16h2 for the range that is exact);
// KCB / VCB (1: that side's codes index the 2^bits float32 levels kl / vl, a codebook with one
// scale per token and no zero: Lloyd-Max codes and norms. 2 or 4 bits, with
// that side's fold and ldmatrix layout: the codes become their fp16 levels by byte permutes on
// level registers (vx_lut2_pair, vx_lut4_word) where affine codes go in masked; the fold's
// scale is the norm, the subnormal factors and the zeros' terms drop out; the host passes the
// norms as the zero plane too, so the copies stay as they are; 2: the same with levels the
// host found symmetric and ascending, L[n - 1 - c] = -L[c]: 4-bit codes looked up in half the
// table, vx_lut4s_word; 2-bit ones put together without a permute, vx_lut2s_pair);
// KCH (1: per-channel keys, KGROUP tokens a group, a multiple of 16; KFOLD = KCB = 0, see
// the scores above).
// The host (velox_core.kernels.decode.mma_supported) checks the layout: HD / 4 channels of
// keys and HD / 8 of values fill whole words, and a lane's channels meet whole groups (KCH:
// the context is whole groups of tokens).

constexpr int KCL = HD / 4;            // key channels per lane (lane t of a token)
constexpr int VCL = HD / 8;            // value channels per lane (lane g)
constexpr int KWL = KCL * KBITS / 32;  // key code words per lane and token
constexpr int VWL = VCL * VBITS / 32;  // value code words per lane and token
constexpr int NTM = HD / 16;           // m-tiles of the value MMA (channels 2j and 2j + 1 of a lane)
constexpr int KCW = 32 / KBITS;        // channels per key word
constexpr int VCW = 32 / VBITS;        // channels per value word
constexpr int KPW = KCW / 2;           // fp16 pairs per key word: channels (j, j + KPW)
constexpr int KSTEPS = HD / 16;        // k-steps of the score MMA (two pairs per lane each)
constexpr int SUB = 16;            // tokens of one MMA tile
constexpr int TILE = SUB * NSUB;   // tokens per loop step and ring stage
constexpr int KNG = KCL > KGROUP ? KCL / KGROUP : 1;  // key groups a lane's channels meet
constexpr int VNG = VCL > VGROUP ? VCL / VGROUP : 1;  // value groups a lane's channels meet
constexpr int NT = NWARPS * 32;
constexpr float NEG = -1.0e30f;
// KFOLD: lane t's key words are t, 4 + t, 8 + t, ... of a token's row (word w of the lane is
// row word 4 w + t), so the four lanes of a k-step read four adjacent words, which lie in one
// group when a group holds 4 whole words. Each sub-tile has two accumulator chains: one per
// group with two groups, else k-steps even / odd (or the query's hi and lo parts) as without
// the fold.
static_assert(!KFOLD || (KGROUP % (4 * KCW) == 0 && HD / KGROUP <= 2),
              "KFOLD needs groups of 4 whole key words, at most two per token");
// KCH: KFOLD's lane layout (KIL) and masked codes; the key scale rows a step meets (KCR: one
// where a group holds whole steps, the step's groups where whole groups fill it, else at most
// (TILE - 16) / KGROUP + 2), and the codes' largest bit offset in a byte (KOMAX: the zeros'
// fp16 factor 2^(o - KOMAX) is at most 1)
static_assert(!KCH || (KGROUP % SUB == 0 && !KFOLD && !KCB),
              "per-channel keys need groups of whole 16-token tiles, without KFOLD or a codebook");
constexpr bool KIL = KFOLD || KCH;  // lane t's key words are t, 4 + t, ... of a token's row
constexpr int KCR = !KCH || KGROUP % TILE == 0 ? 1
                    : TILE % KGROUP == 0       ? TILE / KGROUP
                    : (TILE - SUB) / KGROUP + 2 < NSUB ? (TILE - SUB) / KGROUP + 2 : NSUB;
constexpr int KOMAX = KBITS >= 8 ? 0 : 8 - KBITS;
// VFOLD: the unit a lane takes of a value row's, interleaved 8 ways (lane g takes units g,
// 8 + g, ...): whole words at 4 and 8 bits, bytes at 2 bits (a word holds 16 channels, so 8
// words would span 128). Each m-tile's 16 channels (two per lane) then lie in 8 adjacent units.
// LDSM = 1: the code words come out of the ring through ldmatrix, four 8 x 8 matrices of
// 16-bit units per instruction: the keys with KFOLD or KCH (KLD: a non-transposed load hands
// lane (g, t) word t of each 16-byte segment of tokens g and 8 + g, KFOLD's layout), the values
// with VFOLD where a group holds 8 whole 16-bit units of each lane (VLD): a transposed load
// hands lane (g, t) unit g of an 8-unit block of tokens 2t and 2t + 1 (+ 8) in one register,
// the V^T fragment's token pair, so no byte permute puts two tokens' words together; lane g
// takes units g, 8 + g, ... of a row (VU channels each).
constexpr bool KLD = LDSM && KIL;
constexpr bool VLD = LDSM && VFOLD && VGROUP % (8 * (16 / VBITS)) == 0;
constexpr int VBLK = HD * VBITS / 128;        // VLD: 8-unit blocks of a value row (even)
static_assert(!VLD || VBLK % 2 == 0, "VLD loads two 8-unit blocks of both token halves at once");
static_assert(!KLD || (HD * KBITS) % 128 == 0, "KLD loads whole 16-byte key segments");
constexpr bool VBYTE = VFOLD && VBITS == 2 && !VLD;
constexpr int VU = VLD ? 16 / VBITS : VBYTE ? 8 / VBITS : VCW;  // channels per interleaved unit
constexpr int VLW = VBYTE ? VCL / VU : VWL;   // words a lane loads per token (without VLD)
static_assert(!KCB || (KFOLD && KLD && KGROUP == HD && (KBITS == 2 || KBITS == 4)),
              "codebook keys take the key fold's ldmatrix layout, one norm a token, 2 or 4 bits");
static_assert(!VCB || (VFOLD && VLD && VGROUP == HD && (VBITS == 2 || VBITS == 4)),
              "codebook values take the value fold's ldmatrix layout, one norm a token, 2 or 4 bits");
static_assert(!VFOLD || (VGROUP % (8 * VU) == 0 && HD / VGROUP <= 4 && !PLO),
              "VFOLD needs groups of 8 whole units, at most four per token, P rounded to fp16");

const int tid = vx_tid;
const int lane = tid & 31;
const int warp = tid >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int nsplit = vx_ngx;
const int split = vx_gx;
const int bh = vx_gy;
const int H = kc_shape[1];
const int T = kc_shape[2];
const int b = bh / H;
const int h = bh - b * H;
const int span = ((T + nsplit - 1) / nsplit + TILE - 1) / TILE * TILE;  // whole tiles
const int t0 = split * span;
const int t1 = vx_imin(T, t0 + span);
const int ntiles = t1 > t0 ? (t1 - t0 + TILE - 1) / TILE : 0;

// ---- the query rows as A fragments: hi in rows 0..7, lo in rows 8..15 --------------------------
// QLO = 0 (an fp16 or bf16 query, exact in fp16 over the range the host's MMA_HALF_QUERY
// notes): the query goes in as it is, rows 8..15 are zero (no registers), and the scores are
// multiplied by log2(e) x scale after the MMA. QLO = 1 (any other dtype): the scaled query is
// split into its fp16 rounding (hi) and the residual (lo).
const float qmul = vx_bits_to_float(static_cast<unsigned int>(QMUL));  // log2(e) x scale
const float qin = QLO ? qmul : 1.0f;   // applied to q before the MMA
const float sout = QLO ? 1.0f : qmul;  // applied to the scores after it
unsigned int qa[KSTEPS][4];
// KCH: the query fragments in shared memory instead (the registers hold the current key
// group's q s): word (kk QW + j) 32 + lane is lane's qa[kk][2j] (j < 2; QLO: j >= 2 the lo parts
// qa[kk][2 (j - 2) + 1]), written once by warp 0; a k-step's words of the 32 lanes adjacent
constexpr int QW = QLO ? 4 : 2;
VX_SHARED __align__(16) unsigned int qsh[KCH ? KSTEPS * QW * 32 : 1];
// KFOLD: the group of k-step kk (its lane word is 2 kk / KPW, row words 4 w .. 4 w + 3), the
// query's sums per group for rows 2t and 2t + 1 (times the scores' factor: the zeros' term)
auto kgroup = [](int kk) { return (4 * ((2 * kk) / KPW) * KCW) / KGROUP; };
float qz[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
// KFOLD: 2^24 (the codes' subnormal unit) x the factor; codebook keys: their levels as they are
const float kmul = KCB ? sout : sout * 16777216.0f;
// KCB / VCB: the levels as fp16 lookup registers (vx_lut_load)
unsigned int klut[8], vlut[8];
if (KCB) {
  vx_lut_load<KBITS, KCB == 2>(klut, kl);
}
if (VCB) {
  vx_lut_load<VBITS, VCB == 2>(vlut, vl);
}

// ---- each warp's ring of NSTAGE tiles in shared memory, filled with cp.async ------------------
// A stage holds one 16-token tile as stored: key words, value words, then the key and value
// scales and zeros (fp16, two per 32-bit word). Inputs are read through their strides; code
// rows are copied 16 bytes at a time where the layout allows it (contiguous 16-byte-aligned
// rows), else one word at a time; scales two halves per copy where they are adjacent and
// aligned, else through registers. KCH: the key scales and zeros are the KCR rows of HD
// halves (the groups the step meets, KCR above), 16 bytes per copy where rows are contiguous
// and 16-byte aligned.
constexpr int KWT = HD * KBITS / 32;       // words per key row
constexpr int VWT = HD * VBITS / 32;       // words per value row
constexpr int KG = KCH ? 1 : HD / KGROUP;  // key scales per token (KCH: unused)
constexpr int VG = HD / VGROUP;            // value scales per token
constexpr int KSW = KCH ? KCR * HD / 2 : (TILE * KG + 1) / 2;  // words of a tile's key scales (and zeros)
constexpr int VSW = (TILE * VG + 1) / 2;
constexpr int O_KC = 0;
constexpr int O_VC = O_KC + TILE * KWT;
constexpr int O_KS = O_VC + TILE * VWT;
constexpr int O_KZ = O_KS + KSW;
constexpr int O_VS = O_KZ + KSW;
constexpr int O_VZ = O_VS + VSW;
constexpr int SW = O_VZ + VSW;             // words per stage
constexpr int RING = NWARPS * NSTAGE * SW;
constexpr int RED = NWARPS * 8 * HD;       // the warp merge reuses the ring
constexpr int SMEM = RING > RED ? RING : RED;
VX_SHARED __align__(16) unsigned int ring[SMEM];
VX_SHARED float red_m[NWARPS * 8];
VX_SHARED float red_l[NWARPS * 8];
unsigned int* my_ring = ring + warp * NSTAGE * SW;

struct Plane {
  const void* p;  // element (b, h, 0, 0)
  bool fast;      // 16-byte code rows / adjacent aligned pairs of halves
  bool dense;     // rows back to back from a 16-byte-aligned start: a whole tile is one block
};
// (strides are read from the kernel's parameters where used, not held in registers)
auto code_plane = [&](const unsigned int* a, const int64_t* st, int words) {
  const unsigned int* p = a + (int64_t)b * st[0] + (int64_t)h * st[1];
  const bool fast = words % 4 == 0 && st[3] == 1 && st[2] % 4 == 0 && st[2] < (1 << 28) &&
                    (reinterpret_cast<uintptr_t>(p) & 15) == 0;
  return Plane{p, fast, fast && st[2] == words};
};
auto scale_plane = [&](const void* a, const int64_t* st, int groups) {
  const unsigned short* p = static_cast<const unsigned short*>(a) + (int64_t)b * st[0] + (int64_t)h * st[1];
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 3) == 0;
  const bool fast = aligned && (groups % 2 == 0 ? st[3] == 1 && st[2] % 2 == 0
                                                 : groups == 1 && st[2] == 1);
  const bool dense = (TILE * groups) % 8 == 0 && (groups == 1 || st[3] == 1) &&
                     st[2] == groups && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
  return Plane{p, fast, dense};
};
const Plane kcp = code_plane(kc, kc_strides.data(), KWT);
const Plane vcp = code_plane(vc, vc_strides.data(), VWT);
// KCH: a (T / KGROUP, HD) plane of key scale (zero) rows: fast, channels in adjacent aligned
// pairs; dense, rows of whole 16-byte chunks (copied by cp.async even beside bulk copies, which
// take a tile of every other plane where all six are dense)
auto row_plane = [&](const void* a, const int64_t* st) {
  const unsigned short* p = static_cast<const unsigned short*>(a) + (int64_t)b * st[0] + (int64_t)h * st[1];
  const bool fast = st[3] == 1 && st[2] % 2 == 0 && (reinterpret_cast<uintptr_t>(p) & 3) == 0;
  return Plane{p, fast, fast && st[2] % 8 == 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0};
};
const Plane kap = KCH ? row_plane(ka, ka_strides.data()) : scale_plane(ka, ka_strides.data(), KG);
const Plane kbp = KCH ? row_plane(kb, kb_strides.data()) : scale_plane(kb, kb_strides.data(), KG);
const Plane vap = scale_plane(va, va_strides.data(), VG);
const Plane vbp = scale_plane(vb, vb_strides.data(), VG);

// Bulk copies (sm_90 and later, VX_HAS_BULK): where every plane is dense, a whole tile of
// each plane is one contiguous block, and lane i < 6 copies plane i's block with one bulk
// copy whose bytes are counted on the stage's mbarrier (lane 0 arrives expecting all six).
// Per tile that is one copy instruction per lane instead of a 16-byte cp.async per lane and
// chunk with its address arithmetic. A split's partial last tile (rows to clamp) and
// non-dense layouts take the cp.async copies below. KCH: lanes 2 and 3 copy nothing; the key
// scale rows (dense: 16-byte chunks, row_plane) take cp.async copies beside the bulk ones (the
// step waits for both).
constexpr unsigned int BULK_BYTES = 4u * TILE * (KWT + VWT) + 4u * TILE * ((KCH ? 0 : KG) + VG);
#if VX_HAS_BULK
VX_SHARED __align__(8) unsigned long long bars[NWARPS * NSTAGE];
struct BulkDesc {
  unsigned int lo, hi;  // plane i's address at the split's first token
  unsigned int bytes;   // its bytes per tile
  unsigned int dst;     // its offset in a stage (words)
};
VX_SHARED __align__(16) BulkDesc bdesc[6];
unsigned long long* my_bar = bars + warp * NSTAGE;
const bool bulk = kcp.dense && vcp.dense && kap.dense && kbp.dense && vap.dense && vbp.dense;
if (tid < 6) {
  const Plane& pl = tid == 0 ? kcp : tid == 1 ? vcp : tid == 2 ? kap : tid == 3 ? kbp : tid == 4 ? vap : vbp;
  const unsigned int row = tid == 0 ? 4u * KWT : tid == 1 ? 4u * VWT : tid < 4 ? 2u * KG : 2u * VG;
  const uint64_t src = reinterpret_cast<uint64_t>(pl.p) + static_cast<uint64_t>(t0) * row;
  const int dst = tid == 0 ? O_KC : tid == 1 ? O_VC : tid == 2 ? O_KS : tid == 3 ? O_KZ : tid == 4 ? O_VS : O_VZ;
  bdesc[tid] = BulkDesc{static_cast<unsigned int>(src), static_cast<unsigned int>(src >> 32), TILE * row,
                        static_cast<unsigned int>(dst)};
}
if (lane < NSTAGE) {
  vx_mbar_init(my_bar + lane, 1);
}
vx_mbar_fence_init();
VX_BARRIER();
#endif

// rows [tb, tb + 16) of a plane of code words (rows past T repeat row T - 1)
auto copy_codes = [&](unsigned int* dst, const Plane& pl, const int64_t* st, int words, int tb) {
  const unsigned int* src = static_cast<const unsigned int*>(pl.p);
  const unsigned int row_bytes = static_cast<unsigned int>(4 * st[2]);
  const bool whole = tb + TILE <= T;  // no row to clamp (all but the sequence's last tile)
  if (pl.fast && whole) {  // the tile's rows, 16 bytes per copy at byte offsets fixed per lane
    const int chunks = TILE * words / 4;
    const unsigned char* tile_src = reinterpret_cast<const unsigned char*>(src) +
                                    static_cast<uint64_t>(static_cast<unsigned int>(tb)) * row_bytes;
#pragma unroll
    for (int i = 0; i < (chunks + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (chunks % 32 == 0 || c < chunks) {
        const unsigned int row = (4 * c) / words;
        const unsigned int off = row * row_bytes + 4u * (4 * c - row * words);
        vx_cp_async16(dst + 4 * c, tile_src + off);
      }
    }
  } else if (pl.fast) {
    const int chunks = TILE * words / 4;  // 16-byte chunks
#pragma unroll
    for (int i = 0; i < (chunks + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (c < chunks) {
        const int row = (4 * c) / words;
        const int col = 4 * c - row * words;
        const int64_t tok = vx_imin(tb + row, T - 1);
        vx_cp_async16(dst + 4 * c, src + tok * st[2] + col);
      }
    }
  } else {
#pragma unroll 4
    for (int i = 0; i < (TILE * words + 31) / 32; ++i) {
      const int w = lane + 32 * i;
      if (w < TILE * words) {
        const int row = w / words;
        const int col = w - row * words;
        const int64_t tok = vx_imin(tb + row, T - 1);
        vx_cp_async4(dst + w, src + tok * st[2] + col * st[3], 4);
      }
    }
  }
};
// the 16-bit scales (fp16 or bf16) of rows [tb, tb + 16) of a (T, groups) plane, two per word
auto copy_scales = [&](unsigned int* dst, const Plane& pl, const int64_t* st, int groups, int nwords,
                       int tb) {
  const unsigned short* src = static_cast<const unsigned short*>(pl.p);
  if (pl.dense && tb + TILE <= T) {  // whole tile, dense rows: its halves in 16-byte chunks
    const unsigned char* tile_src = reinterpret_cast<const unsigned char*>(src) +
                                    static_cast<uint64_t>(static_cast<unsigned int>(tb)) * (2u * groups);
    const int chunks = nwords / 4;
#pragma unroll
    for (int i = 0; i < (chunks + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (chunks % 32 == 0 || c < chunks) {
        vx_cp_async16(dst + 4 * c, tile_src + 16u * c);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < (nwords + 31) / 32; ++i) {
    const int w = lane + 32 * i;
    if (w >= nwords) {
      break;
    }
    const int e = 2 * w;  // the word's first half, counted from the tile's first scale
    const int tok = tb + e / groups;
    const int col = e - (e / groups) * groups;
    if (pl.fast && groups % 2 == 0) {  // both halves of one token
      vx_cp_async4(dst + w, src + (int64_t)vx_imin(tok, T - 1) * st[2] + col, 4);
    } else if (pl.fast) {  // one group per token, tokens contiguous: tokens tok and tok + 1
      const int nb = tok + 1 < T ? 4 : (tok < T ? 2 : 0);
      vx_cp_async4(dst + w, src + (nb ? (int64_t)tok : 0), nb);
    } else {
      unsigned short* hd = reinterpret_cast<unsigned short*>(dst + w);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int ei = e + i;
        const int64_t tk = vx_imin(tb + ei / groups, T - 1);
        hd[i] = src[tk * st[2] + (int64_t)(ei % groups) * st[3]];
      }
    }
  }
};
// KCH: the KCR key scale (or zero) rows of the groups a step from token tb meets, HD halves
// each (rows past the last group repeat it)
auto copy_rows = [&](unsigned int* dst, const Plane& pl, const int64_t* st, int tb) {
  const unsigned short* src = static_cast<const unsigned short*>(pl.p);
  const int g0 = tb / KGROUP;
  const int glast = T / KGROUP - 1;
  constexpr int RW = HD / 2;  // words of a row
  if (pl.dense) {  // 16-byte chunks, HD / 8 a row
    constexpr int CH = KCR * HD / 8;
#pragma unroll
    for (int i = 0; i < (CH + 31) / 32; ++i) {
      const int c = lane + 32 * i;
      if (CH % 32 == 0 || c < CH) {
        const int r = c / (HD / 8);
        const int64_t grp = vx_imin(g0 + r, glast);
        vx_cp_async16(dst + 4 * c, src + grp * st[2] + 8 * (c - r * (HD / 8)));
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < (KCR * RW + 31) / 32; ++i) {
    const int w = lane + 32 * i;
    if (w < KCR * RW) {
      const int r = w / RW;
      const int col = 2 * (w - r * RW);
      const int64_t grp = vx_imin(g0 + r, glast);
      if (pl.fast) {  // the word's two halves, adjacent and aligned
        vx_cp_async4(dst + w, src + grp * st[2] + col, 4);
      } else {
        unsigned short* hd = reinterpret_cast<unsigned short*>(dst + w);
        hd[0] = src[grp * st[2] + (int64_t)col * st[3]];
        hd[1] = src[grp * st[2] + (int64_t)(col + 1) * st[3]];
      }
    }
  }
};
auto issue = [&](int tile, int stage) {
  unsigned int* st = my_ring + stage * SW;
  const int tb = t0 + tile * TILE;
  if (KCH) {  // the key scale and zero rows (cp.async, beside bulk copies too)
    copy_rows(st + O_KS, kap, ka_strides.data(), tb);
    copy_rows(st + O_KZ, kbp, kb_strides.data(), tb);
  }
#if VX_HAS_BULK
  if (bulk) {
    if (tb + TILE <= T) {
      if (lane == 0) {
        vx_mbar_arrive_tx(my_bar + stage, BULK_BYTES);
      }
      if (lane < 6 && (!KCH || lane < 2 || lane > 3)) {
        const BulkDesc d = bdesc[lane];
        const uint64_t src = ((static_cast<uint64_t>(d.hi) << 32) | d.lo) + static_cast<uint64_t>(tile) * d.bytes;
        vx_bulk_copy(st + d.dst, reinterpret_cast<const void*>(src), d.bytes, my_bar + stage);
      }
      return;
    }
    if (lane == 0) {  // the stage's phase completes at once; cp.async brings the data
      vx_mbar_arrive(my_bar + stage);
    }
  }
#endif
  copy_codes(st + O_KC, kcp, kc_strides.data(), KWT, tb);
  copy_codes(st + O_VC, vcp, vc_strides.data(), VWT, tb);
  if (!KCH) {
    copy_scales(st + O_KS, kap, ka_strides.data(), KG, KSW, tb);
    copy_scales(st + O_KZ, kbp, kb_strides.data(), KG, KSW, tb);
  }
  copy_scales(st + O_VS, vap, va_strides.data(), VG, VSW, tb);
  copy_scales(st + O_VZ, vbp, vb_strides.data(), VG, VSW, tb);
};

// Output accumulators, transposed: oacc[j] is m-tile j of O^T, lane (g, t) holding channels 2j
// (elements 0, 1) and 2j + 1 (elements 2, 3) of lane group g for query rows 2t and 2t + 1.
float oacc[NTM][4];
#pragma unroll
for (int j = 0; j < NTM; ++j) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    oacc[j][i] = 0.0f;
  }
}
// Running max of query row g (log2 units, the same in the 4 lanes of g), raised lazily: the
// accumulators are rescaled only when a score exceeds it by more than RESCALE (weights up to
// 2^RESCALE are exact in float32 sums and fp16 hi/lo fragments), which after the first tiles
// almost never happens.
constexpr float RESCALE = VFOLD ? 0.0f : 8.0f;  // VFOLD: p <= 1, so p s stays in fp16 range
constexpr int VZG = VFOLD ? VG : 1;
float zacc[VZG][2];  // VFOLD: this lane's sums of p z per group, rows 2t and 2t + 1
#pragma unroll
for (int c = 0; c < VZG; ++c) {
  zacc[c][0] = 0.0f;
  zacc[c][1] = 0.0f;
}
// VFOLD: the group of value m-tile j (its lane unit 2 j / VU: row units 8 (2j / VU) + 0..7)
auto vgroup = [](int j) { return ((2 * j) / VU) * 8 * VU / VGROUP; };
// query rows 2t and 2t + 1 (the columns of this lane's scores and accumulators): their running
// maxima (the same in the 8 lanes of t) and this lane's shares of their sums
float mrow[2] = {NEG, NEG};
float lrow[2] = {0.0f, 0.0f};
const int kg0 = (t * KCL) / KGROUP;  // first key group of this lane's channels
const int vg0 = (g * VCL) / VGROUP;  // first value group of this lane's channels

// Scores of one step's NSUB sub-tiles from stage `st`, transposed: S^T (16 tokens x 8 query
// rows) = K Q^T, the keys as the A fragment (lane (g, t) decodes tokens g and 8 + g: rows g and
// g + 8) and the query rows as the B fragment (n = 8: no padding rows, one MMA per k-step).
// sc[u][c] are two independent chains (k-steps even / odd; QLO: the hi and lo parts of the
// query; KFOLD with two key groups: one per group, hi and lo parts alike); C element i is
// token g + 8 (i >> 1) for query row 2t + (i & 1). KCH: chains as without KFOLD, with the B
// fragments q s of the sub-tile's key group (key_group) and its Q z to start chain 0.
// KCH: the stage row of sub-tile u's key group for a step from token tb (rows from the step's
// first group), and whether sub-tile u surely shares sub-tile u - 1's group
auto krow = [](int tb, int u) {
  return KGROUP % TILE == 0   ? 0
         : TILE % KGROUP == 0 ? SUB * u / KGROUP
                              : (tb + SUB * u) / KGROUP - tb / KGROUP;
};
auto ksame = [](int u) {
  return u > 0 && (KGROUP % TILE == 0 || (TILE % KGROUP == 0 && (SUB * u) % KGROUP != 0));
};
// KCH: one key group's B fragments bq[kk][c][uu] (pair uu of k-step kk: q s 2^-o, query row g
// and the lane's channels, with the group's scales from row `srow`; c = 0: the products' fp16
// roundings, c = 1 (QLO): their residuals plus the lo parts times s) and bz, its zeros' term
// Q z for rows 2t and 2t + 1 times 2^(KOMAX - 24): one MMA chain of the zeros from `zrow` (as
// fp16 z 2^(o - KOMAX), the same in every token row) times the query fragments (QLO: the lo
// parts in a second chain).
auto key_group = [&](const unsigned int* srow, const unsigned int* zrow,
                     unsigned int (&bq)[KCH ? KSTEPS : 1][2][2], float (&bz)[2]) {
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};  // (QLO: lo in acc[1])
#pragma unroll
  for (int kk = 0; kk < (KCH ? KSTEPS : 0); ++kk) {
    unsigned int za[2], qk[4];  // qk: the query fragments of k-step kk (qa[kk], from qsh)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      qk[j] = j & 1 && !QLO ? 0u : qsh[(kk * QW + (j & 1) * 2 + (j >> 1)) * 32 + lane];
    }
#pragma unroll
    for (int uu = 0; uu < 2; ++uu) {
      const int p = 2 * kk + uu;
      const int wl = p / KPW;
      const int jj = p - wl * KPW;
      const int o = (jj * KBITS) & 7;
      const int hc = (4 * wl + t) * KCW + jj;  // the pair's low channel (the high one: + KPW)
      const __half2 s2 = vx_s16h2_words<KSBF>(srow[hc / 2], srow[(hc + KPW) / 2], jj & 1, 1.0f);
      const float zmul = 1.0f / static_cast<float>(1 << (KOMAX - o));
      za[uu] = vx_h2u(vx_s16h2_words<KSBF>(zrow[hc / 2], zrow[(hc + KPW) / 2], jj & 1, zmul));
      const __half2 qh = vx_u2h(qk[2 * uu]);
      const __half2 hi = __hmul2(qh, s2);
      bq[kk][0][uu] = vx_h2u(hi);
      bq[kk][1][uu] = QLO ? vx_h2u(__hfma2(vx_u2h(qk[2 * uu + 1]), s2,
                                           __hfma2(qh, s2, vx_u2h(vx_h2u(hi) ^ 0x80008000u))))
                          : 0u;
    }
    vx_mma16816(acc[0], za[0], za[0], za[1], za[1], qk[0], qk[2]);
    if (QLO) {
      vx_mma16816(acc[1], za[0], za[0], za[1], za[1], qk[1], qk[3]);
    }
  }
  const float f = 1.0f / static_cast<float>(1 << (24 - KOMAX));
  bz[0] = (acc[0][0] + acc[1][0]) * f;
  bz[1] = (acc[0][1] + acc[1][1]) * f;
};
auto score_step = [&](const unsigned int* st, int tb, float (&sc)[NSUB][2][4]) {
  const unsigned short* sks = reinterpret_cast<const unsigned short*>(st + O_KS);
  const unsigned short* skz = reinterpret_cast<const unsigned short*>(st + O_KZ);
  unsigned int bq[KCH ? KSTEPS : 1][2][2];  // KCH: the current key group's B fragments
  float bz[2] = {0.0f, 0.0f};               // KCH: its Q z (rows 2t, 2t + 1), scaled
  (void)tb;
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    unsigned int kw[2][KWL], kw8[2][KWL];  // tokens g, 8 + g: the lane's words, shifted a byte
    __half2 s2[2][KNG], z2[2][KNG];
    if (KCH && !ksame(u)) {  // a new key group
      const int r = krow(tb, u);
      key_group(st + O_KS + r * (HD / 2), st + O_KZ + r * (HD / 2), bq, bz);
    }
    if (KLD) {  // matrix (token half n, 16-byte segment w) -> kw[n][w], two segments a load
      const unsigned int* row =
          st + O_KC + (SUB * u + 8 * ((lane >> 3) & 1) + (lane & 7)) * KWT + 4 * (lane >> 4);
#pragma unroll
      for (int w = 0; w + 1 < KWL; w += 2) {
        vx_ldmatrix_x4<0>(kw[0][w], kw[1][w], kw[0][w + 1], kw[1][w + 1], row + 4 * w);
      }
      if (KWL % 2) {
        vx_ldmatrix_x2<0>(kw[0][KWL - 1], kw[1][KWL - 1], row + 4 * (KWL - 1));
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int tr = SUB * u + 8 * n + g;
#pragma unroll
      for (int w = 0; w < KWL; ++w) {
        if (!KLD) {
          kw[n][w] = st[O_KC + tr * KWT + (KIL ? 4 * w + t : t * KWL + w)];
        }
        kw8[n][w] = kw[n][w] >> 8;
      }
#pragma unroll
      for (int lg = 0; lg < (KIL ? 0 : KNG); ++lg) {
        s2[n][lg] = vx_s16h2<KSBF>(sks + tr * KG + kg0 + lg, sks + tr * KG + kg0 + lg);
        z2[n][lg] = vx_s16h2<KSBF>(skz + tr * KG + kg0 + lg, skz + tr * KG + kg0 + lg);
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sc[u][c][i] = KCH && c == 0 ? bz[i & 1] : 0.0f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      unsigned int af[4];  // a0 / a2: token g, k 2t.. / 2t + 8..; a1 / a3: token 8 + g
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int uu = 0; uu < 2; ++uu) {
          const int p = 2 * kk + uu;
          const int wl = p / KPW;
          const int jj = p - wl * KPW;
          const int pos = jj * KBITS;  // bit offset of the pair's codes in each half
          const int lg = KCL > KGROUP ? (wl * KCW) / KGROUP : 0;
          const unsigned int x = pos < 8 ? kw[n][wl] : kw8[n][wl];
          if (KCB) {  // the pair's fp16 levels (4 bits: the word's four pairs, computed once)
            af[n + 2 * uu] = KBITS == 4 ? vx_lut4_pair<KCB == 2>(kw[n][wl], jj, klut)
                         : KCB == 2 ? vx_lut2s_pair(x, pos & 7, klut) : vx_lut2_pair(x, pos & 7, klut);
            continue;
          }
          af[n + 2 * uu] = KIL ? vx_code_sub(x, pos & 7, KBITS)
                               : vx_dequant_at(x, pos & 7, KBITS, s2[n][lg], z2[n][lg]);
        }
      }
      if (KCH && QLO) {  // the group's q s: products and residuals in two chains
        vx_mma16816(sc[u][0], af[0], af[1], af[2], af[3], bq[kk][0][0], bq[kk][0][1]);
        vx_mma16816(sc[u][1], af[0], af[1], af[2], af[3], bq[kk][1][0], bq[kk][1][1]);
      } else if (KCH) {
        vx_mma16816(sc[u][kk & 1], af[0], af[1], af[2], af[3], bq[kk][0][0], bq[kk][0][1]);
      } else if (KFOLD && KG == 2) {  // one chain per group (QLO: hi and lo parts into the same)
        vx_mma16816(sc[u][kgroup(kk)], af[0], af[1], af[2], af[3], qa[kk][0], qa[kk][2]);
        if (QLO) {
          vx_mma16816(sc[u][kgroup(kk)], af[0], af[1], af[2], af[3], qa[kk][1], qa[kk][3]);
        }
      } else if (QLO) {
        vx_mma16816(sc[u][0], af[0], af[1], af[2], af[3], qa[kk][0], qa[kk][2]);
        vx_mma16816(sc[u][1], af[0], af[1], af[2], af[3], qa[kk][1], qa[kk][3]);
      } else {
        vx_mma16816(sc[u][kk & 1], af[0], af[1], af[2], af[3], qa[kk][0], qa[kk][2]);
      }
    }
  }
};
// the tile's copies have landed: this lane's cp.async groups up to `ahead` newer ones, the
// stage's bulk copies, and (after the warp barrier) every lane's
auto wait_tile = [&](int k) {
#if VX_HAS_BULK
  if (bulk) {
    vx_mbar_wait(my_bar + k % NSTAGE, (k / NSTAGE) & 1);
  }
#endif
  (void)k;
};

// this warp's tiles: warp, warp + NWARPS, ...
// Software pipeline (PIPE = 1, NSTAGE >= 3): step k issues the score MMAs of step k + 1 before
// step k's softmax and value MMAs, so the score chain's latency (decode, MMA, MMA, ...) runs
// under independent work instead of stalling every step; its accumulators wait in registers
// for the next step. PIPE = 0 scores and consumes each step in turn.
const int nmine = warp < ntiles ? (ntiles - warp + NWARPS - 1) / NWARPS : 0;
#pragma unroll
for (int s = 0; s < NSTAGE - 1; ++s) {
  if (s < nmine) {
    issue(warp + s * NWARPS, s);
  }
  vx_cp_commit();  // an empty group keeps the count uniform
}
// the query fragments (computed while the ring's first tiles are in flight)
{
  const bool qrow = g < MROWS;
  const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)h * q_strides[1] +
                     (int64_t)(qrow ? g : 0) * q_strides[2];
  float qsum[2] = {0.0f, 0.0f};  // KFOLD: this lane's channels of row g, per group
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int p = 2 * kk + u;  // the lane's fp16 pair of this k-step (u = 1: k + 8)
      const int wl = p / KPW;
      const int jj = p - wl * KPW;
      // channel of the low half (the high half's is KPW more)
      const int c0 = (KIL ? (4 * wl + t) * KCW : t * KCL + wl * KCW) + jj;
      const int c1 = c0 + KPW;
      // KFOLD, KCH: the codes enter as c 2^(o - 24) at bit offset o of their byte
      const float sub = KIL && !KCB ? 1.0f / static_cast<float>(1 << ((jj * KBITS) & 7)) : 1.0f;
      const float x0 = qrow ? static_cast<float>(q[qb + (int64_t)c0 * q_strides[3]]) * qin : 0.0f;
      const float x1 = qrow ? static_cast<float>(q[qb + (int64_t)c1 * q_strides[3]]) * qin : 0.0f;
      const __half2 hi = __floats2half2_rn(x0 * sub, x1 * sub);
      const float2 hf = __half22float2(hi);
      qa[kk][2 * u] = vx_h2u(hi);
      qa[kk][2 * u + 1] = QLO ? vx_pack_h2(x0 * sub - hf.x, x1 * sub - hf.y) : 0u;
      if (KFOLD) {
        qsum[kgroup(kk)] += x0 + x1;
      }
    }
  }
  if (KFOLD) {  // rows' sums over the 4 lanes of g, then rows 2t, 2t + 1 from lanes 8t, 8t + 4
#pragma unroll
    for (int gr = 0; gr < 2; ++gr) {
      qsum[gr] += vx_shfl_xor(qsum[gr], 1);
      qsum[gr] += vx_shfl_xor(qsum[gr], 2);
      qz[gr][0] = sout * __shfl_sync(0xffffffffu, qsum[gr], 8 * t);
      qz[gr][1] = sout * __shfl_sync(0xffffffffu, qsum[gr], 8 * t + 4);
    }
  }
  if (KCH) {  // the fragments to shared memory (every warp computed the same)
    if (warp == 0) {
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int j = 0; j < QW; ++j) {
          qsh[(kk * QW + j) * 32 + lane] = qa[kk][j < 2 ? 2 * j : 2 * (j - 2) + 1];
        }
      }
    }
    VX_BARRIER();
  }
}
float sc[NSUB][2][4];  // score accumulators of the step to consume (PIPE: computed one step early)
if (PIPE && nmine > 0) {
  vx_cp_wait<NSTAGE - 2>();
  wait_tile(0);
  __syncwarp();
  score_step(my_ring, t0 + warp * TILE, sc);
}
for (int k = 0; k < nmine; ++k) {
  const int pre = k + NSTAGE - 1;
  if (pre < nmine) {
    issue(warp + pre * NWARPS, pre % NSTAGE);
  }
  vx_cp_commit();
  const unsigned int* st = my_ring + (k % NSTAGE) * SW;
  const unsigned short* svs = reinterpret_cast<const unsigned short*>(st + O_VS);
  const unsigned short* svz = reinterpret_cast<const unsigned short*>(st + O_VZ);
  const int base = t0 + (warp + k * NWARPS) * TILE;
  if (!PIPE) {
    vx_cp_wait<NSTAGE - 1>();  // tile k
    wait_tile(k);
    __syncwarp();
    score_step(st, base, sc);
  }

  // this step's scores: per sub-tile, tokens g and 8 + g of query rows 2t and 2t + 1
  // (KFOLD: 2^24 (s0 acc0 + s1 acc1) + z0 Q0 + z1 Q1 with the tokens' key scales and zeros)
  float s4[NSUB][4];
  bool v4[NSUB][4];
  const unsigned short* sks = reinterpret_cast<const unsigned short*>(st + O_KS);
  const unsigned short* skz = reinterpret_cast<const unsigned short*>(st + O_KZ);
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    float ks[2][2], kz[2][2];  // KFOLD: tokens g, 8 + g; groups
#pragma unroll
    for (int n = 0; n < (KFOLD ? 2 : 0); ++n) {
#pragma unroll
      for (int gr = 0; gr < KG; ++gr) {
        ks[n][gr] = vx_s16f<KSBF>(sks + (SUB * u + 8 * n + g) * KG + gr) * kmul;
        kz[n][gr] = vx_s16f<KSBF>(skz + (SUB * u + 8 * n + g) * KG + gr);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (KFOLD) {
        const int n = i >> 1;
        float a = KG == 2 ? ks[n][0] * sc[u][0][i] + ks[n][1] * sc[u][1][i]
                          : ks[n][0] * (sc[u][0][i] + sc[u][1][i]);
#pragma unroll
        for (int gr = 0; gr < (KCB ? 0 : KG); ++gr) {  // (codebook keys: no zeros)
          a += kz[n][gr] * qz[gr][i & 1];
        }
        s4[u][i] = a;
      } else {
        // (KCH: the chains start with Q z, both times 2^-24 as the codes' products)
        s4[u][i] = KCH ? (sc[u][0][i] + sc[u][1][i]) * kmul
                   : QLO ? sc[u][0][i] + sc[u][1][i] : (sc[u][0][i] + sc[u][1][i]) * sout;
      }
      v4[u][i] = base + SUB * u + 8 * (i >> 1) + g < t1;
    }
  }
  if (PIPE) {
    // the next step's scores (stage k + 1 < nmine has landed; past the last step the stage
    // holds an earlier step, or was never filled: scores that are never used)
    if (k + 1 < nmine) {
      vx_cp_wait<NSTAGE - 2>();
      wait_tile(k + 1);
    }
    __syncwarp();
    score_step(my_ring + ((k + 1) % NSTAGE) * SW, base + NWARPS * TILE, sc);
  }

  // online softmax of rows 2t and 2t + 1 over the step's TILE tokens: one vote decides whether
  // any row's max must be raised; only then are the row maxima reduced over the 8 lanes of t
  // and the accumulators rescaled (their columns are this lane's two rows: no shuffles)
  float lmax[2] = {NEG, NEG};
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lmax[i & 1] = v4[u][i] ? vx_max(lmax[i & 1], s4[u][i]) : lmax[i & 1];
    }
  }
  float alpha[2];
  if (vx_softmax_raise<NTM>(lmax, mrow, lrow, oacc, RESCALE, alpha)) {
#pragma unroll
    for (int c = 0; c < (VFOLD ? VZG : 0); ++c) {
      zacc[c][0] *= alpha[0];
      zacc[c][1] *= alpha[1];
    }
  }
  // P^T as B fragments (tokens 2t, 2t + 1 and 2t + 8, 2t + 9 of row g): the weights are held
  // as (token g + 8n, rows 2t, 2t + 1) pairs, an 8 x 8 fp16 block per n in the C layout, and
  // one transposing move per block (movmatrix) turns it into the B layout
  unsigned int pb[NSUB][2][2];
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    float p4[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p4[i] = v4[u][i] ? vx_exp2_ftz(s4[u][i] - mrow[i & 1]) : 0.0f;
      lrow[i & 1] += p4[i];
    }
#pragma unroll
    for (int gi = 0; gi < (VFOLD && !VCB ? VG : 0); ++gi) {  // p z of tokens g, 8 + g (float32)
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float zv = vx_s16f<VSBF>(svz + (SUB * u + 8 * n + g) * VG + gi);
        zacc[gi][0] += p4[2 * n] * zv;
        zacc[gi][1] += p4[2 * n + 1] * zv;
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const __half2 hi = __floats2half2_rn(p4[2 * n], p4[2 * n + 1]);
      const float2 hf = __half22float2(hi);
      pb[u][0][n] = vx_movmatrix_trans(vx_h2u(hi));
      pb[u][1][n] = PLO ? vx_movmatrix_trans(vx_pack_h2(p4[2 * n] - hf.x, p4[2 * n + 1] - hf.y)) : 0u;
    }
  }

  // values: the lane's words of tokens 2t, 2t + 1, 2t + 8, 2t + 9 and their scales as pairs
  // (VFOLD: the words of its interleaved units; at 2 bits word w holds the lane's byte w)
  // (VLD: vr[u][blk][n] = unit 8 blk + g of tokens 2t + 8n, 2t + 8n + 1, low half first)
  unsigned int vw[NSUB][4][VLW];
  unsigned int vr[NSUB][VLD ? VBLK : 1][2];
  __half2 vs2[NSUB][2][VNG], vz2[NSUB][2][VNG];
  const unsigned int bsel = VBYTE ? (g & 3) * 0x0011u + (4 + (g & 3)) * 0x1100u : 0u;
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    if (VLD) {  // matrix (token half n, block blk) -> vr[u][blk][n], two blocks a load
      const unsigned int* row =
          st + O_VC + (SUB * u + 8 * ((lane >> 3) & 1) + (lane & 7)) * VWT + 4 * (lane >> 4);
#pragma unroll
      for (int blk = 0; blk < (VLD ? VBLK : 0); blk += 2) {
        vx_ldmatrix_x4<1>(vr[u][blk][0], vr[u][blk][1], vr[u][blk + 1][0], vr[u][blk + 1][1],
                          row + 4 * blk);
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int tr = SUB * u + 2 * t + (n & 1) + 8 * (n >> 1);
#pragma unroll
      for (int w = 0; w < (VLD ? 0 : VLW); ++w) {
        vw[u][n][w] = st[O_VC + tr * VWT + (VBYTE ? 2 * w + (g >> 2) : VFOLD ? w * 8 + g : g * VWL + w)];
      }
    }
#pragma unroll
    for (int n = 0; n < (VFOLD ? 0 : 2); ++n) {
      const int tr = SUB * u + 2 * t + 8 * n;
#pragma unroll
      for (int lg = 0; lg < VNG; ++lg) {
        vs2[u][n][lg] = vx_s16h2<VSBF>(svs + tr * VG + vg0 + lg, svs + (tr + 1) * VG + vg0 + lg);
        vz2[u][n][lg] = vx_s16h2<VSBF>(svz + tr * VG + vg0 + lg, svz + (tr + 1) * VG + vg0 + lg);
      }
    }
  }
  unsigned int pf[NSUB][2];  // VFOLD: P s of the current m-tile's group, tokens (2t, 2t + 1), (+8)
#pragma unroll
  for (int j = 0; j < NTM; ++j) {
    if (VFOLD && (j == 0 || vgroup(j) != vgroup(j - 1))) {  // a new group: P s as B fragments
      const int gi = vgroup(j);
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int tr = SUB * u + 2 * t + 8 * n;
          const __half2 s2 = vx_s16h2<VSBF>(svs + tr * VG + gi, svs + (tr + 1) * VG + gi);
          pf[u][n] = vx_h2u(__hmul2(vx_u2h(pb[u][0][n]), s2));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      unsigned int af[4];  // A fragment of V^T: (channel 2j | 2j + 1) x (token pair 0 | 1)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ch = 2 * j + (e & 1);  // the lane's channel (row g or g + 8 of the m-tile)
        const int n = e >> 1;            // token pair (2t, 2t + 1) or (2t + 8, 2t + 9)
        if (VLD) {  // the channel's code in unit ch / VU of both tokens (past bit 8: shifted)
          const int blk = ch / VU;
          const int bit = (ch - blk * VU) * VBITS;
          const unsigned int y = bit < 8 ? vr[u][blk][n] : vr[u][blk][n] >> 8;
          if (VCB) {  // the channel's fp16 levels for both tokens (4 bits: the unit's four, once)
            af[e] = VBITS == 4 ? vx_lut4_pair<VCB == 2>(vr[u][blk][n], ch - blk * VU, vlut)
                         : VCB == 2 ? vx_lut2s_pair(y, bit & 7, vlut) : vx_lut2_pair(y, bit & 7, vlut);
            continue;
          }
          af[e] = vx_code_sub(y, bit & 7, VBITS);
          continue;
        }
        if (VBYTE) {  // the lane's byte ch / 4 of both tokens, in the low bytes of the halves
          const unsigned int y = __byte_perm(vw[u][2 * n][ch / 4], vw[u][2 * n + 1][ch / 4], bsel);
          af[e] = vx_code_sub(y, (ch & 3) * 2, 2);
          continue;
        }
        const int wl = ch / VCW;
        const int bit = (ch - wl * VCW) * VBITS;
        const int bi = bit >> 3;
        const int sel = bi | (bi << 4) | ((4 + bi) << 8) | ((4 + bi) << 12);
        const int lg = VCL > VGROUP ? ch / VGROUP : 0;
        const unsigned int y = __byte_perm(vw[u][2 * n][wl], vw[u][2 * n + 1][wl], sel);
        af[e] = VFOLD ? vx_code_sub(y, bit & 7, VBITS)
                      : vx_dequant_at(y, bit & 7, VBITS, vs2[u][n][lg], vz2[u][n][lg]);
      }
      if (VFOLD) {
        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pf[u][0], pf[u][1]);
      } else {
        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[u][0][0], pb[u][0][1]);
      }
      if (PLO) {
        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[u][1][0], pb[u][1][1]);
      }
    }
  }
  __syncwarp();  // every lane is done with this stage before it is refilled
}
vx_cp_wait<0>();

// ---- merge the warps: row r's (m, l) and its HD outputs, through shared memory -------------------
#pragma unroll
for (int c = 0; c < 2; ++c) {
  lrow[c] += vx_shfl_xor(lrow[c], 4);
  lrow[c] += vx_shfl_xor(lrow[c], 8);
  lrow[c] += vx_shfl_xor(lrow[c], 16);
#pragma unroll
  for (int gi = 0; gi < (VFOLD ? VZG : 0); ++gi) {
    zacc[gi][c] += vx_shfl_xor(zacc[gi][c], 4);
    zacc[gi][c] += vx_shfl_xor(zacc[gi][c], 8);
    zacc[gi][c] += vx_shfl_xor(zacc[gi][c], 16);
  }
}
VX_BARRIER();  // every warp is done with its ring: it becomes the merge buffer
float* red_o = reinterpret_cast<float*>(ring);
#pragma unroll
for (int j = 0; j < NTM; ++j) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // element i: the lane's channel 2j + (i >> 1) (VFOLD: in unit (2j + (i >> 1)) / VU of
    // the lane's interleaved units, at bit offset o of its byte) of query row 2t + (i & 1)
    const int lc = 2 * j + (i >> 1);
    const int ch = VFOLD ? ((lc / VU) * 8 + g) * VU + lc % VU : g * VCL + lc;
    const int o = ((lc % VU) * VBITS) & 7;
    red_o[(warp * 8 + 2 * t + (i & 1)) * HD + ch] =
        VCB ? oacc[j][i]
        : VFOLD ? oacc[j][i] * static_cast<float>(1 << (24 - o)) + zacc[vgroup(j)][i & 1] : oacc[j][i];
  }
}
vx_store_warp_rows(red_m, red_l, warp, g, t, mrow, lrow);
// ---- the launch's one output: a float32 workspace, regions of whole 16 bytes -----------------
// FUSE = 1 (zeroed by the launch, init_value 0): [out | mlo | count | ml_part | o_part];
// FUSE = 0 (VX_MMA_PARTS, the host's DECODE_MMA_PARTS): ml_part is ws and o_part a second
// output, wo, each of its own shape. velox_core.kernels.decode.mma_layout is the host's twin
// of the FUSE = 1 layout.
const int64_t nbh = (int64_t)kc_shape[0] * H;
const int64_t n_out = FUSE ? ((nbh * MROWS * HD * (int64_t)sizeof(OT) + 15) / 16) * 4 : 0;
const int64_t n_mlo = FUSE ? ((nbh * MROWS * 2 + 3) / 4) * 4 : 0;
const int64_t n_cnt = FUSE ? ((nbh + 3) / 4) * 4 : 0;
OT* const out = reinterpret_cast<OT*>(ws);
float* const mlo = ws + n_out;
unsigned int* const count = reinterpret_cast<unsigned int*>(ws + n_out + n_mlo);
float* const ml_part = ws + n_out + n_mlo + n_cnt;
#if defined(VX_MMA_PARTS)  // the partials as two outputs: (m, l) in ws, o_part in wo
static_assert(!FUSE, "the partials as two outputs go with the merge in a second launch");
float* const o_part = wo;
#else
static_assert(FUSE, "without the merge the partials are two outputs (VX_MMA_PARTS)");
const int64_t n_ml = ((nbh * nsplit * MROWS * 2 + 3) / 4) * 4;
float* const o_part = ml_part + n_ml;
#endif
VX_BARRIER();
const int64_t row0 = ((int64_t)bh * nsplit + split) * MROWS;
vx_merge_warps<NWARPS, MROWS, HD, NT>(tid, red_m, red_l, red_o, o_part, ml_part, row0);

// ---- FUSE = 1: the split merge in this launch (one kernel per call instead of two) ----------
// Every threadgroup publishes its partial (the stores above, then a device-wide fence) and
// counts itself on count[bh] (zeroed by the launch); the one that counts last reads every
// split's partial of its (batch, head), past the L1 cache, and writes the normalized output o
// (B, H, MROWS, HD) in OT and mlo (B, H, MROWS, 2) = the max in natural-log units and the sum
// relative to it (decode_merge.metal's m and l). That tail runs on one threadgroup while the
// others are done, so it is spread over all of its threads: a warp per row finds the row's max
// and sum over the splits (lanes across the splits); the splits' weights go to shared memory
// (the ring, free now), in chunks of FCAP splits; then each thread sums 4 adjacent channels of
// one row (16-byte loads, several in flight) over its share of the splits (FPART threads per
// (row, 4 channels) where the rows are few), and the shares are added through shared memory.
VX_SHARED int fuse_last;
VX_SHARED float fuse_top[8];
VX_SHARED float fuse_l[8];
constexpr int FQ = MROWS * HD / 4;                 // (row, 4 channels) items
constexpr int FPART = FQ >= NT ? 1 : NT / FQ;      // threads per item
constexpr int FIPT = (FQ + NT - 1) / NT;           // items per thread (FPART = 1)
constexpr int FSH = FPART > 1 ? FPART * FQ * 4 : 0;  // words of the threads' shares
constexpr int FFIT = (SMEM - FSH) / MROWS;           // splits whose weights fit beside them
constexpr int FCAP = FCHUNK > 0 && FCHUNK < FFIT ? FCHUNK : FFIT;
static_assert(FCAP >= 1, "the split merge's weights do not fit in the ring");
if (FUSE) {
  __threadfence();
  VX_BARRIER();
  if (tid == 0) {
    fuse_last = atomicAdd(count + bh, 1u) == static_cast<unsigned int>(nsplit - 1);
  }
  VX_BARRIER();
  if (fuse_last) {
    __threadfence();
    constexpr float LN2 = 0.6931471805599453f;
    const int64_t first = (int64_t)bh * nsplit * MROWS;  // (bh, split 0, row 0)
    for (int r = warp; r < MROWS; r += NWARPS) {
      float top = NEG;
      for (int sp = lane; sp < nsplit; sp += 32) {
        top = vx_max(top, __ldcg(ml_part + (first + (int64_t)sp * MROWS + r) * 2));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) top = vx_max(top, vx_shfl_xor(top, o));
      float l_sum = 0.0f;
      for (int sp = lane; sp < nsplit; sp += 32) {
        const int64_t row = first + (int64_t)sp * MROWS + r;
        l_sum += __ldcg(ml_part + row * 2 + 1) * vx_exp2(__ldcg(ml_part + row * 2) - top);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l_sum += vx_shfl_xor(l_sum, o);
      if (lane == 0) {
        fuse_top[r] = top;
        fuse_l[r] = l_sum;
      }
    }
    float4* const fs = reinterpret_cast<float4*>(ring);         // the threads' shares
    float* const fw = reinterpret_cast<float*>(ring) + FSH;      // the chunk's weights
    const int part = FPART > 1 ? tid / FQ : 0;
    float4 acc[FIPT];
#pragma unroll
    for (int j = 0; j < FIPT; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c0 = 0; c0 < nsplit; c0 += FCAP) {
      const int nc = vx_imin(FCAP, nsplit - c0);
      VX_BARRIER();  // the rows' max (first chunk) or the last chunk's sums are done
      for (int i = tid; i < nc * MROWS; i += NT) {
        const int r = i % MROWS;
        fw[i] = vx_exp2(__ldcg(ml_part + (first + (int64_t)c0 * MROWS + i) * 2) - fuse_top[r]);
      }
      VX_BARRIER();
#pragma unroll
      for (int j = 0; j < FIPT; ++j) {
        const int item = FPART > 1 ? tid % FQ : tid + j * NT;
        if (part < FPART && item < FQ) {
          const int r = item / (HD / 4);
          const int d4 = item - r * (HD / 4);
          const float4* src = reinterpret_cast<const float4*>(o_part) +
                              ((first + (int64_t)c0 * MROWS + r) * HD) / 4 + d4;
          float4 a = acc[j];
#pragma unroll 8
          for (int k = part; k < nc; k += FPART) {
            const float w = fw[k * MROWS + r];
            const float4 v = __ldcg(src + (int64_t)k * MROWS * (HD / 4));
            a.x += w * v.x;
            a.y += w * v.y;
            a.z += w * v.z;
            a.w += w * v.w;
          }
          acc[j] = a;
        }
      }
    }
    if (FPART > 1) {
      if (part < FPART) fs[tid] = acc[0];
      VX_BARRIER();
    }
#pragma unroll
    for (int j = 0; j < FIPT; ++j) {
      const int item = tid + j * NT;
      if (item < FQ) {
        float4 a = acc[j];
        for (int p = 1; p < FPART; ++p) {
          const float4 v = fs[p * FQ + item];
          a.x += v.x;
          a.y += v.y;
          a.z += v.z;
          a.w += v.w;
        }
        const int r = item / (HD / 4);
        const int d = (item - r * (HD / 4)) * 4;
        const float inv = 1.0f / fuse_l[r];
        OT* const o = out + ((int64_t)bh * MROWS + r) * HD + d;
        vx_store(o, a.x * inv);
        vx_store(o + 1, a.y * inv);
        vx_store(o + 2, a.z * inv);
        vx_store(o + 3, a.w * inv);
        if (d == 0) {
          mlo[((int64_t)bh * MROWS + r) * 2] = fuse_top[r] * LN2;
          mlo[((int64_t)bh * MROWS + r) * 2 + 1] = fuse_l[r];
        }
      }
    }
  }
}
