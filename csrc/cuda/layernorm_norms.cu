// CUDA per-example LayerNorm parameter gradients (Gray et al. 2024). Block (b, column block, row split): 32
// columns x 8 rows of threads walk the block's rows of t, recomputing x_hat from mean/rstd; the row splits
// (enough blocks to fill the GPU for short batches and long sequences) write partial sums that one reduction
// adds up. Half-precision x and d are read as they are and accumulated in float32.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>

#include "affine.h"

namespace elasticlab {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void layernorm_per_example_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ d,
                                             const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
                                             acc_t* __restrict__ gw, acc_t* __restrict__ gb, int64_t B, int64_t T,
                                             int64_t D, int64_t rows_per_split) {
  const int64_t b = blockIdx.x, j = static_cast<int64_t>(blockIdx.y) * 32 + threadIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * rows_per_split, t1 = min(T, t0 + rows_per_split);
  acc_t sw = 0, sb = 0;
  if (j < D) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += blockDim.y) {
      const int64_t row = b * T + t;
      const acc_t dv = static_cast<acc_t>(d[row * D + j]);
      sw += dv * (static_cast<acc_t>(x[row * D + j]) - mean[row]) * rstd[row];
      sb += dv;
    }
  }
  __shared__ acc_t s_w[8][33], s_b[8][33];
  s_w[threadIdx.y][threadIdx.x] = sw;
  s_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    for (int k = 1; k < 8; ++k) { sw += s_w[k][threadIdx.x]; sb += s_b[k][threadIdx.x]; }
    const int64_t o = (static_cast<int64_t>(blockIdx.z) * B + b) * D + j;
    gw[o] = sw;
    gb[o] = sb;
  }
}

}  // namespace

namespace cuda {

std::tuple<at::Tensor, at::Tensor> layernorm_partials(const at::Tensor& x_in, const at::Tensor& d_in,
                                                      const at::Tensor& mean_in, const at::Tensor& rstd_in) {
  auto x = x_in.contiguous(), d = d_in.contiguous(), mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const auto acc = acc_type(x.scalar_type());
  if (B == 0 || D == 0 || T == 0) {
    auto z = at::zeros({1, B, D}, x.options().dtype(acc));
    return {z, z.clone()};
  }
  const int64_t cb = (D + 31) / 32;
  EL_CHECK(cb <= 65535, "layernorm_per_example: D too large for the CUDA grid (", D, ")");
  // Row splits: about four blocks per SM in all, each walking at least 64 rows.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::max<int64_t>(1, (4 * sms + B * cb - 1) / (B * cb));
  const int64_t splits = std::min<int64_t>({want, std::max<int64_t>(1, T / 64), 65535});
  const int64_t rows = (T + splits - 1) / splits;
  auto pw = at::empty({splits, B, D}, x.options().dtype(acc)), pb = at::empty_like(pw);
  dim3 grid(B, cb, splits), block(32, 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layernorm_per_example_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    layernorm_per_example_kernel<scalar_t, acc_t><<<grid, block, 0, stream>>>(
        x.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(),
        pw.data_ptr<acc_t>(), pb.data_ptr<acc_t>(), B, T, D, rows);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {pw, pb};
}

}  // namespace cuda

std::tuple<at::Tensor, at::Tensor> layernorm_per_example_cuda(const at::Tensor& x, const at::Tensor& d,
                                                              const at::Tensor& mean, const at::Tensor& rstd) {
  check_layernorm_args(x, d, mean, rstd);
  c10::cuda::CUDAGuard guard(x.device());
  auto [pw, pb] = cuda::layernorm_partials(x, d, mean, rstd);
  if (pw.size(0) == 1) return {pw[0], pb[0]};
  return {pw.sum(0), pb.sum(0)};
}

}  // namespace elasticlab
