// Kernel declarations of elasticlab._C. Kernels live in csrc/cpu and csrc/cuda, the operator
// schemas in csrc/registry.cpp, the per-device registrations in csrc/*/dispatch_*.cpp, and the
// Python module in csrc/bindings.cpp.
#pragma once
#include <ATen/ATen.h>
#include <atomic>
#include <string>
#include <string_view>
#include <type_traits>
#include <tuple>

#define EL_CHECK(cond, ...) TORCH_CHECK(cond, ::elasticlab::message(__VA_ARGS__))

namespace elasticlab {

// Half-precision inputs (bfloat16, float16) are accumulated in float32; every kernel returns its norms (and
// the outer form's gradient) in acc_type(input dtype).
inline bool is_reduced_float(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }
inline at::ScalarType acc_type(at::ScalarType t) { return is_reduced_float(t) ? at::kFloat : t; }

// Error messages: EL_CHECK(cond, parts...) is TORCH_CHECK(cond, message(parts...)), where message() writes
// integers and floats by std::to_string, shapes (anything an IntArrayRef takes) as "[2, 3]", and passes the
// rest (text, dtypes, devices) to c10::str. No number reaches std::ostream's numeric output: on the H100
// machine (torch 2.11, its GCC 13 build) every TORCH_CHECK of ours that streamed an int64_t or a shape crashed
// the process with SIGSEGV instead of raising, where those streaming only text and dtypes raised (session 10).
// Like TORCH_CHECK's, the parts are evaluated only when the check fails. Every check in csrc/ is an EL_CHECK
// (tests/test_csrc_messages.py).
inline std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

template <typename T>
std::string message_part(const T& v) {
  if constexpr (std::is_integral_v<T> || std::is_floating_point_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_convertible_v<const T&, at::IntArrayRef> &&
                       !std::is_convertible_v<const T&, std::string_view>) {
    return shape_str(v);
  } else {
    return c10::str(v);
  }
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_part(parts)), ...);
  return out;
}

// TF32 tensor cores for float32 per-example GEMMs (cuBLAS, csrc/cuda/blas.cpp), per thread: -1 (the default) as
// torch's matmul setting says, since a Linear's weight gradient is a cuBLAS matmul; 0 off, 1 on. A convolution's
// backward sets it while it runs (Tf32Scope) from cuDNN's convolution setting, which its weight gradient follows
// (TF32 by default), so that its norms take the precision and speed of the gradient they measure.
inline thread_local int tf32_mode = -1;

// Scratch budget (bytes) of the CUDA forms' chunked per-example products and Grams (csrc/cuda/outer_norms.cu,
// gram_norms.cu): a chunk holds as many examples as fit. Process-wide; Python sets it from
// elasticlab.gns.form_choice.SCRATCH_CAP (form_choice.scratch_cap), which its memory rule models.
inline std::atomic<int64_t> scratch_bytes{int64_t(256) << 20};
// A layer's own budget while its backward runs on this thread (ScratchScope; 0: none): the budget in force at
// its forward (the fused Linear keeps it), which Python sets for a layer whose outer form it chunks to the
// memory rule's share (elasticlab.gns.form_choice.CHUNK_TO_SHARE).
inline thread_local int64_t scratch_scope = 0;
inline int64_t scratch_budget() {
  return scratch_scope > 0 ? scratch_scope : scratch_bytes.load(std::memory_order_relaxed);
}

// A per-thread setting changed for a scope and put back at its end (the scopes below).
template <typename T>
class ThreadSetting {
 public:
  ThreadSetting(T& setting, T value) : setting_(setting), prev_(setting) { setting_ = value; }
  ~ThreadSetting() { setting_ = prev_; }
  ThreadSetting(const ThreadSetting&) = delete;
  ThreadSetting& operator=(const ThreadSetting&) = delete;

 private:
  T& setting_;
  T prev_;
};

struct ScratchScope : ThreadSetting<int64_t> {
  explicit ScratchScope(int64_t bytes) : ThreadSetting(scratch_scope, bytes) {}
};

struct Tf32Scope : ThreadSetting<int> {
  explicit Tf32Scope(int mode) : ThreadSetting(tf32_mode, mode) {}
};

