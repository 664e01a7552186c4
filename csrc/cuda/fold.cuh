// One pass over c per-example products G_b (c, n): partial squared norms per (example, block) and, when asked,
// the gradient grad = (grad +) sum_b G_b, accumulated in registers. Reads each product once, vectorised.
#pragma once
#include <ATen/ATen.h>
#include <cstdint>

namespace elasticlab {
namespace cuda {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Sum over the block (blockDim.x a multiple of 32, at most 1024); the result is valid in thread 0.
template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t s, acc_t* red) {
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < (blockDim.x >> 5) ? red[lane] : acc_t(0);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
  }
  __syncthreads();
  return s;
}

// Block x owns vectors [x*R*blockDim, (x+1)*R*blockDim) of each example's product; partial[b, x] gets its
// part of |G_b|^2. V elements per vector (n % V == 0), R vectors per thread.
template <typename g_t, typename acc_t, int V, int R>
__global__ void fold_products_kernel(const g_t* __restrict__ G, int64_t c, int64_t n, acc_t* __restrict__ partial,
                                     acc_t* __restrict__ grad, bool accumulate) {
  __shared__ acc_t red[32];
  const int64_t nv = n / V;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * R * blockDim.x + threadIdx.x;
  acc_t gs[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < V; ++v) gs[r][v] = acc_t(0);
  for (int64_t b = 0; b < c; ++b) {
    const g_t* Gb = G + b * n;
    acc_t s = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t vi = base + static_cast<int64_t>(r) * blockDim.x;
      if (vi < nv) {
        const Vec<g_t, V> val = *reinterpret_cast<const Vec<g_t, V>*>(Gb + vi * V);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const acc_t x = static_cast<acc_t>(val.v[v]);
          s += x * x;
          gs[r][v] += x;
        }
      }
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) partial[b * gridDim.x + blockIdx.x] = s;
  }
  if (grad == nullptr) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t vi = base + static_cast<int64_t>(r) * blockDim.x;
    if (vi < nv) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        acc_t* p = grad + vi * V + v;
        *p = accumulate ? *p + gs[r][v] : gs[r][v];
      }
    }
  }
}

// Launches the fold over G (c, n) (any floating dtype, contiguous): writes |G_b|^2 into norms (c,) of acc
// dtype and, when grad is defined, grad (n,) = (accumulate ? grad : 0) + sum_b G_b.
void fold_products(const at::Tensor& G, at::Tensor norms, at::Tensor grad, bool accumulate);

}  // namespace cuda
}  // namespace elasticlab
