// The fused nn.Linear as a C++ autograd function (operator elasticlab::linear_norms; see common.h).
#include "common.h"

namespace elasticlab {
namespace fused {
namespace {

// Sequence Linear: how the per-example weight-gradient norms are formed (the Python rule's choice).
enum LinearForm : int64_t { kOuter = 0, kGram = 1 };

// y = x Wᵀ + b. Backward: dx = g W; 2-D inputs ‖∇W ℓ_b‖² = ‖a_b‖²·‖g_b‖² (Goodfellow 2015); sequences
// G_b = Σ_t g_{b,t} a_{b,t}ᵀ by the outer form (its batch sum is the weight gradient) or the Gram form
// (Li et al. 2022), bias ‖Σ_t g_{b,t}‖².
struct LinearNorms : public torch::autograd::Function<LinearNorms> {
  // (Optional tensors go last: autograd numbers the inputs it was given, and an absent one is skipped.)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& norms, const std::optional<at::Tensor>& bias_opt, int64_t form,
                            std::optional<at::ScalarType> dtype) {
    const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
    at::Tensor xc = x, wc = weight, bc = bias;
    if (dtype.has_value()) {  // autocast: the layer runs in the autocast dtype, as F.linear would
      xc = cast(x, *dtype);
      wc = cast(weight, *dtype);
      bc = cast(bias, *dtype);
    }
    at::Tensor out = at::linear(xc, wc, bc.defined() ? std::optional<at::Tensor>(bc) : std::nullopt);
    // A sequence input's output is a view of the 2-D product at::linear forms; returned from a custom
    // function, an in-place op on it (h += r) would be refused. The product is seen by nothing else, so the
    // output takes its storage as a tensor of its own.
    if (out.is_view()) out = at::_unsafe_view(out, out.sizes());
    ctx->save_for_backward({xc, wc});
    ctx->saved_data["norms"] = norms;
    ctx->saved_data["form"] = form;
    ctx->saved_data["scratch"] = scratch_budget();  // the chunk budget in force now, for the backward
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(x.scalar_type()),
                                                     static_cast<int64_t>(weight.scalar_type()),
                                                     bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : -1};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // unpacked before the guard: an unpack hook may run the forward again (non-reentrant activation
    // checkpointing recomputes it there), which needs autograd to save its tensors
    auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;  // nothing here is differentiated again
    ScratchScope scratch(ctx->saved_data["scratch"].toInt());
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor norms = ctx->saved_data["norms"].toTensor();
    const int64_t form = ctx->saved_data["form"].toInt();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
               need_b = dtypes[2] >= 0 && ctx->needs_input_grad(3);
    at::Tensor g = cast(grads[0], x.scalar_type());
    at::Tensor gx, gw, gb;
    if (need_x) gx = cast(g.matmul(w), static_cast<at::ScalarType>(dtypes[0]));
    const int64_t B = x.size(0);
    const auto acc = acc_type(g.scalar_type());
    if (x.dim() == 2) {
      // both rows, ‖x_b‖²‖g_b‖² and ‖g_b‖², in one kernel (a row the layer does not need is not read), which
      // also sums the bias gradient when there is one: no launch beyond plain autograd's
      if (need_b) gb = put_products_bias(norms, x, g);
      else if (need_w) put_products(norms, x, g);
      if (need_w) gw = g.t().mm(x);
    } else {
      at::Tensor a = x.reshape({B, -1, x.size(-1)}), d = g.reshape({B, -1, g.size(-1)});
      if (need_w) {
        if (form == kGram) {
          put(norms, 0, gram_norms(a, d));
          gw = d.reshape({-1, d.size(2)}).t().mm(a.reshape({-1, a.size(2)}));
        } else {
          gw = outer_norms_into(a, d, norms, 0);
        }
      }
      if (need_b) {
        gb = put_batch_sum(norms, 1, d.sum({1}, false, acc));
      }
    }
    if (gw.defined()) gw = cast(gw, static_cast<at::ScalarType>(dtypes[1]));
    if (gb.defined() && dtypes[2] >= 0) gb = cast(gb, static_cast<at::ScalarType>(dtypes[2]));
    return {gx, gw, at::Tensor(), gb, at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear_norms_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& norms, int64_t form, std::optional<at::ScalarType> dtype) {
  EL_CHECK(form == kOuter || form == kGram, "linear_norms: form must be 0 (outer) or 1 (Gram), got ",
           form);
  EL_CHECK(x.dim() >= 2, "linear_norms: per-example norms need a batch dimension first, got shape ",
           x.sizes());
  EL_CHECK(norms.dim() == 2 && norms.size(0) == 2 && norms.size(1) == x.size(0),
           "linear_norms: norms must be (2, B) = (2, ", x.size(0), "), got ", norms.sizes());
  std::optional<at::Tensor> b = (bias.has_value() && bias->defined()) ? bias : std::nullopt;
  return LinearNorms::apply(x, weight, norms, b, form, dtype);
}

at::Tensor linear_norms_forward_only(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, const at::Tensor&, int64_t,
                                     std::optional<at::ScalarType> dtype) {
  if (!dtype.has_value()) return at::linear(x, weight, bias);
  std::optional<at::Tensor> bc = bias.has_value() ? std::optional<at::Tensor>(cast(*bias, *dtype)) : std::nullopt;
  return at::linear(cast(x, *dtype), cast(weight, *dtype), bc);
}

}  // namespace
}  // namespace fused
}  // namespace elasticlab

TORCH_LIBRARY_FRAGMENT(elasticlab, m) {
  m.def("linear_norms(Tensor x, Tensor weight, Tensor? bias, Tensor norms, int form, ScalarType? dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(elasticlab, Autograd, m) {
  m.impl("linear_norms", &elasticlab::fused::linear_norms_autograd);
}

// Without autograd (inference mode): the layer's forward alone.
TORCH_LIBRARY_IMPL(elasticlab, CompositeExplicitAutograd, m) {
  m.impl("linear_norms", &elasticlab::fused::linear_norms_forward_only);
}
