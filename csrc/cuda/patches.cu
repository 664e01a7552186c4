// CUDA im2col of a convolution's input as position-major patches (B, L, C·k) (see conv_patches in ops.h): one
// launch and one write of the patches, where the strided-view form took a padding fill, a padded copy and a
// gather copy (about 20 ATen operators of host work per layer). One thread an element, consecutive threads on
// consecutive columns (coalesced writes); 32-bit index arithmetic when every index fits.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>
#include <limits>

namespace elasticlab {
namespace {

template <typename scalar_t, typename index_t>
__global__ void conv_patches_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out, index_t total,
                                    index_t C, index_t H, index_t W, index_t Wo, index_t L, index_t kh, index_t kw,
                                    index_t sh, index_t sw, index_t ph, index_t pw, index_t dh, index_t dw,
                                    int64_t sb, int64_t sc, int64_t sy, int64_t sx) {
  const index_t K = C * kh * kw;
  const index_t step = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const index_t r = e / K, k = e - r * K;      // r = b·L + l
    const index_t b = r / L, l = r - b * L;
    const index_t oh = l / Wo, ow = l - oh * Wo;
    const index_t ck = k / kw, j = k - ck * kw;
    const index_t c = ck / kh, i = ck - c * kh;
    const index_t y = oh * sh - ph + i * dh, xx = ow * sw - pw + j * dw;
    scalar_t v = scalar_t(0);
    if (y >= 0 && y < H && xx >= 0 && xx < W) {
      v = x[static_cast<int64_t>(b) * sb + static_cast<int64_t>(c) * sc + static_cast<int64_t>(y) * sy +
            static_cast<int64_t>(xx) * sx];
    }
    out[e] = v;
  }
}

template <typename scalar_t, typename index_t>
void launch(const at::Tensor& x, at::Tensor& out, const PatchGeometry& g, int64_t sy) {
  const int64_t total = out.numel();
  constexpr int kThreads = 256;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, sms * 16);
  conv_patches_kernel<scalar_t, index_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), static_cast<index_t>(total),
      static_cast<index_t>(g.C), static_cast<index_t>(g.H), static_cast<index_t>(g.W), static_cast<index_t>(g.Wo),
      static_cast<index_t>(g.L()), static_cast<index_t>(g.kh), static_cast<index_t>(g.kw),
      static_cast<index_t>(g.sh), static_cast<index_t>(g.sw), static_cast<index_t>(g.ph),
      static_cast<index_t>(g.pw), static_cast<index_t>(g.dh), static_cast<index_t>(g.dw), x.stride(0),
      x.stride(1), sy, x.stride(-1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor conv_patches_cuda(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation) {
  const PatchGeometry g = check_patches_args(x, kernel, stride, padding, dilation);
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({g.B, g.L(), g.K()}, x.options());
  if (out.numel() == 0) return out;
  const int64_t sy = x.dim() == 4 ? x.stride(2) : 0;
  // 32-bit indices when the element count and every signed coordinate (down to −padding, up to the padded
  // extent plus a grid step) fit
  const int64_t bound = std::max<int64_t>({out.numel(), g.H + 2 * g.ph + g.sh * g.Ho, g.W + 2 * g.pw + g.sw * g.Wo});
  const bool small = bound < (int64_t(1) << 30);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_patches_cuda", [&] {
    if (small) launch<scalar_t, int32_t>(x, out, g, sy);
    else launch<scalar_t, int64_t>(x, out, g, sy);
  });
  return out;
}

}  // namespace elasticlab
