"""A bias without the batch added to attention scores whose dim 0 folds the batch with windows: Swin's
relative position bias (Liu et al. 2021, eq. 4), (1, H, N, N), on the (B·nW, H, N, N) scores of its
windows, alone or (shifted windows) first added to a constant mask of B·nW rows (gns.layers.broadcast_params
with gns.folds). Each case against one backward per example in float64; before, the readers raised "ran
without the batch ... and that output is used by scaled_dot_product_attention"."""
import pytest
import torch
import torch.nn.functional as F
from layer_check import eager_then_compiled, on_device
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms


class RelativeBias(nn.Module):
    """A table of (2N−1) relative offsets by H heads, read out as (1, H, N, N): a leaf called on no batch."""

    def __init__(self, H, N):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * N - 1, H))
        i = torch.arange(N)
        self.register_buffer("index", (i[:, None] - i[None, :] + N - 1), persistent=False)

    def forward(self):
        return self.table[self.index].permute(2, 0, 1).unsqueeze(0)


class WindowAttention(nn.Module):
    """Tokens (B, nW·N, D) cut into nW windows of N, attention within each window of the B·nW rows."""

    def __init__(self, D=4, H=2, N=3, nW=2, shifted=False, sdpa=True, time_major=False):
        super().__init__()
        self.D, self.H, self.N, self.nW = D, H, N, nW
        self.shifted, self.sdpa, self.time_major = shifted, sdpa, time_major
        self.inp, self.q, self.k, self.v, self.o = (nn.Linear(3 if i == 0 else D, D) for i in range(5))
        self.bias, self.head = RelativeBias(H, N), nn.Linear(D, 2)
        self.register_buffer("mask", torch.randn(nW, N, N))

    def forward(self, x):
        B, (D, H, N, nW) = x.shape[0], (self.D, self.H, self.N, self.nW)
        h = self.inp(x).view(B, nW, N, D)
        w = (h.transpose(0, 1) if self.time_major else h).reshape(B * nW, N, D)

        def heads(t):
            return t.view(B * nW, N, H, D // H).transpose(1, 2)
        q, k, v = heads(self.q(w)), heads(self.k(w)), heads(self.v(w))
        mask = self.bias()
        if self.shifted:
            const = self.mask.unsqueeze(1).unsqueeze(0).expand(B, -1, -1, -1, -1).reshape(-1, 1, N, N)
            if self.time_major:
                const = self.mask.unsqueeze(1).unsqueeze(1).expand(-1, B, -1, -1, -1).reshape(-1, 1, N, N)
            mask = mask + const
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = torch.softmax(q @ k.transpose(-1, -2) * (D // H) ** -0.5 + mask, dim=-1) @ v
        a = self.o(a.transpose(1, 2).reshape(B * nW, N, D))
        a = a.view(nW, B, N, D).transpose(0, 1) if self.time_major else a.view(B, nW, N, D)
        return self.head(a.mean((1, 2)))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _check(model, x, y, fused):
    want = example_param_sq_norms(model, (_loss(model(x[b:b + 1]), y[b:b + 1]) for b in range(len(x))))
    with PerSampleGradNorms(model, fused=fused, loss_reduction="sum") as psg:
        _loss(model(x), y).backward()
        got = psg.param_sq_norms()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)
    return got


@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_window_bias_matches_per_example_backward(fused, shifted, sdpa):
    torch.manual_seed(0)
    model = WindowAttention(shifted=shifted, sdpa=sdpa).double()
    got = _check(model, torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,)), fused)
    assert (got["bias.table"] > 0).all()


@pytest.mark.parametrize("shifted", [False, True])
def test_windows_folded_time_major(shifted):
    """Rows j·B + b (the windows first): each example's rows are summed all the same."""
    torch.manual_seed(1)
    model = WindowAttention(shifted=shifted, time_major=True).double()
    _check(model, torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,)), fused=True)


