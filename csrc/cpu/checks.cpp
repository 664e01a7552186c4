// Argument checks shared by the CPU and CUDA kernels (errors name the offending shapes and dtypes).
#include "../ops.h"

#include <vector>

namespace elasticlab {

void check_row_sq_args(const at::Tensor& x) {
  EL_CHECK(x.dim() >= 1, "row_sq_norms: expected a tensor with a batch dimension, got a 0-d tensor");
  EL_CHECK(x.is_floating_point(), "row_sq_norms: expected a floating tensor, got ", x.scalar_type());
}

void check_row_sq_out(const at::Tensor& x, const at::Tensor& out) {
  check_row_sq_args(x);
  EL_CHECK(out.dim() == 1 && out.size(0) == x.size(0), "row_sq_norms: out must be (", x.size(0), ",), got ",
           out.sizes());
  EL_CHECK(out.scalar_type() == acc_type(x.scalar_type()), "row_sq_norms: out must be ",
           acc_type(x.scalar_type()), " for ", x.scalar_type(), " rows, got ", out.scalar_type());
  EL_CHECK(out.device() == x.device(), "row_sq_norms: out on ", out.device(), ", rows on ", x.device());
}

void check_product_args(const at::Tensor& a, const at::Tensor& d, const at::Tensor& out) {
  EL_CHECK(a.dim() == 2 && d.dim() == 2 && a.size(0) == d.size(0), "product_norms: expected a (B,Din) and d ",
           "(B,Dout), got shapes ", a.sizes(), " and ", d.sizes());
  EL_CHECK(a.scalar_type() == d.scalar_type() && a.is_floating_point(),
           "product_norms: expected a and d of one floating dtype, got ", a.scalar_type(), " and ",
           d.scalar_type());
  EL_CHECK(out.dim() == 2 && out.size(0) == 2 && out.size(1) == a.size(0), "product_norms: out must be (2, ",
           a.size(0), "), got ", out.sizes());
  EL_CHECK(out.scalar_type() == acc_type(a.scalar_type()), "product_norms: out must be ",
           acc_type(a.scalar_type()), " for ", a.scalar_type(), " rows, got ", out.scalar_type());
  EL_CHECK(a.device() == d.device() && out.device() == a.device(), "product_norms: a on ", a.device(), ", d on ",
           d.device(), ", out on ", out.device());
}

void check_seq_args(const char* op, const at::Tensor& a, const at::Tensor& d) {
  EL_CHECK(a.dim() == 3 && d.dim() == 3, op, ": expected a (B,T,Din) and d (B,T,Dout), got shapes ",
           a.sizes(), " and ", d.sizes());
  EL_CHECK(a.size(0) == d.size(0) && a.size(1) == d.size(1), op, ": a and d disagree on (B,T): ",
           a.sizes(), " vs ", d.sizes());
  EL_CHECK(a.scalar_type() == d.scalar_type(), op, ": a and d must share a dtype, got ",
           a.scalar_type(), " and ", d.scalar_type());
  EL_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble || is_reduced_float(a.scalar_type()),
           op, ": expected float64, float32, bfloat16 or float16, got ", a.scalar_type());
  EL_CHECK(a.device() == d.device(), op, ": a and d on different devices");
}

namespace {
// A normalisation layer's inputs: x and d of one floating dtype, their statistics in its accumulation dtype.
void check_stats_dtypes(const char* op, const at::Tensor& x, const at::Tensor& d, const at::Tensor& mean,
                        const at::Tensor& rstd) {
  EL_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || is_reduced_float(x.scalar_type()),
           op, ": expected float64, float32, bfloat16 or float16, got ", x.scalar_type());
  EL_CHECK(d.scalar_type() == x.scalar_type(), op, ": d must be ", x.scalar_type(), ", got ", d.scalar_type());
  for (const auto* t : {&mean, &rstd})
    EL_CHECK(t->scalar_type() == acc_type(x.scalar_type()), op, ": mean and rstd must be ",
             acc_type(x.scalar_type()), " for ", x.scalar_type(), " inputs, got ", t->scalar_type());
  for (const auto* t : {&d, &mean, &rstd})  // (a CUDA kernel would read a host pointer)
    EL_CHECK(t->device() == x.device(), op, ": x on ", x.device(), ", d, mean and rstd on ", d.device(), ", ",
             mean.device(), " and ", rstd.device());
}
}  // namespace

void check_layernorm_args(const at::Tensor& x, const at::Tensor& d, const at::Tensor& mean, const at::Tensor& rstd) {
  EL_CHECK(x.dim() == 3 && d.sizes() == x.sizes(), "layernorm_per_example: expected x and d (B,T,D), got ",
           x.sizes(), " and ", d.sizes());
  EL_CHECK(mean.dim() == 2 && rstd.dim() == 2 && mean.size(0) == x.size(0) && mean.size(1) == x.size(1) &&
               rstd.sizes() == mean.sizes(),
           "layernorm_per_example: expected mean and rstd (B,T) = ", x.sizes().slice(0, 2), ", got ",
           mean.sizes(), " and ", rstd.sizes());
  check_stats_dtypes("layernorm_per_example", x, d, mean, rstd);
}

