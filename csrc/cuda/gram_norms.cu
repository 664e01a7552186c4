// CUDA Gram-form per-example norms (Li et al. 2022 ghost norm): |G_b|^2 = sum_{t,s} (a_t.a_s)(d_t.d_s). The two
// T x T Gram matrices of a chunk of examples come from cuBLAS strided-batched GEMMs (float32 output, tensor
// cores for half inputs), then one elementwise product and sum per example. Chunks keep the scratch under
// scratch_budget() (ops.h).
#include "../ops.h"
#include "blas.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>

namespace elasticlab {

at::Tensor seq_linear_gram_norms_cuda(const at::Tensor& a, const at::Tensor& d) {
  check_seq_args("seq_linear_gram_norms", a, d);
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0), T = a.size(1);
  const auto acc = acc_type(a.scalar_type());
  if (B == 0 || T == 0 || a.size(2) == 0 || d.size(2) == 0) return at::zeros({B}, a.options().dtype(acc));
  auto norms = at::empty({B}, a.options().dtype(acc));   // every chunk's sum writes its rows
  const int64_t per = 2 * T * T * at::elementSize(acc);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, scratch_budget() / per));
  auto Ga = at::empty({chunk, T, T}, a.options().dtype(acc)), Gd = at::empty_like(Ga);
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t c = std::min(chunk, B - b0);
    auto ga = batch_rows(Ga, 0, c), gd = batch_rows(Gd, 0, c);
    auto ac = batch_rows(a, b0, c), dc = batch_rows(d, b0, c);
    cuda::batched_gemm(ac, false, ac, true, ga);          // a_b a_b^T
    cuda::batched_gemm(dc, false, dc, true, gd);          // d_b d_b^T
    auto out = batch_rows(norms, b0, c);
    at::sum_out(out, ga.mul_(gd), {1, 2});
  }
  return norms;
}

}  // namespace elasticlab
