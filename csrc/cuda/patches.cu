// CUDA im2col of a convolution's input as position-major patches (B, L, C·k) (see conv_patches in ops.h): one
// launch and one write of the patches, where the strided-view form took a padding fill, a padded copy and a
// gather copy (about 20 ATen operators of host work per layer). One thread an element, consecutive threads on
// consecutive columns (coalesced writes); 32-bit indices divided by magic multiplication (ATen's IntDivider)
// when every index fits, 64-bit ones otherwise.
#include "../ops.h"
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace elasticlab {
namespace {

template <typename index_t>
using Divider = at::cuda::detail::IntDivider<index_t>;

// index_t: uint32_t (fast division by magic multiplication) or uint64_t; coordinates may be negative (padding).
template <typename scalar_t, typename index_t>
__global__ void conv_patches_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out, index_t total,
                                    Divider<index_t> by_K, Divider<index_t> by_L, Divider<index_t> by_Wo,
                                    Divider<index_t> by_kw, Divider<index_t> by_kh, int64_t H, int64_t W,
                                    int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                                    int64_t sb, int64_t sc, int64_t sy, int64_t sx) {
  using coord_t = std::conditional_t<sizeof(index_t) == 4, int32_t, int64_t>;
  const index_t step = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t e = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const auto rk = by_K.divmod(e);        // row r = b·L + l, column k = (c·kh + i)·kw + j
    const auto bl = by_L.divmod(rk.div);
    const auto hw = by_Wo.divmod(bl.mod);
    const auto cj = by_kw.divmod(rk.mod);
    const auto ci = by_kh.divmod(cj.div);
    const coord_t y = static_cast<coord_t>(hw.div) * static_cast<coord_t>(sh) - static_cast<coord_t>(ph) +
                      static_cast<coord_t>(ci.mod) * static_cast<coord_t>(dh);
    const coord_t xx = static_cast<coord_t>(hw.mod) * static_cast<coord_t>(sw) - static_cast<coord_t>(pw) +
                       static_cast<coord_t>(cj.mod) * static_cast<coord_t>(dw);
    scalar_t v = scalar_t(0);
    if (y >= 0 && y < H && xx >= 0 && xx < W) {
      v = x[static_cast<int64_t>(bl.div) * sb + static_cast<int64_t>(ci.div) * sc + static_cast<int64_t>(y) * sy +
            static_cast<int64_t>(xx) * sx];
    }
    out[e] = v;
  }
}

template <typename scalar_t, typename index_t>
void launch(const at::Tensor& x, at::Tensor& out, const PatchGeometry& g) {
  const int64_t total = out.numel();
  constexpr int kThreads = 256;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, sms * 16);
  auto div = [](int64_t v) { return Divider<index_t>(static_cast<index_t>(v)); };
  conv_patches_kernel<scalar_t, index_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), static_cast<index_t>(total), div(g.K()), div(g.L()),
      div(g.Wo), div(g.kw), div(g.kh), g.H, g.W, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.xb, g.xc, g.xy, g.xx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor conv_patches_cuda(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation) {
  const PatchGeometry g = check_patches_args(x, kernel, stride, padding, dilation);
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({g.B, g.L(), g.K()}, x.options());
  if (out.numel() == 0) return out;
  // 32-bit indices when the element count and every signed coordinate (down to −padding, up to the padded
  // extent plus a grid step) fit
  const int64_t bound = std::max<int64_t>({out.numel(), g.H + 2 * g.ph + g.sh * g.Ho, g.W + 2 * g.pw + g.sw * g.Wo});
  const bool small = bound < (int64_t(1) << 30);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_patches_cuda", [&] {
    if (small) launch<scalar_t, uint32_t>(x, out, g);
    else launch<scalar_t, uint64_t>(x, out, g);
  });
  return out;
}

}  // namespace elasticlab