void check_groupnorm_args(const at::Tensor& x, const at::Tensor& d, const at::Tensor& mean, const at::Tensor& rstd,
                          int64_t groups) {
  EL_CHECK(x.dim() >= 3 && d.sizes() == x.sizes(), "groupnorm_affine_norms: expected x and d (B,C,*spatial), got ",
           x.sizes(), " and ", d.sizes());
  EL_CHECK(groups >= 1 && x.size(1) % groups == 0, "groupnorm_affine_norms: ", groups,
           " groups do not divide C = ", x.size(1));
  EL_CHECK(mean.dim() == 2 && mean.size(0) == x.size(0) && mean.size(1) == groups && rstd.sizes() == mean.sizes(),
           "groupnorm_affine_norms: expected mean and rstd (B,G) = (", x.size(0), ", ", groups,
           "), got ", mean.sizes(), " and ", rstd.sizes());
  check_stats_dtypes("groupnorm_affine_norms", x, d, mean, rstd);
}

void check_norms_buffer(const char* op, const at::Tensor& x, const at::Tensor& norms) {
  EL_CHECK(norms.dim() == 2 && norms.size(0) == 2 && norms.size(1) == x.size(0), op, ": norms must be (2, ",
           x.size(0), "), got ", norms.sizes());
  EL_CHECK(norms.scalar_type() == acc_type(x.scalar_type()), op, ": norms must be ", acc_type(x.scalar_type()),
           " for ", x.scalar_type(), " inputs, got ", norms.scalar_type());
  EL_CHECK(norms.device() == x.device(), op, ": norms on ", norms.device(), ", inputs on ", x.device());
}

void check_batch_sum_args(const at::Tensor& x, const at::Tensor& norms) {
  EL_CHECK(x.dim() == 2, "batch_sum_norms: expected per-example gradients x (B, D), got shape ",
           x.sizes());
  EL_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
           "batch_sum_norms: expected float32 or float64 x (the accumulation dtype), got ", x.scalar_type());
  check_norms_row("batch_sum_norms", x, norms);
}

void check_norms_row(const char* op, const at::Tensor& x, const at::Tensor& norms) {
  EL_CHECK(norms.dim() == 1 && norms.size(0) == x.size(0), op, ": norms must be (", x.size(0), "), got ",
           norms.sizes());
  EL_CHECK(norms.scalar_type() == acc_type(x.scalar_type()), op, ": norms must be ", acc_type(x.scalar_type()),
           " for ", x.scalar_type(), " inputs, got ", norms.scalar_type());
  EL_CHECK(norms.device() == x.device(), op, ": norms on ", norms.device(), ", inputs on ", x.device());
}

PatchGeometry check_patches_args(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation) {
  EL_CHECK(x.dim() == 3 || x.dim() == 4, "conv_patches: expected a batched Conv1d/Conv2d input (B, C, [H,] W), ",
           "got shape ", x.sizes());
  const int64_t nd = x.dim() - 2;
  EL_CHECK(static_cast<int64_t>(kernel.size()) == nd && static_cast<int64_t>(stride.size()) == nd &&
               static_cast<int64_t>(padding.size()) == nd && static_cast<int64_t>(dilation.size()) == nd,
           "conv_patches: kernel, stride, padding and dilation need ", nd, " entries for an input of shape ",
           x.sizes(), ", got ", kernel, ", ", stride, ", ", padding, ", ", dilation);
  EL_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || is_reduced_float(x.scalar_type()),
           "conv_patches: expected float64, float32, bfloat16 or float16, got ", x.scalar_type());
  std::vector<int64_t> out(nd);
  for (int64_t i = 0; i < nd; ++i) {
    EL_CHECK(kernel[i] >= 1 && stride[i] >= 1 && dilation[i] >= 1 && padding[i] >= 0,
             "conv_patches: kernel, stride and dilation must be positive and padding non-negative, got kernel ",
             kernel, ", stride ", stride, ", padding ", padding, ", dilation ", dilation);
    const int64_t span = dilation[i] * (kernel[i] - 1) + 1, padded = x.size(2 + i) + 2 * padding[i];
    EL_CHECK(padded >= span, "conv_patches: the kernel spans ", span, " positions along spatial dimension ", i,
             " but the padded input has ", padded, " (input shape ", x.sizes(), ", padding ", padding, ")");
    out[i] = (padded - span) / stride[i] + 1;
  }
  // Conv1d as a Conv2d of height 1
  const bool two = nd == 2;
  return {x.size(0), x.size(1), two ? x.size(2) : 1, x.size(-1), two ? out[0] : 1, out[nd - 1],
          two ? kernel[0] : 1, kernel[nd - 1], two ? stride[0] : 1, stride[nd - 1],
          two ? padding[0] : 0, padding[nd - 1], two ? dilation[0] : 1, dilation[nd - 1],
          x.stride(0), x.stride(1), two ? x.stride(2) : 0, x.stride(-1)};
}

}  // namespace elasticlab
