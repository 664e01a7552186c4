"""Layers called with their inputs by keyword (``lin(input=x)``, ``cell(input=x, hx=h)``, ``norm(x=x)``), as
their own forwards allow: the same per-example norms as positional calls, against per-example autograd in
float64, on the fused and the hook paths, for a tied table called so too, and under torch.compile."""
import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms

B = 3


class ByKeyword(nn.Module):
    """``layer`` called with ``make(x)`` as keyword arguments, its output (or its first) summed per example
    into one feature, then a Linear head."""

    def __init__(self, layer, make):
        super().__init__()
        self.layer, self.make = layer, make

    def forward(self, x):
        y = self.layer(**self.make(x))
        y = y[0] if isinstance(y, tuple) else y
        return y.reshape(y.shape[0], -1).tanh().sum(1, keepdim=True)


CASES = {
    "linear": (lambda: nn.Linear(4, 5), lambda x: {"input": x}, (B, 2, 4)),
    "conv1d": (lambda: nn.Conv1d(4, 3, 3), lambda x: {"input": x}, (B, 4, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), lambda x: {"input": x}, (B, 4, 5)),
    "layernorm": (lambda: nn.LayerNorm(4), lambda x: {"input": x}, (B, 2, 4)),
    "rmsnorm": (lambda: nn.RMSNorm(4), lambda x: {"x": x}, (B, 2, 4)),
    "prelu": (lambda: nn.PReLU(4), lambda x: {"input": x}, (B, 4, 3)),
    "bilinear": (lambda: nn.Bilinear(4, 4, 2), lambda x: {"input1": x, "input2": x.flip(1)}, (B, 4)),
    "grucell": (lambda: nn.GRUCell(4, 3), lambda x: {"input": x, "hx": x[:, :3].cos()}, (B, 4)),
    "lstmcell": (lambda: nn.LSTMCell(4, 3), lambda x: {"input": x}, (B, 4)),
    "embedding": (lambda: nn.Embedding(7, 3), lambda x: {"input": (x.abs() * 3).long() % 7}, (B, 4)),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_keyword_call_matches_per_example_autograd(case, fused):
    layer, make, shape = CASES[case]
    torch.manual_seed(0)
    model = ByKeyword(layer(), make).double()
    x = torch.randn(shape, dtype=torch.float64)
    want = example_param_sq_norms(model, (model(x[i:i + 1]).sum() for i in range(B)))
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as n:
        model(x).sum().backward()
    got = n.param_sq_norms()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the lookup scaled, its index named ``input_ids``."""

    def forward(self, input_ids):
        return super().forward(input_ids) * 2.0


class TiedByKeyword(nn.Module):
    """GPT-2's tie (the token table is the output layer's weight), the embedding called by keyword."""

    def __init__(self, scaled=False):
        super().__init__()
        self.emb = (ScaledEmbedding if scaled else nn.Embedding)(9, 4)
        self.out, self.scaled = nn.Linear(4, 9, bias=False), scaled
        self.out.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(input_ids=idx) if self.scaled else self.emb(input=idx)
        return self.out(h.tanh()).logsumexp(-1).sum(1)


@pytest.mark.parametrize("scaled", [False, True])
def test_tied_table_called_by_keyword(scaled):
    torch.manual_seed(0)
    model = TiedByKeyword(scaled).double()
    idx = torch.randint(0, 9, (B, 5))
    want = example_param_sq_norms(model, (model(idx[i:i + 1]).sum() for i in range(B)))
    with PerSampleGradNorms(model, loss_reduction="sum") as n:
        model(idx).sum().backward()
    torch.testing.assert_close(n.param_sq_norms()["emb.weight"], want["emb.weight"], rtol=1e-9, atol=0)


def test_keyword_calls_compiled_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = ByKeyword(nn.Linear(4, 4), lambda x: {"input": x})
    model.norm = ByKeyword(nn.LayerNorm(1), lambda x: {"input": x})
    compiled = torch.compile(model, backend="aot_eager")
    got = []
    with PerSampleGradNorms(compiled, loss_reduction="sum") as n:
        for step in range(3):                        # the first eagerly (eager_first), then compiled
            x = torch.randn(B, 2, 4, generator=torch.Generator().manual_seed(step))
            compiled(x).sum().backward()
            got.append(n.sq_norms())
            model.zero_grad()
    for step, g in enumerate(got):
        x = torch.randn(B, 2, 4, generator=torch.Generator().manual_seed(step))
        want = example_param_sq_norms(model, (model(x[i:i + 1]).sum() for i in range(B)))
        torch.testing.assert_close(g, sum(want.values()), rtol=1e-5, atol=1e-7)
