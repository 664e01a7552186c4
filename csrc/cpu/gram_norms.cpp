// CPU Gram-form per-example norms: sum_{t,s} (a_t.a_s)(d_t.d_s), one upper-triangular row block of the
// two T x T Gram matrices at a time (BLAS for the blocks, a fused weighted dot for the reduction), so no
// (B,T,T) tensor is formed and the symmetric half is skipped. Tasks (example, row block) run in parallel.
#include "../ops.h"
#include "reduce.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <vector>

namespace elasticlab {

at::Tensor seq_linear_gram_norms_cpu(const at::Tensor& a_in, const at::Tensor& d_in) {
  check_seq_args("seq_linear_gram_norms", a_in, d_in);
  if (is_reduced_float(a_in.scalar_type()))                // accumulate half inputs in float32
    return seq_linear_gram_norms_cpu(a_in.to(at::kFloat), d_in.to(at::kFloat));
  const int64_t B = a_in.size(0), T = a_in.size(1);
  auto out = at::zeros({B}, a_in.options());
  if (B == 0 || T == 0) return out;
  const int64_t TB = 64;                                // rows of a Gram block
  const int64_t nblk = (T + TB - 1) / TB;
  std::vector<double> partial(B * nblk, 0.0);
  AT_DISPATCH_FLOATING_TYPES(a_in.scalar_type(), "seq_linear_gram_norms_cpu", [&] {
    at::parallel_for(0, B * nblk, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t b = k / nblk, t0 = (k % nblk) * TB, t1 = std::min(T, t0 + TB);
        auto A = a_in[b], D = d_in[b];
        // Rows t0..t1 against columns t0..T: the diagonal block once, the blocks right of it twice.
        auto ga = at::mm(A.narrow(0, t0, t1 - t0), A.narrow(0, t0, T - t0).t()).contiguous();
        auto gd = at::mm(D.narrow(0, t0, t1 - t0), D.narrow(0, t0, T - t0).t()).contiguous();
        const scalar_t* pa = ga.data_ptr<scalar_t>();
        const scalar_t* pd = gd.data_ptr<scalar_t>();
        const int64_t W = T - t0, diag = t1 - t0;
        double acc = 0.0;
        for (int64_t i = 0; i < diag; ++i) {
          const scalar_t* ra = pa + i * W;
          const scalar_t* rd = pd + i * W;
          acc += cpu::dot(ra, rd, diag) + 2.0 * cpu::dot(ra + diag, rd + diag, W - diag);
        }
        partial[k] = acc;
      }
    });
    scalar_t* po = out.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      double s = 0.0;
      for (int64_t i = 0; i < nblk; ++i) s += partial[b * nblk + i];
      po[b] = static_cast<scalar_t>(s);
    }
  });
  return out;
}

}  // namespace elasticlab
