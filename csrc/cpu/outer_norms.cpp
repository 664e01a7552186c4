// CPU outer-product per-example norms fused with the weight gradient. G_b = d_b^T a_b is formed one tile
// (rows r0..r1 of Dout, the whole matrix up to 1M elements) at a time in a buffer (BLAS), then one pass adds it into
// the weight gradient and reduces its squared norm, so no (B, Dout, Din) tensor is ever written.
// Parallel over examples with one gradient accumulator per thread, or over row tiles (each owning its
// rows of the gradient) when examples are fewer than threads.
#include "../ops.h"
#include "reduce.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <algorithm>
#include <vector>

namespace elasticlab {
namespace {

// acc[i] += g[i] (when acc) and returns sum_i g[i]^2.
template <typename scalar_t>
double fold_tile(const scalar_t* g, scalar_t* acc, int64_t n) {
  return acc ? cpu::add_and_sq_sum(g, acc, n) : cpu::sq_sum(g, n);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cpu(const at::Tensor& a, const at::Tensor& d,
                                                              bool with_grad) {
  check_seq_args("seq_linear_outer_norms", a, d);
  if (is_reduced_float(a.scalar_type()))                   // accumulate half inputs in float32
    return seq_linear_outer_norms_cpu(a.to(at::kFloat), d.to(at::kFloat), with_grad);
  c10::NoGradGuard no_grad;
  const int64_t B = a.size(0), Din = a.size(2), Dout = d.size(2);
  auto norms = at::zeros({B}, a.options());
  auto grad = with_grad ? at::zeros({Dout, Din}, a.options()) : at::empty({0}, a.options());
  if (B == 0 || Din == 0 || Dout == 0) return {norms, grad};
  const int64_t nthreads = at::get_num_threads();
  // Per-example GEMMs are most efficient at full width (measured: 256-row tiles cost +30%), so a tile is
  // the whole G_b up to ~1M elements; wider layers are cut into row tiles of that size.
  const int64_t kTileElems = 1 << 20;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "seq_linear_outer_norms_cpu", [&] {
    scalar_t* pn = norms.data_ptr<scalar_t>();
    if (B >= nthreads && nthreads * Dout * Din <= 8 * kTileElems) {
      // Parallel over examples; thread 0 accumulates into grad itself, the others into their own buffer.
      const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(Dout, kTileElems / Din));
      const int64_t ntiles = (Dout + rows - 1) / rows;
      std::vector<at::Tensor> accs(nthreads);
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        c10::NoGradGuard guard;
        const int tid = at::get_thread_num();
        scalar_t* pacc = nullptr;
        if (with_grad) {
          if (tid == 0) {
            pacc = grad.data_ptr<scalar_t>();
          } else {
            if (!accs[tid].defined()) accs[tid] = at::zeros({Dout, Din}, a.options());
            pacc = accs[tid].data_ptr<scalar_t>();
          }
        }
        auto buf = at::empty({rows, Din}, a.options());
        for (int64_t b = b0; b < b1; ++b) {
          double s = 0.0;
          for (int64_t i = 0; i < ntiles; ++i) {
            const int64_t r0 = i * rows, r = std::min(Dout, r0 + rows) - r0;
            auto tile = buf.narrow(0, 0, r);
            at::mm_out(tile, d[b].narrow(1, r0, r).t(), a[b]);
            s += fold_tile(tile.data_ptr<scalar_t>(), pacc ? pacc + r0 * Din : nullptr, r * Din);
          }
          pn[b] = static_cast<scalar_t>(s);
        }
      });
      if (with_grad)
        for (auto& t : accs)
          if (t.defined()) grad.add_(t);
    } else {
      // Few examples (or huge layers): parallel over row tiles, each owning its rows of the gradient.
      const int64_t ntiles = std::max<int64_t>(std::min<int64_t>(nthreads, Dout), (Dout * Din + kTileElems - 1) / kTileElems);
      const int64_t rows = (Dout + ntiles - 1) / ntiles;
      std::vector<double> partial(ntiles * B, 0.0);
      scalar_t* pg = with_grad ? grad.data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, ntiles, 1, [&](int64_t i0, int64_t i1) {
        c10::NoGradGuard guard;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r0 = i * rows;
          if (r0 >= Dout) continue;
          const int64_t r = std::min(Dout, r0 + rows) - r0;
          auto buf = at::empty({r, Din}, a.options());
          for (int64_t b = 0; b < B; ++b) {
            at::mm_out(buf, d[b].narrow(1, r0, r).t(), a[b]);
            partial[i * B + b] = fold_tile(buf.data_ptr<scalar_t>(), pg ? pg + r0 * Din : nullptr, r * Din);
          }
        }
      });
      for (int64_t b = 0; b < B; ++b) {
        double s = 0.0;
        for (int64_t i = 0; i < ntiles; ++i) s += partial[i * B + b];
        pn[b] = static_cast<scalar_t>(s);
      }
    }
  });
  return {norms, grad};
}

at::Tensor seq_linear_outer_norms_out_cpu(const at::Tensor& a, const at::Tensor& d, bool with_grad,
                                          at::Tensor& norms) {
  check_seq_args("seq_linear_outer_norms", a, d);
  check_norms_row("seq_linear_outer_norms", a, norms);
  auto [n, grad] = seq_linear_outer_norms_cpu(a, d, with_grad);
  norms.copy_(n);
  return grad;
}

}  // namespace elasticlab
