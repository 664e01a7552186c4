"""A module with bare parameters of its own that reads its children's weights without calling them (HF's
MambaMixer: F.conv1d on ``self.conv1d.weight``, ``self.dt_proj.weight @ x``): those uses are taken per
example by the parent's followed forward (gns.layers.broadcast_params, Step.through) and recorded in the
children's slots. Against one backward per example in float64 (before: "the loss depends on [...] but their
modules ... never ran")."""
import pytest
import torch
import torch.nn.functional as F
from layer_check import against_per_example, on_device
from torch import nn

from elasticlab.gns import PerSampleGradNorms


class Mixer(nn.Module):
    """Mamba's mixer in small: a child called (inp), a depthwise causal conv and a projection read directly,
    a Linear read by F.linear, and bare parameters of its own (A_log, D) broadcast over the batch."""

    def __init__(self, D=4, C=6, r=2, k=3, call_fc=False):
        super().__init__()
        self.inp = nn.Linear(3, C)
        self.conv1d = nn.Conv1d(C, C, k, groups=C, padding=k - 1)
        self.dt_proj = nn.Linear(r, C)
        self.x_proj = nn.Linear(C, r)
        self.fc = nn.Linear(C, D)
        self.A_log = nn.Parameter(torch.randn(C))
        self.D = nn.Parameter(torch.randn(C))
        self.head = nn.Linear(D, 2)
        self.call_fc = call_fc

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)                               # (B, C, T)
        T = h.shape[-1]
        w = self.conv1d.weight.squeeze(1)                             # (C, k), as HF hands it on
        h = F.silu(F.conv1d(h, w.unsqueeze(1), self.conv1d.bias, padding=w.shape[-1] - 1,
                            groups=h.shape[1])[:, :, :T])
        dt = self.dt_proj.weight @ self.x_proj(h.transpose(1, 2)).transpose(1, 2)    # (C, r) @ (B, r, T)
        dt = F.softplus(dt + self.dt_proj.bias.to(h.dtype)[..., None])
        y = h * torch.exp(-torch.exp(self.A_log)[None, :, None] * dt) + h * self.D[None, :, None]
        y = y.transpose(1, 2)
        out = self.fc(y) if self.call_fc else F.linear(y, self.fc.weight, self.fc.bias)
        return self.head(torch.tanh(out).mean(1))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


@pytest.mark.parametrize("fused", [True, False])
def test_children_read_directly_match_per_example_backward(fused):
    torch.manual_seed(0)
    model = Mixer().double()
    x, y = torch.randn(5, 7, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    against_per_example(model, lambda s: _loss(model(x[s]), y[s]), 5, fused=fused, loss_reduction="sum",
                        complete=True)
    # the real gradients are untouched by the following
    ref = Mixer().double()
    ref.load_state_dict(model.state_dict())
    _loss(ref(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)


def test_a_child_called_and_read_directly_is_named():
    """fc both called and read by F.linear: the two per-example gradients are taken apart, and the norm of
    their sum is not known: the readers raise naming fc's weight."""
    class Both(Mixer):
        def forward(self, x):
            a = self.inp(x)
            return self.head(torch.tanh(self.fc(a) + F.linear(a, self.fc.weight)).mean(1)) + 0 * self.D.sum()

    model = Both().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        _loss(model(torch.randn(5, 7, 3, dtype=torch.float64)), torch.randint(0, 2, (5,))).backward()
        with pytest.raises(RuntimeError, match=r"'fc\.weight' is used both by calling its module"):
            psg.param_sq_norms()


def test_a_product_over_the_batch_is_refused():
    """A child's weight multiplied with the batch along dim 0 (W (C, B) @ x (B, T)) mixes the examples: not a
    layer's op per example, so the readers raise naming the weight."""
    class Over(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.inp = nn.Linear(5, 4), nn.Linear(3, 6)
            self.s = nn.Parameter(torch.ones(6))

        def forward(self, x):
            h = self.inp(x) * self.s                                  # (B, 6)
            return (self.mix.weight @ h).sum(0)                       # (4, B) @ ... contracts over B

    model = Over().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        model(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum().backward()
        with pytest.raises(RuntimeError, match=r"'mix\.weight', read by module '\(root\)' \(Over\) without "
                           "calling 'mix', is used by Tensor.matmul"):
            psg.param_sq_norms()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_on_the_device_under_autocast(device, autocast):
    """Children's weights read by the parent in float32 or bf16 autocast on the device."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 7, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    on_device(Mixer(), x, y, _loss, device, autocast)


class RelShift(nn.Module):
    """Funnel's relative attention in small: a bare kernel by einsum with the batch, its product reshaped and
    sliced (views), then scaled in place through the view."""

    def __init__(self, D=4, H=2, d=3):
        super().__init__()
        self.q, self.head = nn.Linear(3, H * d), nn.Linear(H * 5, 2)
        self.r_kernel = nn.Parameter(torch.randn(D, H, d))
        self.H, self.d = H, d
        self.register_buffer("r", torch.randn(6, D))

    def forward(self, x):
        B, T = x.shape[:2]
        q = self.q(x).view(B, T, self.H, self.d)
        r_head = torch.einsum("td,dnh->tnh", self.r, self.r_kernel)       # (made from the kernel alone)
        att = torch.einsum("binh,tnh->bnit", q, r_head)                     # (B, H, T, 6): a view
        att = att.reshape(B, self.H, -1)[:, :, : T * 5].view(B, self.H, T, 5)
        att *= 0.5                                                          # in place, through the views
        return self.head(torch.tanh(att).mean(2).flatten(1))


def test_einsum_with_in_place_ops_on_its_product():
    torch.manual_seed(5)
    model = RelShift().double()
    x, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    against_per_example(model, lambda s: _loss(model(x[s]), y[s]), 5, loss_reduction="sum")


def test_a_followed_use_no_tap_took_is_an_error(monkeypatch):
    """Were a use of a followed parameter to reach the loss untaken (here: Step.through made to hook
    nothing), the parameter's .grad is probed, and the readers raise naming it rather than leave it out."""
    from elasticlab.gns.layers.broadcast_taps import Step
    monkeypatch.setattr(Step, "through", lambda self, func, args, kwargs, *rest: func(*args, **kwargs))
    model = RelShift().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        _loss(model(torch.randn(5, 4, 3, dtype=torch.float64)), torch.randint(0, 2, (5,))).backward()
        with pytest.raises(RuntimeError, match=r"\['r_kernel'\], which were followed through the forward"):
            psg.param_sq_norms()
