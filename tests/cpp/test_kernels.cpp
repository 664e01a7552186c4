// C++ check of the CPU kernels against ATen's own arithmetic (built by CMakeLists.txt, run by ctest).
#include <cstdio>
#include <limits>
#include <ATen/ATen.h>
#include "ops.h"

static int fail(const char* what) {
  std::fprintf(stderr, "%s mismatch\n", what);
  return 1;
}

int main() {
  at::manual_seed(0);
  auto x = at::randn({7, 3, 5}, at::kDouble);
  if (!at::allclose(elasticlab::row_sq_norms_cpu(x), x.pow(2).sum({1, 2}), 1e-12, 1e-12)) return fail("row_sq_norms");

  // 2-D Linear: the product of norms, both rows of a (2, B) buffer.
  {
    auto a2 = at::randn({6, 11}, at::kDouble), d2 = at::randn({6, 3}, at::kDouble);
    auto out = at::empty({2, 6}, at::kDouble);
    elasticlab::product_norms_out_cpu(a2, d2, out);
    auto d_sq = d2.pow(2).sum(1);
    if (!at::allclose(out[1], d_sq, 1e-12, 1e-12) || !at::allclose(out[0], a2.pow(2).sum(1) * d_sq, 1e-12, 1e-12))
      return fail("product_norms");
    auto out2 = at::empty({2, 6}, at::kDouble);
    auto gb = elasticlab::product_bias_norms_cpu(a2, d2, out2);
    if (!at::allclose(out2, out, 1e-12, 1e-12) || !at::allclose(gb, d2.sum(0), 1e-12, 1e-12))
      return fail("product_bias_norms");
    auto row = at::full({2, 6}, std::numeric_limits<double>::quiet_NaN(), at::kDouble).select(0, 1);
    auto sum = elasticlab::batch_sum_norms_cpu(d2, row);
    if (!at::allclose(sum, d2.sum(0), 1e-12, 1e-12) || !at::allclose(row, d_sq, 1e-12, 1e-12))
      return fail("batch_sum_norms");
  }

  // Sequence Linear: per-example G_b = d_b^T a_b; Gram form = outer form = explicit, and the fused grad.
  auto a = at::randn({5, 70, 9}, at::kDouble), d = at::randn({5, 70, 4}, at::kDouble);
  auto G = at::bmm(d.transpose(1, 2), a);
  auto want = G.pow(2).sum({1, 2});
  if (!at::allclose(elasticlab::seq_linear_gram_norms_cpu(a, d), want, 1e-10, 1e-10)) return fail("gram");
  auto [n, g] = elasticlab::seq_linear_outer_norms_cpu(a, d, true);
  if (!at::allclose(n, want, 1e-10, 1e-10)) return fail("outer norms");
  if (!at::allclose(g, G.sum(0), 1e-10, 1e-10)) return fail("outer grad");
  {
    auto buf = at::full({2, 5}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
    auto row = buf.select(0, 0);
    auto g2 = elasticlab::seq_linear_outer_norms_out_cpu(a, d, true, row);
    if (!at::allclose(buf[0], want, 1e-10, 1e-10) || !at::allclose(g2, g, 1e-12, 1e-12) || !buf[1].isnan().all().item<bool>())
      return fail("outer norms out");
  }

  // LayerNorm per-example parameter gradients.
  auto mean = x.mean({-1}), rstd = (x.var({-1}, /*unbiased=*/false, /*keepdim=*/false) + 1e-5).rsqrt();
  auto dx = at::randn_like(x);
  auto [gw, gb] = elasticlab::layernorm_per_example_cpu(x, dx, mean, rstd);
  auto xhat = (x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1);
  if (!at::allclose(gw, (dx * xhat).sum(1), 1e-10, 1e-10) || !at::allclose(gb, dx.sum(1), 1e-10, 1e-10))
    return fail("layernorm_per_example");
  std::printf("test_kernels: ok\n");
  return 0;
}
