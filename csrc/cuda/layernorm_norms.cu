// CUDA per-example LayerNorm parameter gradients (Gray et al. 2024): block (b, column block), threads
// (32 columns x 8 rows of t); x_hat is recomputed from mean/rstd, partial sums reduced in shared memory.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace elasticlab {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void layernorm_per_example_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ d,
                                             const scalar_t* __restrict__ mean, const scalar_t* __restrict__ rstd,
                                             scalar_t* __restrict__ gw, scalar_t* __restrict__ gb, int64_t T,
                                             int64_t D) {
  const int64_t b = blockIdx.x, j = static_cast<int64_t>(blockIdx.y) * 32 + threadIdx.x;
  acc_t sw = 0, sb = 0;
  if (j < D) {
    for (int64_t t = threadIdx.y; t < T; t += blockDim.y) {
      const int64_t row = b * T + t;
      const acc_t dv = static_cast<acc_t>(d[row * D + j]);
      sw += dv * (static_cast<acc_t>(x[row * D + j]) - static_cast<acc_t>(mean[row])) * static_cast<acc_t>(rstd[row]);
      sb += dv;
    }
  }
  __shared__ acc_t s_w[8][33], s_b[8][33];
  s_w[threadIdx.y][threadIdx.x] = sw;
  s_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    for (int k = 1; k < 8; ++k) { sw += s_w[k][threadIdx.x]; sb += s_b[k][threadIdx.x]; }
    gw[b * D + j] = static_cast<scalar_t>(sw);
    gb[b * D + j] = static_cast<scalar_t>(sb);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> layernorm_per_example_cuda(const at::Tensor& x_in, const at::Tensor& d_in,
                                                              const at::Tensor& mean_in, const at::Tensor& rstd_in) {
  check_layernorm_args(x_in, d_in, mean_in, rstd_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous(), d = d_in.contiguous(), mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  auto gw = at::zeros({B, D}, x.options()), gb = at::zeros({B, D}, x.options());
  if (B == 0 || D == 0) return {gw, gb};
  TORCH_CHECK((D + 31) / 32 <= 65535, "layernorm_per_example: D too large for the CUDA grid (", D, ")");
  dim3 grid(B, (D + 31) / 32), block(32, 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "layernorm_per_example_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    layernorm_per_example_kernel<scalar_t, acc_t><<<grid, block, 0, stream>>>(
        x.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>(),
        gw.data_ptr<scalar_t>(), gb.data_ptr<scalar_t>(), T, D);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gw, gb};
}

}  // namespace elasticlab
