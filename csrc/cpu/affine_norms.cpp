// CPU normalisation-layer affine gradients with their per-example norms (see ops.h): the per-example
// gradients, their batch sums and their row norms written into the caller's (2, B) buffer. On the CPU these
// compose the kernels (launches cost nothing here); csrc/cuda/affine_norms.cu fuses them into two launches.
#include "../ops.h"

namespace elasticlab {

namespace {
// gw, gb = batch sums of pw, pb; norms rows 0 and 1 their per-example squared norms.
std::tuple<at::Tensor, at::Tensor> finish(const at::Tensor& pw, const at::Tensor& pb, at::Tensor& norms) {
  at::Tensor r0 = norms.select(0, 0), r1 = norms.select(0, 1);
  row_sq_norms_out_cpu(pw, r0);
  row_sq_norms_out_cpu(pb, r1);
  return {pw.sum(0), pb.sum(0)};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> layernorm_affine_norms_cpu(const at::Tensor& x, const at::Tensor& d,
                                                              const at::Tensor& mean, const at::Tensor& rstd,
                                                              at::Tensor& norms) {
  check_layernorm_args(x, d, mean, rstd);
  check_norms_buffer("layernorm_affine_norms", x, norms);
  auto [pw, pb] = layernorm_per_example_cpu(x, d, mean, rstd);
  return finish(pw, pb, norms);
}

std::tuple<at::Tensor, at::Tensor> groupnorm_affine_norms_cpu(const at::Tensor& x_in, const at::Tensor& d_in,
                                                              const at::Tensor& mean, const at::Tensor& rstd,
                                                              int64_t groups, at::Tensor& norms) {
  check_groupnorm_args(x_in, d_in, mean, rstd, groups);
  check_norms_buffer("groupnorm_affine_norms", x_in, norms);
  const auto acc = acc_type(x_in.scalar_type());
  const int64_t B = x_in.size(0), C = x_in.size(1), S = spatial_size(x_in);
  const at::Tensor x = x_in.to(acc).reshape({B, C, S}), d = d_in.to(acc).reshape({B, C, S});
  // x_hat per (example, group): the group's channels and positions share its statistics
  at::Tensor xg = x.reshape({B, groups, C / groups * S});
  at::Tensor xhat = ((xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape({B, C, S});
  return finish((d * xhat).sum(-1), d.sum(-1), norms);
}

}  // namespace elasticlab