def test_constant_rows_that_are_not_windows_stay_exact():
    """A parameter added to a constant whose dim 0 (10 positions) happens to be a multiple of the batch (5),
    then broadcast over the batch as a whole: followed as a tensor made from the parameter, as before."""
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.inp, self.head = nn.Parameter(torch.randn(4)), nn.Linear(3, 4), nn.Linear(4, 2)
            self.register_buffer("grid", torch.randn(10, 4))

        def forward(self, x):
            return self.head(torch.tanh(self.inp(x) + (self.pos + self.grid)).mean(1))

    torch.manual_seed(2)
    model = Positions().double()
    _check(model, torch.randn(5, 10, 3, dtype=torch.float64), torch.randint(0, 2, (5,)), fused=True)


def test_rows_whose_layout_is_not_found_are_named():
    """The bias with the shifted mask meets a query whose rows' layout the graph does not show (a constant):
    the readers raise naming the table, rather than read the rows wrongly."""
    class Opaque(WindowAttention):
        def forward(self, x):
            B, N = x.shape[0], self.N
            const = self.mask.unsqueeze(1).unsqueeze(0).expand(B, -1, -1, -1, -1).reshape(-1, 1, N, N)
            q = torch.randn(B * self.nW, self.H, N, 2, dtype=x.dtype)
            v = self.v(self.inp(x)).view(B * self.nW, N, self.H, 2).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, v, attn_mask=self.bias() + const)
            a = a.transpose(1, 2).reshape(B * self.nW, N, self.D).mean(1)
            return self.head(a.view(B, self.nW, self.D).mean(1))

    model = Opaque().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        _loss(model(torch.randn(5, 6, 3, dtype=torch.float64)), torch.randint(0, 2, (5,))).backward()
        with pytest.raises(RuntimeError, match="bias"):
            psg.param_sq_norms()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_on_the_device_under_autocast(device, autocast):
    """Shifted windows by SDPA in float32 or bf16 autocast on the device (CUDA: the efficient attention's
    backward node, which folds.find follows by its query)."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 6, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    on_device(WindowAttention(shifted=True), x, y, _loss, device, autocast)


def _compiled_after_eager(model, xs, y, fused):
    """One eager step on ``xs[0]``, then compiled (aot_eager) ones on each of ``xs``."""
    eager_then_compiled(model, lambda m, x, s: _loss(m(x[s]), y[:len(x)][s]), xs[:1], xs, fused=fused,
                        loss_reduction="sum")


@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_window_bias_under_compile_after_an_eager_step(fused, shifted, sdpa):
    """Under torch.compile the bias is not followed; an eager step learned that it meets the batch only on
    rows that fold it with windows (alone or through the shifted mask), batch-major, 2 per example: the
    compiled steps expand its output over the batch, repeat it to each example's rows and take the vjp of
    its forward at each example's gradient, summed over its rows; exact at the eager step's batch and at a
    smaller one, an epoch's last (before: refused by name at every compiled step, eager step or not)."""
    torch.manual_seed(0)
    model = WindowAttention(shifted=shifted, sdpa=sdpa).double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    _compiled_after_eager(model, (x, x[:3]), y, fused)


@pytest.mark.parametrize("shifted", [False, True])
def test_window_bias_time_major_under_compile_after_an_eager_step(shifted):
    """Rows j·B + b: the repetition under compile follows the layout the eager step found."""
    torch.manual_seed(1)
    model = WindowAttention(shifted=shifted, time_major=True).double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    _compiled_after_eager(model, (x, x[:4]), y, True)


def test_window_bias_under_compile_at_another_input_shape_is_named():
    """More windows than the eager step saw (the rows per example come from the input's shape): refused by
    name, rather than repeated to the wrong rows (a shape error inside the compiled graph)."""
    class Resizable(WindowAttention):
        def forward(self, x):
            self.nW = x.shape[1] // self.N
            return super().forward(x)

    torch.manual_seed(2)
    model = Resizable().double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with pytest.raises(RuntimeError, match=r"module 'bias' \(RelativeBias\) ran without the batch .* for "
                                           r"inputs of shape \(B, 6, 3\), and this one is \(5, 9, 3\)"):
        _compiled_after_eager(model, (x, torch.randn(5, 9, 3, dtype=torch.float64)), y, True)
