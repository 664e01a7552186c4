// CPU registrations of the elasticlab operators.
#include <torch/library.h>
#include "../ops.h"

TORCH_LIBRARY_IMPL(elasticlab, CPU, m) {
  m.impl("row_sq_norms", &elasticlab::row_sq_norms_cpu);
  m.impl("row_sq_norms.out", &elasticlab::row_sq_norms_out_cpu);
  m.impl("product_norms.out", &elasticlab::product_norms_out_cpu);
  m.impl("product_bias_norms", &elasticlab::product_bias_norms_cpu);
  m.impl("batch_sum_norms", &elasticlab::batch_sum_norms_cpu);
  m.impl("layernorm_affine_norms", &elasticlab::layernorm_affine_norms_cpu);
  m.impl("groupnorm_affine_norms", &elasticlab::groupnorm_affine_norms_cpu);
  m.impl("seq_linear_gram_norms", &elasticlab::seq_linear_gram_norms_cpu);
  m.impl("seq_linear_outer_norms", &elasticlab::seq_linear_outer_norms_cpu);
  m.impl("seq_linear_outer_norms.out", &elasticlab::seq_linear_outer_norms_out_cpu);
  m.impl("conv_patches", &elasticlab::conv_patches_cpu);
  m.impl("layernorm_per_example", &elasticlab::layernorm_per_example_cpu);
}
