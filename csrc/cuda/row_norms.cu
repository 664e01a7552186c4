// CUDA per-row squared norms: one block per row, float (double for double) accumulation in a warp-shuffle
// reduction; the result is float32 for half-precision rows.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace elasticlab {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void row_sq_norms_kernel(const scalar_t* __restrict__ x, acc_t* __restrict__ out, int64_t D,
                                    int64_t out_stride) {
  const int64_t b = blockIdx.x;
  const scalar_t* row = x + b * D;
  acc_t acc = 0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    acc_t v = static_cast<acc_t>(row[j]);
    acc += v * v;
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffff, acc, off);
  __shared__ acc_t warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = (lane < (blockDim.x + 31) / 32) ? warp_sums[lane] : acc_t(0);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffff, acc, off);
    if (lane == 0) out[b * out_stride] = acc;
  }
}

// out[b * out.stride(0)] = |x_b|^2 (out of acc dtype, checked by the caller).
void launch_rows(const at::Tensor& x_in, at::Tensor& out) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t B = x_in.size(0);
  if (B == 0) return;
  auto x = x_in.contiguous().view({B, -1});
  const int64_t D = x.size(1), so = out.stride(0);
  const int threads = 256;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "row_sq_norms_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    row_sq_norms_kernel<scalar_t, acc_t><<<B, threads, 0, stream>>>(x.data_ptr<scalar_t>(), out.data_ptr<acc_t>(), D,
                                                                    so);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor row_sq_norms_cuda(const at::Tensor& x_in) {
  check_row_sq_args(x_in);
  auto out = at::empty({x_in.size(0)}, x_in.options().dtype(acc_type(x_in.scalar_type())));
  launch_rows(x_in, out);
  return out;
}

at::Tensor& row_sq_norms_out_cuda(const at::Tensor& x_in, at::Tensor& out) {
  check_row_sq_out(x_in, out);
  launch_rows(x_in, out);
  return out;
}

}  // namespace elasticlab
