// CPU (OpenMP through at::parallel_for) per-row squared norms, SIMD within chunks and double across them.
#include "../ops.h"
#include "reduce.h"
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>

namespace elasticlab {

namespace {
// out[b * stride] = |x_b|^2 for x (B, D) contiguous, float or double (half inputs are upcast first).
void row_sq_into(const at::Tensor& x, at::Tensor& out) {
  const int64_t B = x.size(0), D = x.size(1), so = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_sq_norms_cpu", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, B, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        po[b * so] = static_cast<scalar_t>(cpu::sq_sum(px + b * D, D));
      }
    });
  });
}

// Half precision: the SIMD reductions work on float (this path is for CPU tests; GPUs read halves natively).
at::Tensor rows_of(const at::Tensor& x_in) {
  const at::Tensor x = is_reduced_float(x_in.scalar_type()) ? x_in.to(at::kFloat) : x_in;
  return x.contiguous().view({x.size(0), -1});
}
}  // namespace

at::Tensor row_sq_norms_cpu(const at::Tensor& x_in) {
  check_row_sq_args(x_in);
  const at::Tensor x = rows_of(x_in);
  auto out = at::empty({x.size(0)}, x.options());
  row_sq_into(x, out);
  return out;
}

at::Tensor& row_sq_norms_out_cpu(const at::Tensor& x_in, at::Tensor& out) {
  check_row_sq_out(x_in, out);
  row_sq_into(rows_of(x_in), out);
  return out;
}

}  // namespace elasticlab
