// CUDA outer-product per-example norms fused with the weight gradient (Gray et al. 2024, Sec. 3): the
// per-example products G_b = d_b^T a_b of a chunk of examples come from one cuBLAS strided-batched GEMM (tensor
// cores for bf16/fp16, and for fp32 when TF32 is allowed) and one pass over them (fold.cuh) reduces each to
// its squared norm and adds their sum into the weight gradient: the same FLOPs as the weight-gradient GEMM,
// plus one write and one read of the chunk's products (bfloat16 ones for bfloat16 inputs). Chunks keep the
// scratch under kScratchBytes.
#include "../ops.h"
#include "blas.h"
#include "fold.cuh"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>

namespace elasticlab {
namespace cuda {

namespace {
constexpr int kThreads = 256, kR = 4;

template <typename g_t, typename acc_t, int V>
void launch_fold(const at::Tensor& G, at::Tensor& partial, acc_t* grad, bool accumulate, int64_t c, int64_t n,
                 int64_t blocks) {
  fold_products_kernel<g_t, acc_t, V, kR><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const g_t*>(G.data_ptr()), c, n, partial.data_ptr<acc_t>(), grad, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

void fold_products(const at::Tensor& G, at::Tensor norms, at::Tensor grad, bool accumulate) {
  const int64_t c = G.size(0), n = G.numel() / std::max<int64_t>(c, 1);
  if (c == 0) return;
  const auto acc = norms.scalar_type();
  const int vec = G.scalar_type() == at::kDouble ? 2 : (G.element_size() == 2 ? 8 : 4);
  const int V = (n % vec == 0) ? vec : 1;
  const int64_t nv = n / V;
  const int64_t blocks = std::max<int64_t>(1, (nv + kThreads * kR - 1) / (kThreads * kR));
  TORCH_CHECK(blocks <= 0x7fffffff, "fold_products: product too large (", n, " elements)");
  auto partial = at::empty({c, blocks}, norms.options());
  const bool with_grad = grad.defined() && grad.numel() > 0;
  if (acc == at::kDouble) {
    double* pg = with_grad ? grad.data_ptr<double>() : nullptr;
    if (V == 2) launch_fold<double, double, 2>(G, partial, pg, accumulate, c, n, blocks);
    else launch_fold<double, double, 1>(G, partial, pg, accumulate, c, n, blocks);
  } else {
    float* pg = with_grad ? grad.data_ptr<float>() : nullptr;
    switch (G.scalar_type()) {
      case at::kFloat:
        if (V == 4) launch_fold<float, float, 4>(G, partial, pg, accumulate, c, n, blocks);
        else launch_fold<float, float, 1>(G, partial, pg, accumulate, c, n, blocks);
        break;
      case at::kBFloat16:
        if (V == 8) launch_fold<c10::BFloat16, float, 8>(G, partial, pg, accumulate, c, n, blocks);
        else launch_fold<c10::BFloat16, float, 1>(G, partial, pg, accumulate, c, n, blocks);
        break;
      case at::kHalf:
        if (V == 8) launch_fold<c10::Half, float, 8>(G, partial, pg, accumulate, c, n, blocks);
        else launch_fold<c10::Half, float, 1>(G, partial, pg, accumulate, c, n, blocks);
        break;
      default:
        TORCH_CHECK(false, "fold_products: unsupported dtype ", G.scalar_type());
    }
  }
  at::sum_out(norms, partial, {1});
}

}  // namespace cuda

std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cuda(const at::Tensor& a, const at::Tensor& d,
                                                               bool with_grad) {
  check_seq_args("seq_linear_outer_norms", a, d);
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0), T = a.size(1), Din = a.size(2), Dout = d.size(2);
  const auto acc = acc_type(a.scalar_type());
  auto norms = at::zeros({B}, a.options().dtype(acc));
  auto grad = with_grad ? at::zeros({Dout, Din}, a.options().dtype(acc)) : at::empty({0}, a.options().dtype(acc));
  if (B == 0 || Din == 0 || Dout == 0 || T == 0) return {norms, grad};
  // Products in bfloat16 for bfloat16 inputs (same range as float32, half the traffic; the GEMM accumulates
  // in float32 and the fold sums in float32), float32 for float16 inputs (whose range a product may exceed).
  const auto g_type = a.scalar_type() == at::kBFloat16 ? at::kBFloat16 : acc;
  const int64_t per = Din * Dout * at::elementSize(g_type);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, cuda::kScratchBytes / std::max<int64_t>(per, 1)));
  auto G = at::empty({chunk, Dout, Din}, a.options().dtype(g_type));
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t c = std::min(chunk, B - b0);
    auto Gc = G.narrow(0, 0, c);
    // Gc_b = d_b^T a_b: (Dout x T)(T x Din).
    cuda::batched_gemm(d.narrow(0, b0, c), /*trans_a=*/true, a.narrow(0, b0, c), /*trans_b=*/false, Gc);
    cuda::fold_products(Gc, norms.narrow(0, b0, c), grad, /*accumulate=*/b0 > 0);
  }
  return {norms, grad};
}

}  // namespace elasticlab
