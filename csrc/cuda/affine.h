// Shared by the CUDA normalisation-layer kernels (layernorm_norms.cu, affine_norms.cu).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace elasticlab {
namespace cuda {

// Per-example LayerNorm parameter gradients as row-split partials (S, B, D) in acc_type, S >= 1 (summed over
// S they are layernorm_per_example's result). Arguments checked by the caller; the device guard is its too.
std::tuple<at::Tensor, at::Tensor> layernorm_partials(const at::Tensor& x, const at::Tensor& d,
                                                      const at::Tensor& mean, const at::Tensor& rstd);

}  // namespace cuda
}  // namespace elasticlab
