// Minimal stand-in for MLX's mlx/backend/cuda/device/utils.cuh, for compiling the CUDA
// instantiation of velox's kernels with nvcc where MLX's CUDA headers are not installed
// (CI without a GPU). It declares exactly what the code MLX's cuda_kernel generates relies
// on (Shape and Strides, the half/bfloat16 types); set VELOX_MLX_CUDA_INCLUDE to a directory
// holding MLX's real headers (mlx/backend/cuda/device/...) to compile against those instead.
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
