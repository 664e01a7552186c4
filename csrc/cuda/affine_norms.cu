// CUDA normalisation-layer affine gradients with their per-example norms (see ops.h), in two launches per
// layer: the per-example gradients (LayerNorm: the row-split kernel of layernorm_norms.cu; GroupNorm: one
// block per (example, channel) below), then one "finish" launch whose first blocks sum them over the batch
// (the parameter gradients) and whose other blocks take each example's squared norms into the caller's
// (2, B) buffer. No atomics: the results are deterministic. The same finish launch serves batch_sum_norms (a
// bias' per-example gradients of a sequence Linear or a convolution: its sum and their norms).
#include "../ops.h"
#include "affine.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace elasticlab {
namespace {

constexpr int kThreads = 256;

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); the result is valid in thread 0.
template <typename acc_t>
__device__ acc_t block_sum(acc_t v, acc_t* shared /* [32] */) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = 0;
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : acc_t(0);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
  }
  __syncthreads();  // shared is reused by the caller's next sum
  return v;
}

// pw, pb: (S, B, D) partials of the per-example gradients. Blocks [0, col_blocks): gw[j] = Σ_{s,b} pw[s,b,j]
// (and gb), one column per thread. Blocks [col_blocks, col_blocks + B): example b's |Σ_s pw[s,b,:]|^2 into
// norms[0, b] and |Σ_s pb[s,b,:]|^2 into norms[1, b]. Without pw (with_w false; batch_sum_norms: one array,
// e.g. a bias' per-example gradients) only gb and the pb norms, these at norms[b * b_stride]. (A flag, not a
// null pw: an empty batch's pw has a null data pointer, and its gw must still be written, as zeros.)
template <typename acc_t>
__global__ void affine_finish_kernel(const acc_t* __restrict__ pw, const acc_t* __restrict__ pb,
                                     acc_t* __restrict__ gw, acc_t* __restrict__ gb, acc_t* __restrict__ norms,
                                     int64_t S, int64_t B, int64_t D, int64_t col_blocks, int64_t row_stride,
                                     int64_t b_stride, bool with_w) {
  if (static_cast<int64_t>(blockIdx.x) < col_blocks) {
    const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j >= D) return;
    acc_t sw = 0, sb = 0;
    for (int64_t k = 0; k < S * B; ++k) {
      if (with_w) sw += pw[k * D + j];
      sb += pb[k * D + j];
    }
    if (with_w) gw[j] = sw;
    gb[j] = sb;
    return;
  }
  const int64_t b = static_cast<int64_t>(blockIdx.x) - col_blocks;
  acc_t qw = 0, qb = 0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    acc_t vw = 0, vb = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (with_w) vw += pw[(s * B + b) * D + j];
      vb += pb[(s * B + b) * D + j];
    }
    qw += vw * vw;
    qb += vb * vb;
  }
  __shared__ acc_t shared[32];
  qw = block_sum(qw, shared);  // (every thread of the block reaches both sums: with_w is the same for all)
  qb = block_sum(qb, shared);
  if (threadIdx.x == 0) {
    if (with_w) norms[b * b_stride] = qw;
    norms[(with_w ? row_stride : 0) + b * b_stride] = qb;
  }
}

// GroupNorm, one block per (example b, channel c) over the S positions of x, d (B, C, S) contiguous:
// pw[b, c] = Σ_s d (x − μ_{b,g}) r_{b,g}, pb[b, c] = Σ_s d, g = c / (C / G).
template <typename scalar_t, typename acc_t>
__global__ void groupnorm_per_example_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ d,
                                             const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
                                             acc_t* __restrict__ pw, acc_t* __restrict__ pb, int64_t C,
                                             int64_t S, int64_t G) {
  const int64_t row = blockIdx.x, b = row / C, c = row % C, g = b * G + c / (C / G);
  const acc_t mu = mean[g], r = rstd[g];
  const scalar_t *rx = x + row * S, *rd = d + row * S;
  acc_t sw = 0, sb = 0;
  for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
    const acc_t dv = static_cast<acc_t>(rd[s]);
    sw += dv * (static_cast<acc_t>(rx[s]) - mu) * r;
    sb += dv;
  }
  __shared__ acc_t shared[32];
  sw = block_sum(sw, shared);
  sb = block_sum(sb, shared);
  if (threadIdx.x == 0) {
    pw[row] = sw;
    pb[row] = sb;
  }
}

