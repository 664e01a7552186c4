// cuBLAS strided-batched GEMMs on row-major per-example matrices (see blas.h).
#include "blas.h"
#include "../ops.h"
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <cublas_v2.h>
#include <algorithm>
#include <limits>

namespace elasticlab {
namespace cuda {
namespace {

// How a (c, R, K) tensor's per-example matrix sits in memory as a column-major BLAS matrix: stored_t means
// memory holds X^T (K x R, row-major X), otherwise X itself (R x K); ld is its leading dimension.
struct Operand {
  at::Tensor t;
  bool stored_t;
  int64_t ld;
};

Operand operand(const at::Tensor& x) {
  const int64_t R = x.size(1), K = x.size(2);
  if (x.stride(2) == 1 || K == 1) {
    const int64_t ld = R == 1 ? std::max<int64_t>(K, 1) : x.stride(1);
    if (ld >= std::max<int64_t>(K, 1)) return {x, true, ld};
  }
  if (x.stride(1) == 1 || R == 1) {
    const int64_t ld = K == 1 ? std::max<int64_t>(R, 1) : x.stride(2);
    if (ld >= std::max<int64_t>(R, 1)) return {x, false, ld};
  }
  auto c = x.contiguous();
  return {c, true, std::max<int64_t>(K, 1)};
}

cudaDataType_t blas_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return CUDA_R_64F;
    case at::kFloat: return CUDA_R_32F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: EL_CHECK(false, "batched_gemm: unsupported dtype ", t);
  }
}

int as_int(int64_t v, const char* what) {
  EL_CHECK(v <= std::numeric_limits<int>::max(), "batched_gemm: ", what, " too large for cuBLAS (", v, ")");
  return static_cast<int>(v);
}

}  // namespace

void batched_gemm(const at::Tensor& A_in, bool trans_a, const at::Tensor& B_in, bool trans_b, at::Tensor& C) {
  EL_CHECK(A_in.dim() == 3 && B_in.dim() == 3 && C.dim() == 3 && C.is_contiguous(), "batched_gemm: bad operands");
  EL_CHECK(A_in.scalar_type() == B_in.scalar_type(), "batched_gemm: operands must share a dtype");
  const int64_t batch = A_in.size(0);
  const int64_t M = trans_a ? A_in.size(2) : A_in.size(1), K = trans_a ? A_in.size(1) : A_in.size(2);
  const int64_t N = trans_b ? B_in.size(1) : B_in.size(2);
  EL_CHECK((trans_b ? B_in.size(2) : B_in.size(1)) == K && C.size(0) == batch && C.size(1) == M && C.size(2) == N,
           "batched_gemm: shapes do not match");
  if (batch == 0 || M == 0 || N == 0) return;
  if (K == 0) {
    C.zero_();
    return;
  }
  // Row-major C (M x N) is column-major C^T (N x M) = op(B)^T op(A)^T: cuBLAS's first operand is op(B)^T.
  const Operand a = operand(A_in), b = operand(B_in);
  const cublasOperation_t op1 = ((!trans_b) == b.stored_t) ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op2 = ((!trans_a) == a.stored_t) ? CUBLAS_OP_N : CUBLAS_OP_T;
  const auto in = A_in.scalar_type();
  const cudaDataType_t tin = blas_type(in), tout = blas_type(C.scalar_type());
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (in == at::kDouble) {
    compute = CUBLAS_COMPUTE_64F;
  } else if (in == at::kFloat && (tf32_mode < 0 ? at::globalContext().allowTF32CuBLAS() : tf32_mode == 1)) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  const float one_f = 1.f, zero_f = 0.f;
  const double one_d = 1.0, zero_d = 0.0;
  const void* alpha = in == at::kDouble ? static_cast<const void*>(&one_d) : static_cast<const void*>(&one_f);
  const void* beta = in == at::kDouble ? static_cast<const void*>(&zero_d) : static_cast<const void*>(&zero_f);
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();   // bound to the current stream
  TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, op1, op2, as_int(N, "N"), as_int(M, "M"), as_int(K, "K"), alpha,
      b.t.data_ptr(), tin, as_int(b.ld, "ld"), batch > 1 ? b.t.stride(0) : 0,
      a.t.data_ptr(), tin, as_int(a.ld, "ld"), batch > 1 ? a.t.stride(0) : 0,
      beta, C.data_ptr(), tout, as_int(N, "N"), M * N, as_int(batch, "batch"), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace cuda
}  // namespace elasticlab
