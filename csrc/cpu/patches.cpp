// CPU im2col of a convolution's input as position-major patches (B, L, C·k): one pass, padding written as zeros
// (see conv_patches in ops.h). Rows (b, l) are split across OpenMP threads.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

namespace elasticlab {

at::Tensor conv_patches_cpu(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation) {
  const PatchGeometry g = check_patches_args(x, kernel, stride, padding, dilation);
  auto out = at::empty({g.B, g.L(), g.K()}, x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_patches_cpu", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t K = g.K(), L = g.L();
    at::parallel_for(0, g.B * L, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / L, l = r % L, oh = l / g.Wo, ow = l % g.Wo;
        scalar_t* row = po + r * K;
        for (int64_t c = 0; c < g.C; ++c) {
          const scalar_t* plane = px + b * g.xb + c * g.xc;
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t y = oh * g.sh - g.ph + i * g.dh;
            const bool y_in = y >= 0 && y < g.H;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t xx = ow * g.sw - g.pw + j * g.dw;
              *row++ = (y_in && xx >= 0 && xx < g.W) ? plane[y * g.xy + xx * g.xx] : scalar_t(0);
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace elasticlab
