// One pass over c per-example products G_b (c, n): partial squared norms per (example, block) and, when asked,
// the gradient grad = (grad +) sum_b G_b, accumulated in registers. Reads each product once, vectorised.
//
// The grid is 2-D: blockIdx.x takes a slice of the n elements, blockIdx.y a group of consecutive examples,
// so that many small products (a convolution's, 64x576 elements per example over 128 examples) still fill
// the GPU. A block reduces each example's part warp by warp (shuffles, no block barrier per example) into
// shared memory and writes its (example, slice) partials once at the end. With several groups each writes
// its sum of products into its own row of a float scratch, which the host sums (no atomics: the result
// does not depend on the schedule).
#pragma once
#include <ATen/ATen.h>
#include <cstdint>

namespace elasticlab {
namespace cuda {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

constexpr int kFoldWarps = 8;        // 256 threads per block
constexpr int kFoldMaxGroup = 128;   // examples per group at most (shared memory: warps x group accumulators)

// Block (x, y) owns vectors [x*R*blockDim, (x+1)*R*blockDim) of the products of examples
// [y*group, min(c, (y+1)*group)); partial[b, x] gets its part of |G_b|^2, and, when grad is set,
// grad[y*n + i] (the group's row) gets (accumulate ? itself : 0) + the group's sum of G_b[i].
// V elements per vector (n % V == 0), R vectors per thread.
template <typename g_t, typename acc_t, int V, int R>
__global__ void __launch_bounds__(kFoldWarps * 32)
fold_products_kernel(const g_t* __restrict__ G, int64_t c, int64_t n, int64_t group,
                     acc_t* __restrict__ partial, acc_t* __restrict__ grad, bool accumulate) {
  __shared__ acc_t red[kFoldWarps][kFoldMaxGroup];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nv = n / V;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * R * blockDim.x + threadIdx.x;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * group;
  const int64_t nb = (c - b0) < group ? (c - b0) : group;
  acc_t gs[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < V; ++v) gs[r][v] = acc_t(0);
  for (int64_t j = 0; j < nb; ++j) {
    const g_t* Gb = G + (b0 + j) * n;
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
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) red[warp][j] = s;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) {
    acc_t s = 0;
#pragma unroll
    for (int w = 0; w < kFoldWarps; ++w) s += red[w][j];
    partial[(b0 + j) * gridDim.x + blockIdx.x] = s;
  }
  if (grad == nullptr) return;
  acc_t* row = grad + static_cast<int64_t>(blockIdx.y) * n;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t vi = base + static_cast<int64_t>(r) * blockDim.x;
    if (vi < nv) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        acc_t* p = row + vi * V + v;
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