// gw, gb (D,) from the partials, norms rows written.
std::tuple<at::Tensor, at::Tensor> finish(const at::Tensor& pw, const at::Tensor& pb, at::Tensor& norms) {
  const int64_t S = pw.size(0), B = pw.size(1), D = pw.size(2);
  auto gw = at::empty({D}, pw.options()), gb = at::empty({D}, pw.options());
  const int64_t col_blocks = (D + kThreads - 1) / kThreads;
  if (col_blocks + B == 0) return {gw, gb};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(pw.scalar_type(), "affine_finish_cuda", [&] {
    affine_finish_kernel<scalar_t><<<col_blocks + B, kThreads, 0, stream>>>(
        pw.data_ptr<scalar_t>(), pb.data_ptr<scalar_t>(), gw.data_ptr<scalar_t>(), gb.data_ptr<scalar_t>(),
        norms.data_ptr<scalar_t>(), S, B, D, col_blocks, norms.stride(0), norms.stride(1), true);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gw, gb};
}

}  // namespace

at::Tensor batch_sum_norms_cuda(const at::Tensor& x_in, at::Tensor& norms) {
  check_batch_sum_args(x_in, norms);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), D = x.size(1);
  auto gb = at::empty({D}, x.options());
  const int64_t col_blocks = (D + kThreads - 1) / kThreads;
  if (col_blocks + B == 0) return gb;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_sum_norms_cuda", [&] {
    affine_finish_kernel<scalar_t><<<col_blocks + B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        nullptr, x.data_ptr<scalar_t>(), nullptr, gb.data_ptr<scalar_t>(), norms.data_ptr<scalar_t>(), 1, B, D,
        col_blocks, 0, norms.stride(0), false);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return gb;
}

std::tuple<at::Tensor, at::Tensor> layernorm_affine_norms_cuda(const at::Tensor& x, const at::Tensor& d,
                                                               const at::Tensor& mean, const at::Tensor& rstd,
                                                               at::Tensor& norms) {
  check_layernorm_args(x, d, mean, rstd);
  check_norms_buffer("layernorm_affine_norms", x, norms);
  c10::cuda::CUDAGuard guard(x.device());
  auto [pw, pb] = cuda::layernorm_partials(x, d, mean, rstd);
  return finish(pw, pb, norms);
}

std::tuple<at::Tensor, at::Tensor> groupnorm_affine_norms_cuda(const at::Tensor& x_in, const at::Tensor& d_in,
                                                               const at::Tensor& mean_in, const at::Tensor& rstd_in,
                                                               int64_t groups, at::Tensor& norms) {
  check_groupnorm_args(x_in, d_in, mean_in, rstd_in, groups);
  check_norms_buffer("groupnorm_affine_norms", x_in, norms);
  c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous(), d = d_in.contiguous(), mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), C = x.size(1), S = spatial_size(x);   // (B, C, S) rows, S contiguous
  const auto acc = acc_type(x.scalar_type());
  auto pw = at::empty({1, B, C}, x.options().dtype(acc)), pb = at::empty_like(pw);
  if (B * C > 0) {  // (S = 0: the blocks sum nothing and write zeros)
    // a warp for the smallest maps (ResNet-18's last stage has S = 4), up to kThreads
    const int threads = S >= kThreads ? kThreads : static_cast<int>(std::max<int64_t>(32, (S + 31) / 32 * 32));
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "groupnorm_per_example_cuda", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      groupnorm_per_example_kernel<scalar_t, acc_t><<<B * C, threads, 0, stream>>>(
          x.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(),
          pw.data_ptr<acc_t>(), pb.data_ptr<acc_t>(), C, S, groups);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return finish(pw, pb, norms);
}

}  // namespace elasticlab
