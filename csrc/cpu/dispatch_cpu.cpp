// CPU registrations of the elasticlab operators.
#include <torch/library.h>
#include "../ops.h"

TORCH_LIBRARY_IMPL(elasticlab, CPU, m) {
  m.impl("row_sq_norms", &elasticlab::row_sq_norms_cpu);
}
