// Minimal stand-in for MLX's mlx/backend/cuda/device/utils.cuh, which MLX's wheels embed in
// libmlx but do not install. It declares exactly what the code MLX's cuda_kernel generates
// around a velox body relies on (Shape and Strides as MLX passes them, the half/bfloat16
// types). Used where velox compiles that code itself: nvcc's compile checks in CI (through
// metal/shim/cuda; VELOX_MLX_CUDA_INCLUDE names MLX's real headers instead) and NVRTC for
// the kernels' disk cache (velox_core/kernels/disk_cache.py, which checks MAX_NDIM against
// the config.h MLX installs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>

#define MAX_NDIM 10
#define WARP_SIZE 32

namespace mlx::core::cu {

using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;

}  // namespace mlx::core::cu
