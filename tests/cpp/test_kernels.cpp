// C++ check of the CPU kernels against ATen's own arithmetic (built by CMakeLists.txt, run by ctest).
#include <cstdio>
#include <ATen/ATen.h>
#include "ops.h"

int main() {
  at::manual_seed(0);
  auto x = at::randn({7, 3, 5}, at::kDouble);
  auto got = elasticlab::row_sq_norms_cpu(x);
  auto want = x.pow(2).sum({1, 2});
  if (!at::allclose(got, want, 1e-12, 1e-12)) {
    std::fprintf(stderr, "row_sq_norms_cpu mismatch\n");
    return 1;
  }
  std::printf("test_kernels: ok\n");
  return 0;
}
