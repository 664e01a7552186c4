// CUDA Gram-form per-example norms: block (b, i, j), j >= i, computes the 32x32 tiles (i, j) of both T x T
// Gram matrices through shared memory, multiplies them elementwise and adds the (doubly weighted off the
// diagonal) sum into out[b]. No (B,T,T) tensor is formed.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace elasticlab {
namespace {

constexpr int TILE = 32;   // Gram tile; threads (32, 8), each computes 4 rows of a column.

template <typename scalar_t, typename acc_t>
__device__ void gram_tile(const scalar_t* __restrict__ X, int64_t T, int64_t Dm, int64_t ti, int64_t tj,
                          acc_t (&out)[4], acc_t (*si)[TILE + 1], acc_t (*sj)[TILE + 1]) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int k = 0; k < 4; ++k) out[k] = 0;
  for (int64_t c0 = 0; c0 < Dm; c0 += TILE) {
    for (int r = ty; r < TILE; r += 8) {
      const int64_t ri = ti + r, rj = tj + r, c = c0 + tx;
      si[r][tx] = (ri < T && c < Dm) ? static_cast<acc_t>(X[ri * Dm + c]) : acc_t(0);
      sj[r][tx] = (rj < T && c < Dm) ? static_cast<acc_t>(X[rj * Dm + c]) : acc_t(0);
    }
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < TILE; ++c) {
      const acc_t v = sj[tx][c];
      for (int k = 0; k < 4; ++k) out[k] += si[ty + 8 * k][c] * v;
    }
    __syncthreads();
  }
}

template <typename scalar_t, typename acc_t>
__global__ void gram_norms_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ d,
                                  acc_t* __restrict__ out, int64_t T, int64_t Din, int64_t Dout) {
  const int64_t i = blockIdx.y, j = blockIdx.z, b = blockIdx.x;
  if (j < i) return;
  __shared__ acc_t si[TILE][TILE + 1], sj[TILE][TILE + 1];
  acc_t ga[4], gd[4];
  gram_tile<scalar_t, acc_t>(a + b * T * Din, T, Din, i * TILE, j * TILE, ga, si, sj);
  gram_tile<scalar_t, acc_t>(d + b * T * Dout, T, Dout, i * TILE, j * TILE, gd, si, sj);
  acc_t s = 0;
  for (int k = 0; k < 4; ++k) s += ga[k] * gd[k];
  if (i != j) s *= 2;
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
  __shared__ acc_t warp_sums[8];
  if (threadIdx.x == 0) warp_sums[threadIdx.y] = s;
  __syncthreads();
  if (threadIdx.y == 0 && threadIdx.x == 0) {
    acc_t tot = 0;
    for (int w = 0; w < 8; ++w) tot += warp_sums[w];
    atomicAdd(out + b, tot);
  }
}

}  // namespace

at::Tensor seq_linear_gram_norms_cuda(const at::Tensor& a_in, const at::Tensor& d_in) {
  check_seq_args("seq_linear_gram_norms", a_in, d_in);
  c10::cuda::CUDAGuard guard(a_in.device());
  auto a = a_in.contiguous(), d = d_in.contiguous();
  const int64_t B = a.size(0), T = a.size(1), Din = a.size(2), Dout = d.size(2);
  const bool dbl = a.scalar_type() == at::kDouble;
  auto acc = at::zeros({B}, a.options().dtype(dbl ? at::kDouble : at::kFloat));
  if (B == 0 || T == 0) return acc.to(a.scalar_type());
  const int64_t nt = (T + TILE - 1) / TILE;
  TORCH_CHECK(nt <= 65535, "seq_linear_gram_norms: sequence too long for the CUDA grid (T=", T, ")");
  dim3 grid(B, nt, nt), block(32, 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "seq_linear_gram_norms_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    gram_norms_kernel<scalar_t, acc_t><<<grid, block, 0, stream>>>(
        a.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), acc.data_ptr<acc_t>(), T, Din, Dout);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return acc.scalar_type() == a.scalar_type() ? acc : acc.to(a.scalar_type());
}

}  // namespace elasticlab
