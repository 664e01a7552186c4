// The fused nn.Conv1d / nn.Conv2d as a C++ autograd function (operator elasticlab::conv_norms; see common.h).
#include "common.h"

#include <algorithm>
#include <vector>

namespace elasticlab {
namespace fused {
namespace {

// How a convolution's per-example weight norms are formed (the Python rule's choice, per shape).
enum ConvForm : int64_t { kConvOuter = 0, kConvGram = 1, kConvGrouped = 2 };

// Conv1d/Conv2d (zero padding) as a Linear over the L output positions of the unfolded input, per group.
// Weight norms: the outer form on CUDA (per-example gradients by batched GEMMs over the patches, their batch
// sum the weight gradient), the Gram form over the patches (ATen forms the weight gradient), or on the CPU
// the weight gradient of one convolution with c·groups groups (the batch folded into channels; Goodfellow
// 2015). Chunks of examples bound the scratch (`chunk_elems` unfolded elements).
struct ConvNorms : public torch::autograd::Function<ConvNorms> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& norms, const std::optional<at::Tensor>& bias_opt,
                            std::vector<int64_t> stride, std::vector<int64_t> padding,
                            std::vector<int64_t> dilation, int64_t groups, int64_t form, int64_t chunk_elems,
                            std::optional<at::ScalarType> dtype, bool tf32) {
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    at::Tensor xc = x, wc = weight, bc = bias;
    if (dtype.has_value()) {
      xc = cast(x, *dtype);
      wc = cast(weight, *dtype);
      bc = cast(bias, *dtype);
    }
    std::vector<int64_t> out_pad(stride.size(), 0);
    at::Tensor out = at::convolution(xc, wc, bc.defined() ? std::optional<at::Tensor>(bc) : std::nullopt, stride,
                                     padding, dilation, false, out_pad, groups);
    ctx->save_for_backward({xc, wc});
    ctx->saved_data["norms"] = norms;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["ints"] = std::vector<int64_t>{groups, form, chunk_elems, tf32};
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(x.scalar_type()),
                                                     static_cast<int64_t>(weight.scalar_type()),
                                                     bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : -1};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // unpacked before the guard: an unpack hook may run the forward again (non-reentrant activation
    // checkpointing recomputes it there), which needs autograd to save its tensors
    auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor norms = ctx->saved_data["norms"].toTensor();
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const auto ints = ctx->saved_data["ints"].toIntVector();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const int64_t G = ints[0], form = ints[1], chunk_elems = ints[2];
    const Tf32Scope tf32(static_cast<int>(ints[3]));         // float32 per-example GEMMs as the caller said
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = dtypes[2] >= 0 && ctx->needs_input_grad(3);
    const at::Tensor g = cast(grads[0], x.scalar_type());
    const int64_t B = x.size(0), cout = w.size(0), K = w.numel() / std::max<int64_t>(cout, 1), cog = cout / G;
    const auto acc = acc_type(x.scalar_type());
    std::vector<int64_t> out_pad(stride.size(), 0);
    const bool gram = need_w && form == kConvGram;
    auto [gx, gw, unused] = at::convolution_backward(g, x, w, std::nullopt, stride, padding, dilation, false,
                                                     out_pad, G, {need_x, gram, false});
    at::Tensor d3 = g.reshape({B, cout, -1});
    const int64_t L = d3.size(2);
    std::vector<int64_t> kernel(w.sizes().begin() + 2, w.sizes().end());
    const int64_t step = std::max<int64_t>(1, chunk_elems / std::max<int64_t>(K * G * L, 1));
    if (need_w && form != kConvGrouped && G == 1 && step >= B) {
      // one group, one chunk (the common case): the kernels' results are the norms and the gradient
      at::Tensor a = patches(x, kernel, stride, padding, dilation), dt = d3.transpose(1, 2);
      if (form == kConvGram) {
        put(norms, 0, gram_norms(a, dt));
      } else {
        gw = outer_norms_into(a, dt, norms, 0).view(w.sizes());
      }
    } else if (need_w && form != kConvGrouped) {
      at::Tensor per = at::zeros({B}, x.options().dtype(acc));
      at::Tensor gsum = form == kConvOuter ? at::zeros({G, cog, K}, x.options().dtype(acc)) : at::Tensor();
      for (int64_t b0 = 0; b0 < B; b0 += step) {
        const int64_t c = std::min(step, B - b0);
        at::Tensor dg = batch_rows(d3, b0, c).view({c, G, cog, L});
        at::Tensor P = patches(batch_rows(x, b0, c), kernel, stride, padding, dilation);
        at::Tensor pc = batch_rows(per, b0, c);
        for (int64_t gi = 0; gi < G; ++gi) {
          at::Tensor a = P.narrow(2, gi * K, K), dgi = dg.select(1, gi).transpose(1, 2);
          if (form == kConvGram) {
            pc.add_(gram_norms(a, dgi));
          } else {
            auto [n, s] = outer_norms(a, dgi);
            pc.add_(n);
            gsum.select(0, gi).add_(s);
          }
        }
      }
      put(norms, 0, per);
      if (form == kConvOuter) gw = gsum.view(w.sizes());
    } else if (need_w) {  // kConvGrouped (CPU): c examples as one convolution with c·G groups
      const int64_t step = std::max<int64_t>(1, std::min<int64_t>(32, chunk_elems / std::max<int64_t>(w.numel(), 1)));
      at::Tensor per = at::empty({B}, x.options().dtype(acc));
      gw = at::zeros(w.sizes(), x.options().dtype(acc));
      for (int64_t b0 = 0; b0 < B; b0 += step) {
        const int64_t c = std::min(step, B - b0);
        std::vector<int64_t> xs{1, c * x.size(1)}, gs{1, c * cout}, ws{c * cout};
        xs.insert(xs.end(), x.sizes().begin() + 2, x.sizes().end());
        gs.insert(gs.end(), g.sizes().begin() + 2, g.sizes().end());
        ws.insert(ws.end(), w.sizes().begin() + 1, w.sizes().end());
        std::vector<int64_t> we{c};
        we.insert(we.end(), w.sizes().begin(), w.sizes().end());
        at::Tensor xg = batch_rows(x, b0, c).reshape(xs), gg = batch_rows(g, b0, c).reshape(gs);
        at::Tensor wg = w.unsqueeze(0).expand(we).reshape(ws);
        at::Tensor pe = std::get<1>(at::convolution_backward(gg, xg, wg, std::nullopt, stride, padding, dilation,
                                                             false, out_pad, c * G, {false, true, false}))
                            .view(we);
        batch_rows(per, b0, c).copy_(row_sq(pe));
        gw.add_(pe.sum({0}));
      }
      put(norms, 0, per);
    }
    at::Tensor gb;
    if (need_b) {
      gb = cast(put_batch_sum(norms, 1, d3.sum({2}, false, acc)), static_cast<at::ScalarType>(dtypes[2]));
    }
    if (gx.defined()) gx = cast(gx, static_cast<at::ScalarType>(dtypes[0]));
    if (gw.defined()) gw = cast(gw, static_cast<at::ScalarType>(dtypes[1]));
    if (!need_w) gw = at::Tensor();
    return {gx, gw, at::Tensor(), gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor conv_norms_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                               int64_t groups, const at::Tensor& norms, int64_t form, int64_t chunk_elems,
                               std::optional<at::ScalarType> dtype, bool tf32) {
  EL_CHECK(form == kConvOuter || form == kConvGram || form == kConvGrouped,
           "conv_norms: form must be 0 (outer), 1 (Gram) or 2 (grouped convolution), got ", form);
  EL_CHECK(x.dim() == weight.dim() && (x.dim() == 3 || x.dim() == 4),
           "conv_norms: expected a batched 1-d or 2-d convolution input, got shape ", x.sizes(),
           " for weight ", weight.sizes());
  EL_CHECK(norms.dim() == 2 && norms.size(0) == 2 && norms.size(1) == x.size(0),
           "conv_norms: norms must be (2, B) = (2, ", x.size(0), "), got ", norms.sizes());
  EL_CHECK(chunk_elems > 0, "conv_norms: chunk_elems must be positive, got ", chunk_elems);
  std::optional<at::Tensor> b = (bias.has_value() && bias->defined()) ? bias : std::nullopt;
  return ConvNorms::apply(x, weight, norms, b, stride.vec(), padding.vec(), dilation.vec(), groups, form,
                          chunk_elems, dtype, tf32);
}

at::Tensor conv_norms_forward_only(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                   at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                                   const at::Tensor&, int64_t, int64_t, std::optional<at::ScalarType> dtype, bool) {
  std::vector<int64_t> out_pad(stride.size(), 0);
  if (!dtype.has_value()) return at::convolution(x, weight, bias, stride, padding, dilation, false, out_pad, groups);
  std::optional<at::Tensor> bc = bias.has_value() ? std::optional<at::Tensor>(cast(*bias, *dtype)) : std::nullopt;
  return at::convolution(cast(x, *dtype), cast(weight, *dtype), bc, stride, padding, dilation, false, out_pad,
                         groups);
}

}  // namespace
}  // namespace fused
}  // namespace elasticlab

TORCH_LIBRARY_FRAGMENT(elasticlab, m) {
  m.def("conv_norms(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups, "
        "Tensor norms, int form, int chunk_elems, ScalarType? dtype, bool tf32=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(elasticlab, Autograd, m) {
  m.impl("conv_norms", &elasticlab::fused::conv_norms_autograd);
}

// Without autograd (inference mode): the layer's forward alone.
TORCH_LIBRARY_IMPL(elasticlab, CompositeExplicitAutograd, m) {
  m.impl("conv_norms", &elasticlab::fused::conv_norms_forward_only);
}
