// Shared by the fused layers' C++ autograd functions (csrc/autograd/*.cpp): the elasticlab kernels called
// through the dispatcher, casts, and the write of a norm into the caller's (2, B) buffer.
//
// Each fused layer is an operator (linear_norms, conv_norms, layer_norm_norms, group_norm_norms) whose
// Autograd-key kernel is a torch::autograd::Function: forward like the module, backward forming the input
// gradient, the parameter gradients and the per-example squared norms in one pass, with no Python on the
// backward path. The Python rules (elasticlab/gns/layers/) choose the form per layer and pass the `norms`
// buffer, (2, B) in float32 (float64 for float64 inputs), row 0 the weight's, row 1 the bias'; the backward
// writes each row once the gradients exist, and a row it does not reach keeps its NaN. The operators are
// eager-only: under torch.compile the rules use their Python autograd.Functions.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "../ops.h"

namespace elasticlab {
namespace fused {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The elasticlab operators, called through the dispatcher (CPU or CUDA kernel by the tensors' device).
inline at::Tensor row_sq(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::row_sq_norms", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

inline at::Tensor gram_norms(const at::Tensor& a, const at::Tensor& d) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::seq_linear_gram_norms", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, d);
}

inline std::tuple<at::Tensor, at::Tensor> outer_norms(const at::Tensor& a, const at::Tensor& d) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::seq_linear_outer_norms", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(a, d, true);
}

inline at::Tensor patches(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::conv_patches", "")
                       .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                         at::IntArrayRef)>();
  return op.call(x, kernel, stride, padding, dilation);
}

// Affine gradients (batch sums) of a LayerNorm / GroupNorm with the per-example norms written into `norms`.
inline std::tuple<at::Tensor, at::Tensor> layernorm_affine(const at::Tensor& x, const at::Tensor& d,
                                                           const at::Tensor& mean, const at::Tensor& rstd,
                                                           const at::Tensor& norms) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::layernorm_affine_norms", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  at::Tensor out = norms;
  return op.call(x, d, mean, rstd, out);
}

inline std::tuple<at::Tensor, at::Tensor> groupnorm_affine(const at::Tensor& x, const at::Tensor& d,
                                                           const at::Tensor& mean, const at::Tensor& rstd,
                                                           int64_t groups, const at::Tensor& norms) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::groupnorm_affine_norms", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&, int64_t,
                                                                 at::Tensor&)>();
  at::Tensor out = norms;
  return op.call(x, d, mean, rstd, groups, out);
}

inline at::Tensor cast(const at::Tensor& t, at::ScalarType dtype) {
  return (!t.defined() || t.scalar_type() == dtype) ? t : t.to(dtype);
}

// Writes `value` into row `row` of the caller's norms buffer.
inline void put(const at::Tensor& norms, int64_t row, const at::Tensor& value) { norms.select(0, row).copy_(value); }

// Writes |x_b|^2 into row `row` of the caller's norms buffer: one kernel, no temporary and copy, when the
// buffer has the rows' accumulation dtype (as the Python rules allocate it), else through a temporary.
inline void put_row_sq(const at::Tensor& norms, int64_t row, const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::row_sq_norms", "out")
                       .typed<at::Tensor&(const at::Tensor&, at::Tensor&)>();
  at::Tensor r = norms.select(0, row);
  if (r.scalar_type() == acc_type(x.scalar_type()) && r.device() == x.device()) {
    op.call(x, r);
  } else {
    put(norms, row, row_sq(x));
  }
}

// Writes the product of norms of a Linear layer on 2-D inputs into the caller's buffer: row 0 |a_b|^2 |d_b|^2,
// row 1 |d_b|^2 (one kernel), or, for a buffer of another dtype, through temporaries.
inline void put_products(const at::Tensor& norms, const at::Tensor& a, const at::Tensor& d) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::product_norms", "out")
                       .typed<at::Tensor&(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  if (norms.scalar_type() == acc_type(a.scalar_type()) && norms.device() == a.device()) {
    at::Tensor out = norms;
    op.call(a, d, out);
  } else {
    at::Tensor d_sq = row_sq(d);
    put(norms, 1, d_sq);
    put(norms, 0, row_sq(a) * d_sq);
  }
}

// put_products and the bias gradient sum_b d_b (in acc_type) together: one kernel for a buffer of the rows'
// accumulation dtype, else put_products and a sum.
inline at::Tensor put_products_bias(const at::Tensor& norms, const at::Tensor& a, const at::Tensor& d) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::product_bias_norms", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  if (norms.scalar_type() == acc_type(a.scalar_type()) && norms.device() == a.device()) {
    at::Tensor out = norms;
    return op.call(a, d, out);
  }
  put_products(norms, a, d);
  return d.sum({0}, false, acc_type(d.scalar_type()));
}

// Σ_b x_b of per-example gradients x (B, D) in acc_type (a bias'), |x_b|^2 written into row `row` of the
// caller's buffer: one kernel for a buffer of x's dtype, else a sum and put_row_sq.
inline at::Tensor put_batch_sum(const at::Tensor& norms, int64_t row, const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::batch_sum_norms", "")
                       .typed<at::Tensor(const at::Tensor&, at::Tensor&)>();
  at::Tensor r = norms.select(0, row);
  if (r.scalar_type() == x.scalar_type() && r.device() == x.device()) return op.call(x, r);
  put_row_sq(norms, row, x);
  return x.sum({0});
}

// The outer form's gradient, its norms written into row `row` of the caller's buffer (no temporary and copy
// when the buffer has the norms' dtype, as the Python rules allocate it).
inline at::Tensor outer_norms_into(const at::Tensor& a, const at::Tensor& d, const at::Tensor& norms, int64_t row) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("elasticlab::seq_linear_outer_norms", "out")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool, at::Tensor&)>();
  at::Tensor r = norms.select(0, row);
  if (r.scalar_type() == acc_type(a.scalar_type()) && r.device() == a.device()) return op.call(a, d, true, r);
  auto [n, grad] = outer_norms(a, d);
  put(norms, row, n);
  return grad;
}

}  // namespace fused
}  // namespace elasticlab
