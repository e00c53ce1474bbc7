// Keys' Johnson-Lindenstrauss sign sketches and norms, outlier channels given.
// Body written once for Metal and CUDA (see velox_kernels.h). One thread per output word.
//
// Matches velox_core.ops.sign_sketch + velox_core.ops.pack(bits, 1) and the norms: for a
// token x with its block's outlier channels O (K of them; none
// when K == 0), x_in is x with the channels of O zeroed and x_o is x on O only, and
//   sign  bit i%32 of word i/32 = (S[i] . x_in >= 0)  for sketch rows i < M  (1 at +-0),
//   norm  = ||x_in||,
//   osign bit i%32 of word i/32 = (S[i] . x_o >= 0)   for sketch rows i < MO,
//   onorm = ||x_o||,
// the bits of a last partial word above M (MO) zero, as pack lays them out. Dots and sums of
// squares are float32 FMAs in channel order (the main sketch D - K products, the outlier
// sketch K products); the reference's matmul sums in another order, so a sign can differ
// only where |S x| is within float32 rounding of 0, and a norm by a rounding of its dtype.
//
// Threads: a token's W = ceil(M / 32) main words, then its WO = ceil(MO / 32) outlier words
// (none when K == 0). A main word's thread walks the token's channels once, skipping the
// outlier channels (the block's indices are sorted ascending and distinct, as the
// caller gives them), with 32 accumulators for its 32 rows of S;
// word 0 also writes the norm. An outlier word's thread reads only the K outlier channels;
// outlier word 0 writes the outlier norm. Rows past M (MO) in a partial word read row
// M - 1 (MO - 1) of S (always present) and their bits are dropped.
//
// Template: D (head dim), M, MO (sketch rows; MO unused when K == 0), K (outlier channels a
// block, 0 for none), GROUP (tokens a block: row r's indices are row r / GROUP of idx; the
// host's rows are (batch, head, token) in order with T a multiple of GROUP), NT (norm dtype).
// Inputs: x (rows, D) any float dtype, contiguous; s (R, D) with R >= max(M, MO), contiguous
// (float16, the projection); idx (rows / GROUP, K) int32 (a dummy when K == 0).
// Outputs: sign (rows, W) uint32, norm (rows,) NT, osign (rows, WO) uint32, onorm (rows,) NT
// (the last two untouched when K == 0; the host gives them a dummy shape).

constexpr int W = (M + 31) / 32;
constexpr int WO = K > 0 ? (MO + 31) / 32 : 0;
constexpr int NW = W + WO;
const int64_t gid = (int64_t)vx_global_x;
const int64_t rows = (int64_t)x_shape[0];
if (gid < rows * NW) {
  const int w = (int)(gid % NW);
  const int64_t row = gid / NW;
  const int64_t xb = row * D;
  const int64_t ib = (row / GROUP) * K;
  const bool is_main = w < W;
  const int r0 = (is_main ? w : w - W) * 32;
  const int nr = is_main ? M : MO;  // sketch rows of this word's sketch
  float acc[32];
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    acc[j] = 0.0f;
  }
  float ss = 0.0f;
  if (is_main) {
    int p = 0;
    int next = K > 0 ? (int)idx[ib] : D;  // the next outlier channel to skip
    for (int c = 0; c < D; ++c) {
      if (c == next) {
        ++p;
        next = p < K ? (int)idx[ib + p] : D;
        continue;
      }
      const float v = static_cast<float>(x[xb + c]);
      ss = vx_fma(v, v, ss);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int r = vx_imin(r0 + j, M - 1);
        acc[j] = vx_fma(v, static_cast<float>(s[(int64_t)r * D + c]), acc[j]);
      }
    }
  } else {
    for (int p = 0; p < K; ++p) {
      const int c = (int)idx[ib + p];
      const float v = static_cast<float>(x[xb + c]);
      ss = vx_fma(v, v, ss);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int r = vx_imin(r0 + j, MO - 1);
        acc[j] = vx_fma(v, static_cast<float>(s[(int64_t)r * D + c]), acc[j]);
      }
    }
  }
  unsigned int word = 0u;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    word |= (acc[j] >= 0.0f && r0 + j < nr) ? (1u << j) : 0u;
  }
  const float nrm = vx_sqrt(ss);  // correctly rounded on both backends
  if (is_main) {
    sign[row * W + w] = word;
    if (w == 0) {
      norm[row] = static_cast<NT>(nrm);
    }
  } else {
    osign[row * WO + (w - W)] = word;
    if (w == W) {
      onorm[row] = static_cast<NT>(nrm);
    }
  }
}
