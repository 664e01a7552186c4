// Kernel declarations of elasticlab._C. Kernels live in csrc/cpu and csrc/cuda, the operator
// schemas in csrc/registry.cpp, the per-device registrations in csrc/*/dispatch_*.cpp, and the
// Python module in csrc/bindings.cpp.
#pragma once
#include <ATen/ATen.h>

namespace elasticlab {

// Per-row squared L2 norm of a tensor viewed as (B, -1): out[b] = sum_j x[b, j]^2.
at::Tensor row_sq_norms_cpu(const at::Tensor& x);
#ifdef ELASTICLAB_WITH_CUDA
at::Tensor row_sq_norms_cuda(const at::Tensor& x);
#endif

}  // namespace elasticlab
