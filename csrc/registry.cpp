// Operator schemas: every kernel is a torch operator, called from Python as torch.ops.elasticlab.*.
#include <torch/library.h>

TORCH_LIBRARY(elasticlab, m) {
  m.def("row_sq_norms(Tensor x) -> Tensor");
  m.def("row_sq_norms.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("product_norms.out(Tensor a, Tensor d, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("product_bias_norms(Tensor a, Tensor d, Tensor(a!) out) -> Tensor");
  m.def("batch_sum_norms(Tensor x, Tensor(a!) norms) -> Tensor");
  m.def("seq_linear_gram_norms(Tensor a, Tensor d) -> Tensor");
  m.def("seq_linear_outer_norms(Tensor a, Tensor d, bool with_grad) -> (Tensor, Tensor)");
  m.def("seq_linear_outer_norms.out(Tensor a, Tensor d, bool with_grad, *, Tensor(a!) norms) -> Tensor");
  m.def("conv_patches(Tensor x, int[] kernel, int[] stride, int[] padding, int[] dilation) -> Tensor");
  m.def("layernorm_per_example(Tensor x, Tensor d, Tensor mean, Tensor rstd) -> (Tensor, Tensor)");
  m.def("layernorm_affine_norms(Tensor x, Tensor d, Tensor mean, Tensor rstd, Tensor(a!) norms) -> (Tensor, Tensor)");
  m.def("groupnorm_affine_norms(Tensor x, Tensor d, Tensor mean, Tensor rstd, int groups, Tensor(a!) norms) -> "
        "(Tensor, Tensor)");
}
