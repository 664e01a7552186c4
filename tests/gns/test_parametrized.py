"""The originals of parametrized tensors (gns.layers.parametrized): weight_norm on a Linear and on wav2vec
2.0's grouped positional convolution, orthogonal, a parametrization of one's own, and a parametrized layer
called twice in a forward. Each against one backward per example in float64 (before: "are the originals of a
parametrization ... no rule maps them back")."""
import pytest
import torch
import torch.nn.functional as F
from layer_check import on_device
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(0, 1)


class PosConv(nn.Module):
    """wav2vec 2.0's positional embedding: a grouped Conv1d with weight_norm over dim 2, GELU, added back."""

    def __init__(self, D=8, k=5, groups=2):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.conv = parametrizations.weight_norm(nn.Conv1d(D, D, k, padding=k // 2, groups=groups), dim=2)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.inp(x)
        h = h + F.gelu(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h.mean(1))


class Parametrized(nn.Module):
    """weight_norm on a sequence Linear, orthogonal on another, a symmetric one of one's own, a weight-normed
    Linear called twice."""

    def __init__(self, D=4):
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(3, D))
        self.b = parametrizations.orthogonal(nn.Linear(D, D))
        self.c = nn.Linear(D, D)
        parametrize.register_parametrization(self.c, "weight", Symmetric())
        self.twice = parametrizations.weight_norm(nn.Linear(D, D))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(self.a(x)))))
        return self.head(self.twice(torch.tanh(self.twice(h))).mean(1))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


@pytest.mark.parametrize("make", [PosConv, Parametrized])
@pytest.mark.parametrize("fused", [True, False])
def test_originals_match_per_example_backward(make, fused):
    torch.manual_seed(0)
    model = make().double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    want = example_param_sq_norms(model, (_loss(model(x[b:b + 1]), y[b:b + 1]) for b in range(5)))
    for _ in range(2):                          # (a repeated layer runs on its hooks from the second step)
        with PerSampleGradNorms(model, fused=fused, loss_reduction="sum") as psg:
            model.zero_grad()
            _loss(model(x), y).backward()
            got = psg.param_sq_norms()
    assert set(got) == set(want) and any("original" in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)


def test_weight_norm_under_a_mean_reduced_loss():
    """A mean-reduced loss: the originals' norms are those of the summed loss's per-example gradients (the
    B² rescaling applies to them as to every layer's)."""
    torch.manual_seed(1)
    model = PosConv().double()
    x, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    want = example_param_sq_norms(model, (_loss(model(x[b:b + 1]), y[b:b + 1]) for b in range(4)))
    with PerSampleGradNorms(model) as psg:
        F.cross_entropy(model(x), y).backward()
        got = psg.param_sq_norms()
    k = "conv.parametrizations.weight.original1"
    torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_on_the_device_under_autocast(device, autocast):
    """A weight-normed grouped convolution in float32 or bf16 autocast on the device."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 6, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    on_device(PosConv(), x, y, _loss, device, autocast)
