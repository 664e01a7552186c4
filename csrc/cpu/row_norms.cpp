// CPU (OpenMP through at::parallel_for) per-row squared norms, SIMD within chunks and double across them.
#include "../ops.h"
#include "reduce.h"
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>

namespace elasticlab {

at::Tensor row_sq_norms_cpu(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1, "row_sq_norms: expected a tensor with a batch dimension, got a 0-d tensor");
  TORCH_CHECK(x_in.is_floating_point(), "row_sq_norms: expected a floating tensor, got ", x_in.scalar_type());
  // Half precision: the SIMD reductions work on float (this path is for CPU tests; GPUs read halves natively).
  if (is_reduced_float(x_in.scalar_type())) return row_sq_norms_cpu(x_in.to(at::kFloat));
  const int64_t B = x_in.size(0);
  auto x = x_in.contiguous().view({B, -1});
  const int64_t D = x.size(1);
  auto out = at::empty({B}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_sq_norms_cpu", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        po[b] = static_cast<scalar_t>(cpu::sq_sum(px + b * D, D));
      }
    });
  });
  return out;
}

}  // namespace elasticlab
