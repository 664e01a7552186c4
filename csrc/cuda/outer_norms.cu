// CUDA outer-product per-example norms fused with the weight gradient. Block (tile of Dout x Din, 64x64)
// loops over the examples: it forms its tile of G_b = d_b^T a_b in registers (4x4 per thread, operands
// staged through shared memory), adds it into a register accumulator of the weight gradient and reduces
// its squared norm into norms[b]; when tiles are few, the examples are split over gridDim.z and the
// gradient tiles are added atomically. Per-example gradients never reach global memory.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>

namespace elasticlab {
namespace {

constexpr int TM = 64, TN = 64, TK = 16;   // tile rows (Dout), cols (Din), reduction chunk (T)

template <typename scalar_t, typename acc_t>
__global__ void outer_norms_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ d,
                                   acc_t* __restrict__ norms, scalar_t* __restrict__ grad, int64_t B, int64_t T,
                                   int64_t Din, int64_t Dout) {
  __shared__ acc_t sd[TK][TM], sa[TK][TN];
  __shared__ acc_t red[8];
  const int tid = threadIdx.x;                  // 256 threads: 16 x 16, each a 4x4 micro-tile
  const int tr = tid / 16, tc = tid % 16;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * TM, c0 = static_cast<int64_t>(blockIdx.x) * TN;
  acc_t gacc[4][4] = {};
  for (int64_t b = blockIdx.z; b < B; b += gridDim.z) {   // examples split across gridDim.z blocks
    const scalar_t* db = d + b * T * Dout;
    const scalar_t* ab = a + b * T * Din;
    acc_t g[4][4] = {};
    for (int64_t t0 = 0; t0 < T; t0 += TK) {
      for (int e = tid; e < TK * TM; e += 256) {
        const int k = e / TM, m = e % TM;
        const int64_t t = t0 + k, r = r0 + m, c = c0 + m;
        sd[k][m] = (t < T && r < Dout) ? static_cast<acc_t>(db[t * Dout + r]) : acc_t(0);
        sa[k][m] = (t < T && c < Din) ? static_cast<acc_t>(ab[t * Din + c]) : acc_t(0);
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < TK; ++k) {
        acc_t dv[4], av[4];
        for (int i = 0; i < 4; ++i) dv[i] = sd[k][tr * 4 + i];
        for (int j = 0; j < 4; ++j) av[j] = sa[k][tc * 4 + j];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) g[i][j] += dv[i] * av[j];
      }
      __syncthreads();
    }
    acc_t s = 0;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        s += g[i][j] * g[i][j];            // padding rows/columns are zero
        gacc[i][j] += g[i][j];
      }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
    if ((tid & 31) == 0) red[tid >> 5] = s;
    __syncthreads();
    if (tid == 0) {
      acc_t tot = 0;
      for (int w = 0; w < 8; ++w) tot += red[w];
      atomicAdd(norms + b, tot);
    }
    __syncthreads();
  }
  if (grad != nullptr)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int64_t r = r0 + tr * 4 + i, c = c0 + tc * 4 + j;
        if (r < Dout && c < Din) atomicAdd(grad + r * Din + c, static_cast<scalar_t>(gacc[i][j]));
      }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cuda(const at::Tensor& a_in, const at::Tensor& d_in,
                                                               bool with_grad) {
  check_seq_args("seq_linear_outer_norms", a_in, d_in);
  c10::cuda::CUDAGuard guard(a_in.device());
  auto a = a_in.contiguous(), d = d_in.contiguous();
  const int64_t B = a.size(0), T = a.size(1), Din = a.size(2), Dout = d.size(2);
  const bool dbl = a.scalar_type() == at::kDouble;
  auto acc = at::zeros({B}, a.options().dtype(dbl ? at::kDouble : at::kFloat));
  auto grad = with_grad ? at::zeros({Dout, Din}, a.options()) : at::empty({0}, a.options());
  if (B == 0 || Din == 0 || Dout == 0) return {acc.to(a.scalar_type()), grad};
  const int64_t gy = (Dout + TM - 1) / TM;
  TORCH_CHECK(gy <= 65535, "seq_linear_outer_norms: Dout too large for the CUDA grid (", Dout, ")");
  // Enough blocks for two waves over the SMs: split the examples when the tiles alone are too few.
  const int64_t tiles = gy * ((Din + TN - 1) / TN);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t split = std::min<int64_t>({B, std::max<int64_t>(1, (2 * sms + tiles - 1) / tiles), 65535});
  dim3 grid((Din + TN - 1) / TN, gy, split);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "seq_linear_outer_norms_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    outer_norms_kernel<scalar_t, acc_t><<<grid, 256, 0, stream>>>(
        a.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(), acc.data_ptr<acc_t>(),
        with_grad ? grad.data_ptr<scalar_t>() : nullptr, B, T, Din, Dout);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {acc.scalar_type() == a.scalar_type() ? acc : acc.to(a.scalar_type()), grad};
}

}  // namespace elasticlab
