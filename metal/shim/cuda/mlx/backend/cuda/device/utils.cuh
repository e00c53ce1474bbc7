// The stand-in for MLX's mlx/backend/cuda/device/utils.cuh under the name the generated source
// includes, for nvcc's compile checks (its text: metal/mlx_device_utils.cuh).
#pragma once
#include "../../../../../../mlx_device_utils.cuh"
