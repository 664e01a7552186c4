// CPU outer-product per-example norms fused with the weight gradient. G_b = d_b^T a_b is formed one tile
// (rows r0..r1 of Dout) at a time in a small cache-resident buffer (BLAS), then one pass both adds it into
// the weight gradient and reduces its squared norm, so no (B, Dout, Din) tensor is ever written.
// Parallel over row tiles (each owns its rows of the gradient) when there are enough of them, otherwise
// over examples with one gradient accumulator per thread.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

namespace elasticlab {
namespace {

// acc[i] += g[i] (when acc) and returns sum_i g[i]^2.
template <typename scalar_t>
double fold_tile(const scalar_t* g, scalar_t* acc, int64_t n) {
  scalar_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  if (acc) {
    for (; i + 4 <= n; i += 4) {
      s0 += g[i] * g[i]; s1 += g[i + 1] * g[i + 1]; s2 += g[i + 2] * g[i + 2]; s3 += g[i + 3] * g[i + 3];
      acc[i] += g[i]; acc[i + 1] += g[i + 1]; acc[i + 2] += g[i + 2]; acc[i + 3] += g[i + 3];
    }
    for (; i < n; ++i) { s0 += g[i] * g[i]; acc[i] += g[i]; }
  } else {
    for (; i + 4 <= n; i += 4) {
      s0 += g[i] * g[i]; s1 += g[i + 1] * g[i + 1]; s2 += g[i + 2] * g[i + 2]; s3 += g[i + 3] * g[i + 3];
    }
    for (; i < n; ++i) s0 += g[i] * g[i];
  }
  return static_cast<double>(s0) + s1 + s2 + s3;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cpu(const at::Tensor& a, const at::Tensor& d,
                                                              bool with_grad) {
  check_seq_args("seq_linear_outer_norms", a, d);
  const int64_t B = a.size(0), Din = a.size(2), Dout = d.size(2);
  auto norms = at::zeros({B}, a.options());
  auto grad = with_grad ? at::zeros({Dout, Din}, a.options()) : at::empty({0}, a.options());
  if (B == 0 || Din == 0 || Dout == 0) return {norms, grad};
  const int64_t nthreads = at::get_num_threads();
  // Tile rows: a buffer of at most ~64K elements (L2-resident), at least 16 rows for the GEMM.
  const int64_t rows = std::max<int64_t>(16, std::min<int64_t>(Dout, (1 << 16) / std::max<int64_t>(Din, 1)));
  const int64_t ntiles = (Dout + rows - 1) / rows;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "seq_linear_outer_norms_cpu", [&] {
    scalar_t* pg = with_grad ? grad.data_ptr<scalar_t>() : nullptr;
    if (ntiles >= nthreads || B < nthreads) {
      std::vector<double> partial(ntiles * B, 0.0);
      at::parallel_for(0, ntiles, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r0 = i * rows, r = std::min(Dout, r0 + rows) - r0;
          auto buf = at::empty({r, Din}, a.options());
          for (int64_t b = 0; b < B; ++b) {
            at::mm_out(buf, d[b].narrow(1, r0, r).t(), a[b]);
            partial[i * B + b] = fold_tile(buf.data_ptr<scalar_t>(), pg ? pg + r0 * Din : nullptr, r * Din);
          }
        }
      });
      scalar_t* pn = norms.data_ptr<scalar_t>();
      for (int64_t b = 0; b < B; ++b) {
        double s = 0.0;
        for (int64_t i = 0; i < ntiles; ++i) s += partial[i * B + b];
        pn[b] = static_cast<scalar_t>(s);
      }
    } else {
      // Few, small tiles (e.g. a first conv layer): parallel over examples, a gradient per thread.
      std::vector<at::Tensor> accs(nthreads);
      scalar_t* pn = norms.data_ptr<scalar_t>();
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        const int tid = at::get_thread_num();
        if (with_grad && !accs[tid].defined()) accs[tid] = at::zeros({Dout, Din}, a.options());
        scalar_t* pacc = with_grad ? accs[tid].data_ptr<scalar_t>() : nullptr;
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
    }
  });
  return {norms, grad};
}

}  // namespace elasticlab
