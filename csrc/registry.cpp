// Operator schemas: every kernel is a torch operator, called from Python as torch.ops.elasticlab.*.
#include <torch/library.h>

TORCH_LIBRARY(elasticlab, m) {
  m.def("row_sq_norms(Tensor x) -> Tensor");
}
