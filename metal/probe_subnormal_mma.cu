// A probe of the tensor cores (CUDA only, one warp): one m16n8k16 fp16 MMA whose A operand
// holds 4-bit codes masked in place at bit offsets 0 to 6, the fp16 subnormals
// code * 2^(o - 24) that the tensor-core decode kernel's folds (KFOLD, VFOLD) put into its
// MMAs, and whose B operand is all ones. Each output is a row sum of A: a multiple of 2^-24
// below 2^-9, exact in float32 where the MMA takes subnormal operands exactly, and the host
// (velox_core.kernels.decode.mma_subnormals_exact) compares it with the sums it computes.
// Input: salt (one uint32, varies the codes). Output: out (32 lanes x 4 floats: the C
// fragment, lane 4 (r % 8) + n / 2 holding element 2 (r >= 8) + n % 2).
// A (r, k): lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2.

const int lane = vx_tid & 31;
const unsigned int salt = salt_in[0];
auto code_bits = [&](int r, int k) {  // the host's twin: decode.py, _probe_code_bits
  const unsigned int code = (static_cast<unsigned int>(16 * r + k) + salt) % 15u + 1u;
  const unsigned int o = (static_cast<unsigned int>(r + 3 * k) + salt) % 7u;
  return code << o;
};
unsigned int a[4];
#pragma unroll
for (int reg = 0; reg < 4; ++reg) {
  const int r = (lane >> 2) + 8 * (reg & 1);
  const int k = 2 * (lane & 3) + 8 * (reg >> 1);
  a[reg] = code_bits(r, k) | (code_bits(r, k + 1) << 16);
}
float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
const unsigned int ones = 0x3c003c00u;  // fp16 1.0 in both halves
vx_mma16816(d, a[0], a[1], a[2], a[3], ones, ones);
#pragma unroll
for (int i = 0; i < 4; ++i) {
  out[lane * 4 + i] = d[i];
}
