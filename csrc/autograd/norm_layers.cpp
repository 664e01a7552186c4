// The fused nn.LayerNorm and nn.GroupNorm as C++ autograd functions (operators elasticlab::layer_norm_norms,
// group_norm_norms; see common.h).
#include "common.h"

#include <algorithm>
#include <vector>

namespace elasticlab {
namespace fused {
namespace {

// LayerNorm over the trailing `shape`: per-example ∇γ ℓ_b = Σ_t g_{b,t} ⊙ x̂_{b,t}, ∇β ℓ_b = Σ_t g_{b,t}
// (Gray et al. 2024); their batch sums are the parameter gradients, ATen's backward gives the input's.
// `upcast` (autocast on): the layer runs in float32 at least, as autocast's layer_norm does.
struct LayerNormNorms : public torch::autograd::Function<LayerNormNorms> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& norms,
                            const std::optional<at::Tensor>& weight_opt, const std::optional<at::Tensor>& bias_opt,
                            std::vector<int64_t> shape, double eps, bool upcast) {
    const at::Tensor weight = weight_opt.has_value() ? *weight_opt : at::Tensor();
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    at::Tensor xc = upcast ? cast(x, at::promote_types(x.scalar_type(), at::kFloat)) : x;
    auto [out, mean, rstd] = at::native_layer_norm(
        xc, shape, weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt,
        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, eps);
    ctx->save_for_backward({xc, weight, bias, mean, rstd});
    ctx->saved_data["norms"] = norms;
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // unpacked before the guard: an unpack hook may run the forward again (non-reentrant activation
    // checkpointing recomputes it there), which needs autograd to save its tensors
    auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
    const at::Tensor norms = ctx->saved_data["norms"].toTensor();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    // autograd's inputs: x, norms, then weight and bias where given
    const bool need_x = ctx->needs_input_grad(0), need_w = w.defined() && ctx->needs_input_grad(2),
               need_b = b.defined() && ctx->needs_input_grad(w.defined() ? 3 : 2);
    at::Tensor g = cast(grads[0], x.scalar_type());
    at::Tensor gx, gw, gb;
    if (need_x) {
      gx = std::get<0>(at::native_layer_norm_backward(
          g, x, shape, mean, rstd, w.defined() ? std::optional<at::Tensor>(w) : std::nullopt,
          b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, {true, false, false}));
      gx = cast(gx, static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    }
    if (need_w || need_b) {
      int64_t D = 1;
      for (auto s : shape) D *= s;
      const int64_t B = x.size(0);
      auto acc = acc_type(x.scalar_type());
      // the batch sums, and both norm rows written (a row the layer does not need is not read)
      // (B, T, D) inputs and a 1-d shape (a sequence model's LayerNorm) pass as they are: no reshape dispatched
      const bool seq = x.dim() == 3 && shape.size() == 1;
      auto rows = [&](const at::Tensor& t) { return seq ? t : t.reshape({B, -1, D}); };
      auto [sw, sb] = layernorm_affine(rows(x), rows(g), cast(mean.reshape({B, -1}), acc),
                                       cast(rstd.reshape({B, -1}), acc), norms);
      if (need_w) gw = cast(shape.size() == 1 ? sw : sw.view(shape), w.scalar_type());
      if (need_b) gb = cast(shape.size() == 1 ? sb : sb.view(shape), b.scalar_type());
    }
    return {gx, at::Tensor(), gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// GroupNorm with `groups` groups over (B, C, *): per-example ∇γ_c ℓ_b = Σ_s g_{b,c,s} x̂_{b,c,s} and
// ∇β_c ℓ_b = Σ_s g_{b,c,s} (statistics per example and group, so examples do not interact; Wu & He 2018);
// ATen's backward gives the input gradient. `upcast` (autocast on): the layer runs in float32 at least.
struct GroupNormNorms : public torch::autograd::Function<GroupNormNorms> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& norms,
                            const at::Tensor& weight_in, const at::Tensor& bias_in, int64_t groups, double eps,
                            bool upcast) {
    at::Tensor x = x_in, w = weight_in, b = bias_in;
    if (upcast) {
      const auto dt = at::promote_types(x.scalar_type(), at::kFloat);
      x = cast(x, dt);
      w = cast(w, dt);
      b = cast(b, dt);
    }
    // the layout ATen's group_norm gives its kernels: channels-last kept on the CPU, contiguous elsewhere
    const auto fmt = x.is_cpu() ? x.suggest_memory_format() : at::MemoryFormat::Contiguous;
    x = x.contiguous(fmt);
    const int64_t B = x.size(0), C = x.size(1), hw = x.numel() / std::max<int64_t>(B * C, 1);
    auto [out, mean, rstd] = at::native_group_norm(x, w, b, B, C, hw, groups, eps);
    ctx->save_for_backward({x, w, mean, rstd});
    ctx->saved_data["norms"] = norms;
    ctx->saved_data["shape"] = std::vector<int64_t>{B, C, hw, groups, static_cast<int64_t>(fmt)};
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(x_in.scalar_type()),
                                                     static_cast<int64_t>(weight_in.scalar_type()),
                                                     static_cast<int64_t>(bias_in.scalar_type())};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // unpacked before the guard: an unpack hook may run the forward again (non-reentrant activation
    // checkpointing recomputes it there), which needs autograd to save its tensors
    auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor &x = saved[0], &w = saved[1];
    at::Tensor mean = saved[2], rstd = saved[3];
    const at::Tensor norms = ctx->saved_data["norms"].toTensor();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const int64_t B = shape[0], C = shape[1], hw = shape[2], G = shape[3];
    const auto fmt = static_cast<at::MemoryFormat>(shape[4]);
    // autograd's inputs: x, norms, weight, bias
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(2),
               need_b = ctx->needs_input_grad(3);
    at::Tensor g = cast(grads[0], x.scalar_type()).contiguous(fmt);
    at::Tensor gx, gw, gb;
    if (need_x) {
      gx = std::get<0>(at::native_group_norm_backward(g, x, mean, rstd, w, B, C, hw, G, {true, false, false}));
      gx = cast(gx, static_cast<at::ScalarType>(dtypes[0]));
    }
    if (need_w || need_b) {
      const auto acc = acc_type(x.scalar_type());
      if (acc != x.scalar_type()) {  // ATen's statistics of half inputs are half: recompute them
        auto [var, m] = at::var_mean(cast(x, acc).reshape({B, G, -1}), {-1}, /*correction=*/0, /*keepdim=*/false);
        mean = m;
        rstd = at::rsqrt(var + ctx->saved_data["eps"].toDouble());
      }
      // the batch sums, and both norm rows written (a row the layer does not need is not read)
      // (B, C, *spatial) as they are; ATen's statistics are already (B, G): no reshape dispatched
      auto rows = [&](const at::Tensor& t) { return t.dim() >= 3 ? t : t.reshape({B, C, -1}); };
      auto per_group = [&](const at::Tensor& t) { return t.dim() == 2 ? t : t.reshape({B, G}); };
      auto [sw, sb] = groupnorm_affine(rows(x), rows(g), per_group(mean), per_group(rstd), G, norms);
      if (need_w) gw = cast(sw, static_cast<at::ScalarType>(dtypes[1]));
      if (need_b) gb = cast(sb, static_cast<at::ScalarType>(dtypes[2]));
    }
    return {gx, at::Tensor(), gw, gb, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_norms_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias, at::IntArrayRef shape, double eps,
                                     const at::Tensor& norms, bool upcast) {
  EL_CHECK(x.dim() > static_cast<int64_t>(shape.size()),
           "layer_norm_norms: per-example norms need a batch dimension first, got shape ", x.sizes());
  EL_CHECK(norms.dim() == 2 && norms.size(0) == 2 && norms.size(1) == x.size(0),
           "layer_norm_norms: norms must be (2, B) = (2, ", x.size(0), "), got ", norms.sizes());
  std::optional<at::Tensor> w = (weight.has_value() && weight->defined()) ? weight : std::nullopt;
  std::optional<at::Tensor> b = (bias.has_value() && bias->defined()) ? bias : std::nullopt;
  return LayerNormNorms::apply(x, norms, w, b, shape.vec(), eps, upcast);
}

at::Tensor layer_norm_norms_forward_only(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                         const std::optional<at::Tensor>& bias, at::IntArrayRef shape, double eps,
                                         const at::Tensor&, bool upcast) {
  at::Tensor xc = upcast ? cast(x, at::promote_types(x.scalar_type(), at::kFloat)) : x;
  return std::get<0>(at::native_layer_norm(xc, shape, weight, bias, eps));
}

at::Tensor group_norm_norms_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                     int64_t groups, double eps, const at::Tensor& norms, bool upcast) {
  EL_CHECK(x.dim() >= 2, "group_norm_norms: per-example norms need a batch dimension first, got shape ",
           x.sizes());
  EL_CHECK(norms.dim() == 2 && norms.size(0) == 2 && norms.size(1) == x.size(0),
           "group_norm_norms: norms must be (2, B) = (2, ", x.size(0), "), got ", norms.sizes());
  return GroupNormNorms::apply(x, norms, weight, bias, groups, eps, upcast);
}

at::Tensor group_norm_norms_forward_only(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                         int64_t groups, double eps, const at::Tensor&, bool upcast) {
  if (!upcast) return at::group_norm(x, groups, weight, bias, eps);
  const auto dt = at::promote_types(x.scalar_type(), at::kFloat);
  return at::group_norm(cast(x, dt), groups, cast(weight, dt), cast(bias, dt), eps);
}

}  // namespace
}  // namespace fused
}  // namespace elasticlab

TORCH_LIBRARY_FRAGMENT(elasticlab, m) {
  m.def("layer_norm_norms(Tensor x, Tensor? weight, Tensor? bias, int[] normalized_shape, float eps, Tensor norms, "
        "bool upcast) -> Tensor");
  m.def("group_norm_norms(Tensor x, Tensor weight, Tensor bias, int groups, float eps, Tensor norms, bool upcast) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(elasticlab, Autograd, m) {
  m.impl("layer_norm_norms", &elasticlab::fused::layer_norm_norms_autograd);
  m.impl("group_norm_norms", &elasticlab::fused::group_norm_norms_autograd);
}

// Without autograd (inference mode): the layer's forward alone.
TORCH_LIBRARY_IMPL(elasticlab, CompositeExplicitAutograd, m) {
  m.impl("layer_norm_norms", &elasticlab::fused::layer_norm_norms_forward_only);
  m.impl("group_norm_norms", &elasticlab::fused::group_norm_norms_forward_only);
}
