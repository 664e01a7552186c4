"""``_C``'s direct calls of the fused layers' operators (csrc/bindings.cpp) against torch.ops' boxed entry
(``kernels.USE_DIRECT_CALLS = False``): the same results, dispatch and errors; arguments the direct path
does not read (numpy scalars, wrong types), tensor subclasses and torch function modes go to torch.ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from elasticlab import _ext
from elasticlab.gns import PerSampleGradNorms, kernels

pytestmark = pytest.mark.skipif(_ext.direct_call("linear_norms") is None,
                                reason="elasticlab._C without the direct calls")
OPS = ("linear_norms", "conv_norms", "layer_norm_norms", "group_norm_norms")


class Net(nn.Module):
    """Every fused layer with a direct call: Conv2d → GroupNorm → LayerNorm → sequence and 2-D Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, stride=(1, 2))
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(6)
        self.seq = nn.Linear(6, 5)
        self.head = nn.Linear(5 * 4, 3)

    def forward(self, x):
        h = self.ln(torch.tanh(self.gn(self.conv(x))).flatten(1, 2))       # (B, 4·4, 6)
        h = torch.tanh(self.seq(h))[:, :4]
        return self.head(h.flatten(1))


def _run(direct: bool, x):
    torch.manual_seed(0)
    model = Net().double()
    calls = []
    real = kernels.cxx_autograd

    def spy(name, t):
        op = real(name, t)
        calls.append((name, op))
        return op
    old, kernels.USE_DIRECT_CALLS, kernels.cxx_autograd = kernels.USE_DIRECT_CALLS, direct, spy
    try:
        with PerSampleGradNorms(model) as n:
            model(x).pow(2).mean().backward()
            norms = n.sq_norms()
        return norms, {k: p.grad for k, p in model.named_parameters()}, calls
    finally:
        kernels.USE_DIRECT_CALLS, kernels.cxx_autograd = old, real


def test_direct_calls_give_the_boxed_entrys_norms_and_gradients():
    x = torch.randn(5, 2, 4, 12, dtype=torch.float64)
    got, g_direct, calls = _run(True, x)
    ref, g_boxed, calls_boxed = _run(False, x)
    names = {name for name, _ in calls}
    assert names == set(OPS)                                         # every op with a direct call ran
    assert all(op is _ext.direct_call(name) for name, op in calls)
    assert all(op is getattr(torch.ops.elasticlab, name) for name, op in calls_boxed)
    assert torch.isfinite(got).all() and got.shape == (5,)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for k in g_boxed:
        torch.testing.assert_close(g_direct[k], g_boxed[k], rtol=0, atol=0)


def _linear_args(requires_grad=True):
    x = torch.randn(4, 3, dtype=torch.float64)
    w = nn.Parameter(torch.randn(2, 3, dtype=torch.float64), requires_grad=requires_grad)
    b = nn.Parameter(torch.randn(2, dtype=torch.float64), requires_grad=requires_grad)
    return x, w, b, torch.zeros(2, 4, dtype=torch.float64)


def test_direct_linear_norms_writes_the_rows_like_the_boxed_entry():
    direct = _ext.direct_call("linear_norms")
    outs = []
    for op in (direct, torch.ops.elasticlab.linear_norms):
        torch.manual_seed(1)
        x, w, b, buf = _linear_args()
        y = op(x, w, b, buf, 0, None)
        assert type(y.grad_fn).__name__ == "CppFunction"
        y.pow(2).sum().backward()
        outs.append((y.detach(), buf, w.grad, b.grad))
    for got, ref in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_direct_call_rows_are_the_per_example_norms():
    torch.manual_seed(2)
    x, w, b, buf = _linear_args()
    y = _ext.direct_call("linear_norms")(x, w, b, buf, 0, None)
    y.pow(2).sum().backward()
    g = 2 * y.detach()                                                  # d(Σ y²)/dy
    torch.testing.assert_close(buf[0], x.pow(2).sum(1) * g.pow(2).sum(1))   # ‖a_b‖²‖g_b‖² (Goodfellow)
    torch.testing.assert_close(buf[1], g.pow(2).sum(1))


