// Vectorised reductions shared by the CPU kernels. Sums run in the input's precision inside chunks of
// kChunk elements (SIMD lanes via `omp simd`, so the compiler may reorder them) and in double across
// chunks: float32 inputs keep ~1e-7 relative accuracy without a serial double dependency chain per element.
#pragma once
#include <algorithm>
#include <cstdint>

namespace elasticlab {
namespace cpu {

constexpr int64_t kChunk = 2048;

// sum_i a[i] * b[i]
template <typename T>
inline double dot(const T* a, const T* b, int64_t n) {
  double total = 0.0;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c; i < e; ++i) s += a[i] * b[i];
    total += static_cast<double>(s);
  }
  return total;
}

// sum_i x[i]^2
template <typename T>
inline double sq_sum(const T* x, int64_t n) {
  return dot(x, x, n);
}

// acc[i] += g[i] for all i, and returns sum_i g[i]^2 (one pass over g).
template <typename T>
inline double add_and_sq_sum(const T* g, T* acc, int64_t n) {
  double total = 0.0;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c; i < e; ++i) {
      s += g[i] * g[i];
      acc[i] += g[i];
    }
    total += static_cast<double>(s);
  }
  return total;
}

}  // namespace cpu
}  // namespace elasticlab
