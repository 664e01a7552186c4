// CPU per-example LayerNorm parameter gradients (Gray et al. 2024): one pass over x and d per example,
// recomputing x_hat = (x - mean) * rstd on the fly. Parallel over (example, column block).
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>

namespace elasticlab {

std::tuple<at::Tensor, at::Tensor> layernorm_per_example_cpu(const at::Tensor& x_in, const at::Tensor& d_in,
                                                             const at::Tensor& mean_in, const at::Tensor& rstd_in) {
  check_layernorm_args(x_in, d_in, mean_in, rstd_in);
  if (is_reduced_float(x_in.scalar_type()))                // accumulate half inputs in float32
    return layernorm_per_example_cpu(x_in.to(at::kFloat), d_in.to(at::kFloat), mean_in, rstd_in);
  auto x = x_in.contiguous(), d = d_in.contiguous(), mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  auto gw = at::zeros({B, D}, x.options()), gb = at::zeros({B, D}, x.options());
  if (B == 0 || D == 0) return {gw, gb};
  const int64_t CB = 256;                                  // columns per task
  const int64_t ncb = (D + CB - 1) / CB;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "layernorm_per_example_cpu", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pd = d.data_ptr<scalar_t>();
    const scalar_t *pm = mean.data_ptr<scalar_t>(), *pr = rstd.data_ptr<scalar_t>();
    scalar_t *pw = gw.data_ptr<scalar_t>(), *pb = gb.data_ptr<scalar_t>();
    at::parallel_for(0, B * ncb, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t b = k / ncb, c0 = (k % ncb) * CB, c1 = std::min(D, c0 + CB);
        scalar_t* w = pw + b * D;
        scalar_t* bb = pb + b * D;
        for (int64_t t = 0; t < T; ++t) {
          const scalar_t* xr = px + (b * T + t) * D;
          const scalar_t* dr = pd + (b * T + t) * D;
          const scalar_t m = pm[b * T + t], r = pr[b * T + t];
          for (int64_t j = c0; j < c1; ++j) {
            w[j] += dr[j] * (xr[j] - m) * r;
            bb[j] += dr[j];
          }
        }
      }
    });
  });
  return {gw, gb};
}

}  // namespace elasticlab