def _same_outcome(name, args):
    """The direct call and torch.ops' entry on the same arguments: equal results, or the same error."""
    outs = []
    for op in (_ext.direct_call(name), getattr(torch.ops.elasticlab, name).default):
        try:
            outs.append(("ok", op(*args)))
        except Exception as e:                                  # noqa: BLE001 - compared below
            outs.append((type(e), str(e)))
    (kind, got), (kind_ref, ref) = outs
    assert kind == kind_ref, outs
    if kind == "ok":
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    else:
        assert got == ref
    return kind


@pytest.mark.parametrize("args", [
    lambda x, w, b, n: (x, w, b, n, 0.5, None),                   # a float form
    lambda x, w, b, n: (x.numpy(), w, b, n, 0, None),             # an array for a tensor
    lambda x, w, b, n: (x, w, b, n, 0, "bf16"),                   # a string for a dtype
    lambda x, w, b, n: (x, w, b, n, 0),                           # one argument short
    lambda x, w, b, n: (x, w, b, n, 1 << 70, None),               # out of int64's range
])
def test_bad_arguments_get_torch_ops_own_error(args):
    assert _same_outcome("linear_norms", args(*_linear_args())) != "ok"


def test_bad_list_float_and_bool_arguments_get_torch_ops_own_error():
    x, w, b = torch.randn(2, 3, 5), torch.randn(5), torch.randn(5)
    buf = torch.zeros(2, 2)
    for args in [(x, w, b, [5.0], 1e-5, buf, False), (x, w, b, [5], "eps", buf, False)]:
        assert _same_outcome("layer_norm_norms", args) != "ok", args
    y = _ext.direct_call("layer_norm_norms")(x, w, b, [5], 1, buf, False)      # an int eps is a float
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, [5], w, b, 1.0))


def test_other_types_torch_ops_converts_give_its_result():
    """A bool for an int, a numpy bool or a float for a bool, an int for an int list: whatever torch.ops
    does with them, the direct call does."""
    _same_outcome("linear_norms", (*_linear_args(), True, None))
    x, wl, bl = torch.randn(2, 3, 5), torch.randn(5), torch.randn(5)
    for shape, upcast in [((5,), np.bool_(False)), (5, False), ([5], 2.5)]:
        _same_outcome("layer_norm_norms", (x, wl, bl, shape, 1e-5, torch.zeros(2, 2), upcast))


def test_numpy_scalars_and_int_eps_work_as_through_torch_ops():
    """Module attributes may be numpy scalars (nn.GroupNorm(np.int64(2), C), eps=np.float32(...)): what
    torch.ops converts, the direct call hands to it."""
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    buf = torch.zeros(2, 3, dtype=torch.float64)
    assert _same_outcome("group_norm_norms", (x, w, b, np.int64(2), np.float32(1e-5), buf, False)) == "ok"
    wl, bl = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert _same_outcome("layer_norm_norms", (x, wl, bl, [np.int64(5)], 1, buf, False)) == "ok"
    xi, wi, bi, n = _linear_args()
    assert _same_outcome("linear_norms", (xi, wi, bi, n, np.int64(0), None)) == "ok"


def test_direct_call_passes_the_operators_own_checks_through():
    x, w, b, _ = _linear_args()
    with pytest.raises(RuntimeError, match=r"norms must be \(2, B\) = \(2, 4\), got \[3, 4\]"):
        _ext.direct_call("linear_norms")(x, w, b, torch.zeros(3, 4, dtype=torch.float64), 0, None)


class Tagged(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_goes_through_torch_ops_entry():
    x, w, b, buf = _linear_args()
    Tagged.seen = []
    y = _ext.direct_call("linear_norms")(x.as_subclass(Tagged), w, b, buf, 0, None)
    assert any("linear_norms" in s for s in Tagged.seen)                # its __torch_function__ saw the op
    torch.testing.assert_close(y.as_subclass(torch.Tensor), x @ w.T + b)


def test_a_torch_function_mode_sees_the_call():
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w, b, buf = _linear_args()
    with Spy():
        _ext.direct_call("linear_norms")(x, w, b, buf, 0, None)
    assert any("linear_norms" in s for s in seen)


def test_the_profiler_records_the_operator():
    x, w, b, buf = _linear_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _ext.direct_call("linear_norms")(x, w, b, buf, 0, None)
    assert "elasticlab::linear_norms" in {e.key for e in prof.key_averages()}
