// Batched GEMMs of per-example sequence matrices through cuBLAS (strided-batched, tensor cores for half
// inputs and, for float32, when TF32 is allowed: torch's matmul setting, or the caller's, tf32_mode in ops.h),
// with float32 output for half inputs.
#pragma once
#include <ATen/ATen.h>

namespace elasticlab {
namespace cuda {

// C_b = op(A_b) op(B_b) for every b, C (c, M, N) contiguous and row-major. A and B are (c, ·, ·) tensors of
// one dtype whose last or middle dimension is unit-stride (any other layout is copied first); op transposes
// when the flag is set. C's dtype is A's, or float32 for half-precision A (accumulation is float32 either way).
void batched_gemm(const at::Tensor& A, bool trans_a, const at::Tensor& B, bool trans_b, at::Tensor& C);

}  // namespace cuda
}  // namespace elasticlab