// Examples [b0, b0 + c) of a batch-first tensor: the tensor itself when that is all of them (a chunked loop's
// only chunk, the common case, then dispatches no narrow).
inline at::Tensor batch_rows(const at::Tensor& t, int64_t b0, int64_t c) {
  return (b0 == 0 && c == t.size(0)) ? t : t.narrow(0, b0, c);
}

// The product of a (B, C, *spatial) tensor's spatial sizes.
inline int64_t spatial_size(const at::Tensor& x) {
  int64_t S = 1;
  for (int64_t i = 2; i < x.dim(); ++i) S *= x.size(i);
  return S;
}

// Per-row squared L2 norm of a tensor viewed as (B, -1): out[b] = sum_j x[b, j]^2 (in acc_type). The _out
// form writes into a given (B,) tensor of acc_type (any stride, e.g. a row of the fused layers' norms buffer).
at::Tensor row_sq_norms_cpu(const at::Tensor& x);
at::Tensor& row_sq_norms_out_cpu(const at::Tensor& x, at::Tensor& out);

// A Linear layer on 2-D inputs a (B, Din) with output gradients d (B, Dout): the product of norms (Goodfellow
// 2015) into a (2, B) buffer of acc_type, out[0, b] = |a_b|^2 |d_b|^2 (weight), out[1, b] = |d_b|^2 (bias), in
// one pass over both rows (any strides of out).
at::Tensor& product_norms_out_cpu(const at::Tensor& a, const at::Tensor& d, at::Tensor& out);
// The same rows, and the Linear's bias gradient sum_b d_b (Dout,) in acc_type returned, in one pass (on CUDA
// one launch: the bias gradient of plain autograd is one reduction too, so the norms add no launch).
at::Tensor product_bias_norms_cpu(const at::Tensor& a, const at::Tensor& d, at::Tensor& out);

// Per-example gradients x (B, D) of float or double, e.g. a bias' (Σ_t d_{b,t}): their batch sum (D,) returned
// and |x_b|^2 written into a given (B,) tensor of x's dtype (any stride: a row of the fused layers' buffer). On
// CUDA one launch, where a sum, a norm and a copy were three.
at::Tensor batch_sum_norms_cpu(const at::Tensor& x, at::Tensor& norms);

// Per-example squared Frobenius norm of G_b = sum_t d[b,t] a[b,t]^T for a (B,T,Din), d (B,T,Dout),
// by the Gram form sum_{t,s} (a_t.a_s)(d_t.d_s) (Li et al. 2022 ghost norm). Returns (B,).
at::Tensor seq_linear_gram_norms_cpu(const at::Tensor& a, const at::Tensor& d);

// The same norms by the outer-product form, tile by tile; with_grad also returns sum_b G_b (Dout, Din)
// (the weight gradient), otherwise an empty tensor. Returns (norms (B,), grad).
std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cpu(const at::Tensor& a, const at::Tensor& d,
                                                              bool with_grad);
// The same with the norms written into a given (B,) tensor of acc_type (any stride: a row of the fused layers'
// buffer, no copy on CUDA); returns the gradient (or an empty tensor).
at::Tensor seq_linear_outer_norms_out_cpu(const at::Tensor& a, const at::Tensor& d, bool with_grad,
                                          at::Tensor& norms);

// Per-example LayerNorm parameter gradients (Gray et al. 2024): x, d (B,T,D), mean, rstd (B,T).
// Returns (gw (B,D) = sum_t d_t * (x_t - mean_t) * rstd_t, gb (B,D) = sum_t d_t).
std::tuple<at::Tensor, at::Tensor> layernorm_per_example_cpu(const at::Tensor& x, const at::Tensor& d,
                                                             const at::Tensor& mean, const at::Tensor& rstd);

// Normalisation layers' affine parameters, per-example gradients and norms in one operator: the batch sums
// (gw, gb) (D,) or (C,) in acc_type are returned, and norms (2, B) of acc_type gets row 0 |pw_b|^2 and row 1
// |pb_b|^2 of the per-example gradients pw_b, pb_b (never returned). LayerNorm (Gray et al. 2024): x, d
// (B,T,D), mean, rstd (B,T). GroupNorm (Wu & He 2018): x, d (B,C,S) (S the spatial size), mean, rstd (B,G)
// of acc_type, pw_{b,c} = sum_s d x_hat, pb_{b,c} = sum_s d (x, d may also be (B,C,H,W...): S their product).
std::tuple<at::Tensor, at::Tensor> layernorm_affine_norms_cpu(const at::Tensor& x, const at::Tensor& d,
                                                              const at::Tensor& mean, const at::Tensor& rstd,
                                                              at::Tensor& norms);
