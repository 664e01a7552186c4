"""No host synchronisation in a step with per-example norms on CUDA (issue 14: small steps must not wait on
the device per layer). After one warm-up step (kernel lookup, Triton compilation, cached factors), the
forward, the backward and ``sq_norms()`` / ``layer_sq_norms()`` run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call (``.item()``, a
device-to-host copy, ``nonzero``, a stream synchronise). ``grad_sq_norm`` returns a Python float and
synchronises by design (once per device), so it stays outside. Such a step can be captured in a CUDA graph:
replayed on new batches, it gives the norms and gradients of an eager step on them."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import PerSampleGradNorms

pytestmark = pytest.mark.gpu


class Every(nn.Module):
    """Every rule family: Conv2d, GroupNorm, BatchNorm (eval), Embedding, Linear (2-D and sequence),
    LayerNorm, RMSNorm, MultiheadAttention."""

    def __init__(self, D=32):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.bn = nn.BatchNorm2d(8).eval()
        self.emb, self.up = nn.Embedding(50, D), nn.Linear(8, D)
        self.ln, self.rms = nn.LayerNorm(D), nn.RMSNorm(D)
        self.mha = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mid, self.head = nn.Linear(D, D), nn.Linear(D, 5)

    def forward(self, img, idx):
        h = F.relu(self.bn(self.gn(self.conv(img)))).mean((2, 3))          # (B, 8)
        s = self.ln(self.emb(idx) + self.up(h).unsqueeze(1))               # (B, T, D)
        s = s + self.mha(s, s, s, need_weights=False)[0]
        s = self.rms(F.gelu(self.mid(s)))
        return self.head(s.mean(1))


def _step(model, n, inputs, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(*inputs)
    out.float().pow(2).mean().backward()
    return n.sq_norms(), n.layer_sq_norms()


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_step_with_norms_does_not_synchronise(fused, autocast):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Every().to(dev)
    model.bn.eval()
    inputs = (torch.randn(4, 3, 8, 8, device=dev), torch.randint(0, 50, (4, 16), device=dev))
    with PerSampleGradNorms(model, fused=fused) as n:
        _step(model, n, inputs, autocast)                                   # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sq, layers = _step(model, n, inputs, autocast)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert n.grad_sq_norm() > 0
    assert sq.shape == (4,) and bool(torch.isfinite(sq).all())
    assert {"conv", "gn", "bn", "emb", "up", "ln", "rms", "mha", "mha.out_proj", "mid", "head"} <= set(layers)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_norms_captured_in_a_cuda_graph_replays_on_new_batches(fused, autocast):
    """The step captured by torch.cuda.graph after an eager warm-up on a side stream; each new batch copied
    into its inputs and the graph replayed: its norms (sq_norms and per layer) and gradients equal those of an
    eager step of the same model on that batch."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = Every().to(dev)
    model.bn.eval()
    twin = copy.deepcopy(model)

    def batch(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return (torch.randn(4, 3, 8, 8, device=dev, generator=g),
                torch.randint(0, 50, (4, 16), device=dev, generator=g))
    static = batch(0)
    tol = dict(rtol=1e-4, atol=1e-7) if not autocast else dict(rtol=2e-2, atol=1e-5)
    with PerSampleGradNorms(model, fused=fused) as n:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                _step(model, n, static, autocast)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sq, layers = _step(model, n, static, autocast)
        for seed in (1, 2):
            new = batch(seed)
            for t, v in zip(static, new):
                t.copy_(v)
            graph.replay()
            with PerSampleGradNorms(twin, fused=fused) as m:
                want, want_layers = _step(twin, m, new, autocast)
            torch.testing.assert_close(sq, want, **tol)
            assert set(layers) == set(want_layers)
            for k, v in want_layers.items():
                torch.testing.assert_close(layers[k], v, **tol, msg=k)
            for (k, p), q in zip(model.named_parameters(), twin.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=k)
