// CUDA outer-product per-example norms fused with the weight gradient (Gray et al. 2024, Sec. 3): the
// per-example products G_b = d_b^T a_b of a chunk of examples come from one cuBLAS strided-batched GEMM (tensor
// cores for bf16/fp16, and for fp32 when TF32 is allowed) and one pass over them (fold.cuh) reduces each to
// its squared norm and adds their sum into the weight gradient: the same FLOPs as the weight-gradient GEMM,
// plus one write and one read of the chunk's products (bfloat16 ones for bfloat16 inputs). Chunks keep the
// scratch under scratch_budget() (ops.h).
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
constexpr int kThreads = kFoldWarps * 32;

template <typename g_t, typename acc_t, int V, int R>
void launch_fold(const at::Tensor& G, at::Tensor& partial, acc_t* grad, bool accumulate, int64_t c, int64_t n,
                 dim3 grid, int64_t group) {
  fold_products_kernel<g_t, acc_t, V, R><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const g_t*>(G.data_ptr()), c, n, group, partial.data_ptr<acc_t>(), grad, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Four vectors per thread for large products, one for small ones (more blocks along n).
template <typename g_t, typename acc_t, int V>
void launch_fold_r(const at::Tensor& G, at::Tensor& partial, acc_t* grad, bool accumulate, int64_t c, int64_t n,
                   dim3 grid, int64_t group, int R) {
  if (R == 4) launch_fold<g_t, acc_t, V, 4>(G, partial, grad, accumulate, c, n, grid, group);
  else launch_fold<g_t, acc_t, V, 1>(G, partial, grad, accumulate, c, n, grid, group);
}
}  // namespace

void fold_products(const at::Tensor& G, at::Tensor norms, at::Tensor grad, bool accumulate) {
  const int64_t c = G.size(0), n = G.numel() / std::max<int64_t>(c, 1);
  if (c == 0) return;
  const auto acc = norms.scalar_type();
  const int vec = G.scalar_type() == at::kDouble ? 2 : (G.element_size() == 2 ? 8 : 4);
  const int V = (n % vec == 0) ? vec : 1;
  const int64_t nv = n / V;
  // Enough blocks to fill the GPU (about four per SM): along n when the products are large enough (four
  // vectors a thread when they are very large), else also over groups of examples. A group has at least 4
  // examples (its gradient row then costs at most half its products' traffic) and at most kFoldMaxGroup.
  const int64_t target = 4 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const int64_t bx1 = std::max<int64_t>(1, (nv + kThreads - 1) / kThreads);
  const int R = bx1 >= 4 * target ? 4 : 1;
  const int64_t bx = std::max<int64_t>(1, (nv + kThreads * R - 1) / (kThreads * R));
  EL_CHECK(bx <= 0x7fffffff, "fold_products: product too large (", n, " elements)");
  int64_t groups = bx1 >= target ? 1 : std::min<int64_t>((target + bx - 1) / bx, (c + 3) / 4);
  groups = std::max<int64_t>(groups, (c + kFoldMaxGroup - 1) / kFoldMaxGroup);
  const int64_t group = (c + groups - 1) / groups;
  groups = (c + group - 1) / group;
  EL_CHECK(groups <= 65535, "fold_products: too many examples in one chunk (", c, ")");
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(groups));
  auto partial = at::empty({c, bx}, norms.options());
  const bool with_grad = grad.defined() && grad.numel() > 0;
  // One group writes straight into grad; several write their rows into a scratch summed below.
  at::Tensor rows = (with_grad && groups > 1) ? at::empty({groups, n}, norms.options()) : at::Tensor();
  at::Tensor target_t = rows.defined() ? rows : grad;
  const bool acc_in_kernel = accumulate && !rows.defined();
  if (acc == at::kDouble) {
    double* pg = with_grad ? target_t.data_ptr<double>() : nullptr;
    if (V == 2) launch_fold_r<double, double, 2>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
    else launch_fold_r<double, double, 1>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
  } else {
    float* pg = with_grad ? target_t.data_ptr<float>() : nullptr;
    switch (G.scalar_type()) {
      case at::kFloat:
        if (V == 4) launch_fold_r<float, float, 4>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        else launch_fold_r<float, float, 1>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        break;
      case at::kBFloat16:
        if (V == 8) launch_fold_r<c10::BFloat16, float, 8>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        else launch_fold_r<c10::BFloat16, float, 1>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        break;
      case at::kHalf:
        if (V == 8) launch_fold_r<c10::Half, float, 8>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        else launch_fold_r<c10::Half, float, 1>(G, partial, pg, acc_in_kernel, c, n, grid, group, R);
        break;
      default:
        EL_CHECK(false, "fold_products: unsupported dtype ", G.scalar_type());
    }
  }
  at::sum_out(norms, partial, {1});
  if (rows.defined()) {
    at::Tensor flat = grad.view({n});
    if (accumulate) flat.add_(rows.sum(0));
    else at::sum_out(flat, rows, {0});
  }
}

}  // namespace cuda

namespace {
// The norms into `norms` ((B,) of acc type, checked by the caller), the gradient returned.
at::Tensor outer_norms_into(const at::Tensor& a, const at::Tensor& d, bool with_grad, at::Tensor norms) {
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t B = a.size(0), T = a.size(1), Din = a.size(2), Dout = d.size(2);
  const auto acc = acc_type(a.scalar_type());
  if (B == 0 || Din == 0 || Dout == 0 || T == 0) {
    norms.zero_();
    return with_grad ? at::zeros({Dout, Din}, a.options().dtype(acc)) : at::empty({0}, a.options().dtype(acc));
  }
  // Both written in full by the folds (the first chunk's without accumulating): no memset launches.
  auto grad = with_grad ? at::empty({Dout, Din}, a.options().dtype(acc)) : at::empty({0}, a.options().dtype(acc));
  // Products in bfloat16 for bfloat16 inputs (same range as float32, half the traffic; the GEMM accumulates
  // in float32 and the fold sums in float32), float32 for float16 inputs (whose range a product may exceed).
  const auto g_type = a.scalar_type() == at::kBFloat16 ? at::kBFloat16 : acc;
  const int64_t per = Din * Dout * at::elementSize(g_type);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, scratch_budget() / std::max<int64_t>(per, 1)));
  auto G = at::empty({chunk, Dout, Din}, a.options().dtype(g_type));
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    const int64_t c = std::min(chunk, B - b0);
    auto Gc = batch_rows(G, 0, c);
    // Gc_b = d_b^T a_b: (Dout x T)(T x Din).
    cuda::batched_gemm(batch_rows(d, b0, c), /*trans_a=*/true, batch_rows(a, b0, c), /*trans_b=*/false, Gc);
    cuda::fold_products(Gc, batch_rows(norms, b0, c), grad, /*accumulate=*/b0 > 0);
  }
  return grad;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cuda(const at::Tensor& a, const at::Tensor& d,
                                                               bool with_grad) {
  check_seq_args("seq_linear_outer_norms", a, d);
  auto norms = at::empty({a.size(0)}, a.options().dtype(acc_type(a.scalar_type())));
  auto grad = outer_norms_into(a, d, with_grad, norms);
  return {norms, grad};
}

at::Tensor seq_linear_outer_norms_out_cuda(const at::Tensor& a, const at::Tensor& d, bool with_grad,
                                           at::Tensor& norms) {
  check_seq_args("seq_linear_outer_norms", a, d);
  check_norms_row("seq_linear_outer_norms", a, norms);
  return outer_norms_into(a, d, with_grad, norms);
}

}  // namespace elasticlab
