// Stand-in for <cooperative_groups.h> in the CPU emulation of CUDA kernels (unused by velox).
#pragma once
namespace cooperative_groups {}