std::tuple<at::Tensor, at::Tensor> groupnorm_affine_norms_cpu(const at::Tensor& x, const at::Tensor& d,
                                                              const at::Tensor& mean, const at::Tensor& rstd,
                                                              int64_t groups, at::Tensor& norms);

// im2col of a zero-padded Conv1d/Conv2d input x (B, C, [H,] W), any strides, as (B, L, C·k) contiguous and
// position-major (the layout of a sequence Linear's input; columns ordered (channel, kernel offsets) like
// weight.view(Cout, -1)), in one pass: out[b, l, (c, i, j)] = x[b, c, oh·sh − ph + i·dh, ow·sw − pw + j·dw], zero
// outside. The geometry lists have one entry per spatial dimension.
struct PatchGeometry {
  int64_t B, C, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t xb, xc, xy, xx;  // the input's element strides over (B, C, H, W); xy = 0 for a Conv1d input
  int64_t L() const { return Ho * Wo; }
  int64_t K() const { return C * kh * kw; }
};
at::Tensor conv_patches_cpu(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation);

// Shared argument checks (csrc/cpu/checks.cpp), raising errors that name the bad shapes.
void check_row_sq_args(const at::Tensor& x);
void check_row_sq_out(const at::Tensor& x, const at::Tensor& out);
void check_product_args(const at::Tensor& a, const at::Tensor& d, const at::Tensor& out);
void check_seq_args(const char* op, const at::Tensor& a, const at::Tensor& d);
void check_layernorm_args(const at::Tensor& x, const at::Tensor& d, const at::Tensor& mean, const at::Tensor& rstd);
void check_groupnorm_args(const at::Tensor& x, const at::Tensor& d, const at::Tensor& mean, const at::Tensor& rstd,
                          int64_t groups);
void check_norms_buffer(const char* op, const at::Tensor& x, const at::Tensor& norms);
void check_norms_row(const char* op, const at::Tensor& x, const at::Tensor& norms);
void check_batch_sum_args(const at::Tensor& x, const at::Tensor& norms);
PatchGeometry check_patches_args(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                                 at::IntArrayRef padding, at::IntArrayRef dilation);

#ifdef ELASTICLAB_WITH_CUDA
at::Tensor conv_patches_cuda(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation);
at::Tensor row_sq_norms_cuda(const at::Tensor& x);
at::Tensor& row_sq_norms_out_cuda(const at::Tensor& x, at::Tensor& out);
at::Tensor& product_norms_out_cuda(const at::Tensor& a, const at::Tensor& d, at::Tensor& out);
at::Tensor product_bias_norms_cuda(const at::Tensor& a, const at::Tensor& d, at::Tensor& out);
at::Tensor batch_sum_norms_cuda(const at::Tensor& x, at::Tensor& norms);
at::Tensor seq_linear_gram_norms_cuda(const at::Tensor& a, const at::Tensor& d);
std::tuple<at::Tensor, at::Tensor> seq_linear_outer_norms_cuda(const at::Tensor& a, const at::Tensor& d,
                                                               bool with_grad);
at::Tensor seq_linear_outer_norms_out_cuda(const at::Tensor& a, const at::Tensor& d, bool with_grad,
                                           at::Tensor& norms);
std::tuple<at::Tensor, at::Tensor> layernorm_per_example_cuda(const at::Tensor& x, const at::Tensor& d,
                                                              const at::Tensor& mean, const at::Tensor& rstd);
std::tuple<at::Tensor, at::Tensor> layernorm_affine_norms_cuda(const at::Tensor& x, const at::Tensor& d,
                                                               const at::Tensor& mean, const at::Tensor& rstd,
                                                               at::Tensor& norms);
std::tuple<at::Tensor, at::Tensor> groupnorm_affine_norms_cuda(const at::Tensor& x, const at::Tensor& d,
                                                               const at::Tensor& mean, const at::Tensor& rstd,
                                                               int64_t groups, at::Tensor& norms);
#endif

}  // namespace elasticlab
