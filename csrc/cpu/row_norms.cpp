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
  if (x.size(0) == 0) return x.reshape({0, 0});  // (no -1 to infer from zero elements)
  return x.contiguous().view({x.size(0), -1});
}
// out[0, b] = |a_b|^2 |d_b|^2, out[1, b] = |d_b|^2 for contiguous a (B, Din), d (B, Dout) of one dtype.
void product_into(const at::Tensor& a, const at::Tensor& d, at::Tensor& out) {
  const int64_t B = a.size(0), Din = a.size(1), Dout = d.size(1), sr = out.stride(0), sb = out.stride(1);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "product_norms_cpu", [&] {
    const scalar_t *pa = a.data_ptr<scalar_t>(), *pd = d.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(Din + Dout, 1));
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const double sd = cpu::sq_sum(pd + b * Dout, Dout);
        po[b * sb] = static_cast<scalar_t>(cpu::sq_sum(pa + b * Din, Din) * sd);
        po[sr + b * sb] = static_cast<scalar_t>(sd);
      }
    });
  });
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

at::Tensor& product_norms_out_cpu(const at::Tensor& a, const at::Tensor& d, at::Tensor& out) {
  check_product_args(a, d, out);
  product_into(rows_of(a), rows_of(d), out);
  return out;
}

at::Tensor product_bias_norms_cpu(const at::Tensor& a, const at::Tensor& d, at::Tensor& out) {
  check_product_args(a, d, out);
  product_into(rows_of(a), rows_of(d), out);
  return d.sum({0}, false, acc_type(d.scalar_type()));
}

at::Tensor batch_sum_norms_cpu(const at::Tensor& x, at::Tensor& norms) {
  check_batch_sum_args(x, norms);
  row_sq_into(rows_of(x), norms);
  return x.sum({0});
}

}  // namespace elasticlab
