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

// One block per example b: out[0, b] = |a_b|^2 |d_b|^2 and out[1, b] = |d_b|^2 (Goodfellow 2015), both rows
// reduced in the same pass (the two sums ride together through the warp shuffles). With gb, blocks B and up
// each sum blockDim.x columns of d over the batch: gb[j] = sum_b d[b, j], the Linear's bias gradient.
template <typename scalar_t, typename acc_t>
__global__ void product_norms_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ d,
                                     acc_t* __restrict__ out, acc_t* __restrict__ gb, int64_t B, int64_t Din,
                                     int64_t Dout, int64_t row_stride, int64_t b_stride) {
  if (static_cast<int64_t>(blockIdx.x) >= B) {  // a column block of the bias gradient (whole block: no sync)
    const int64_t j = (static_cast<int64_t>(blockIdx.x) - B) * blockDim.x + threadIdx.x;
    if (j >= Dout) return;
    acc_t s = 0;
    for (int64_t r = 0; r < B; ++r) s += static_cast<acc_t>(d[r * Dout + j]);
    gb[j] = s;
    return;
  }
  const int64_t b = blockIdx.x;
  const scalar_t *ra = a + b * Din, *rd = d + b * Dout;
  acc_t sa = 0, sd = 0;
  for (int64_t j = threadIdx.x; j < Din; j += blockDim.x) {
    acc_t v = static_cast<acc_t>(ra[j]);
    sa += v * v;
  }
  for (int64_t j = threadIdx.x; j < Dout; j += blockDim.x) {
    acc_t v = static_cast<acc_t>(rd[j]);
    sd += v * v;
  }
  for (int off = 16; off > 0; off >>= 1) {
    sa += __shfl_down_sync(0xffffffff, sa, off);
    sd += __shfl_down_sync(0xffffffff, sd, off);
  }
  __shared__ acc_t warp_a[32], warp_d[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    warp_a[warp] = sa;
    warp_d[warp] = sd;
  }
  __syncthreads();
  if (warp == 0) {
    const bool live = lane < (blockDim.x + 31) / 32;
    sa = live ? warp_a[lane] : acc_t(0);
    sd = live ? warp_d[lane] : acc_t(0);
    for (int off = 16; off > 0; off >>= 1) {
      sa += __shfl_down_sync(0xffffffff, sa, off);
      sd += __shfl_down_sync(0xffffffff, sd, off);
    }
    if (lane == 0) {
      out[b * b_stride] = sa * sd;
      out[row_stride + b * b_stride] = sd;
    }
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

// The product rows into out, and with gb defined ((Dout,) of acc type) the bias gradient too, in one launch.
void launch_products(const at::Tensor& a_in, const at::Tensor& d_in, at::Tensor& out, at::Tensor gb = {}) {
  c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t B = a_in.size(0), Dout = d_in.size(1);
  const int threads = 256;
  const int64_t col_blocks = gb.defined() ? (Dout + threads - 1) / threads : 0;
  if (B + col_blocks == 0) return;
  auto a = a_in.contiguous(), d = d_in.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "product_norms_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    product_norms_kernel<scalar_t, acc_t><<<B + col_blocks, threads, 0, stream>>>(
        a.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), out.data_ptr<acc_t>(),
        gb.defined() ? gb.data_ptr<acc_t>() : nullptr, B, a.size(1), Dout, out.stride(0), out.stride(1));
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

at::Tensor& product_norms_out_cuda(const at::Tensor& a, const at::Tensor& d, at::Tensor& out) {
  check_product_args(a, d, out);
  launch_products(a, d, out);
  return out;
}

at::Tensor product_bias_norms_cuda(const at::Tensor& a, const at::Tensor& d, at::Tensor& out) {
  check_product_args(a, d, out);
  auto gb = at::empty({d.size(1)}, d.options().dtype(acc_type(d.scalar_type())));  // written in full
  launch_products(a, d, out, gb);
  return gb;
}

}  // namespace elasticlab
