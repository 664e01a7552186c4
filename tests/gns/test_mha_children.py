"""F.multi_head_attention_forward handed its children's weights (WavLM's attention, from fairseq): run as
the children's own calls around nn.MultiheadAttention's attention core; against one backward per example in
float64, and against the functional call itself (before: the readers refused 'k_proj.bias' by name)."""
import pytest
import torch
import torch.nn.functional as F
from layer_check import against_per_example
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.layers import mha_children


class FairseqAttention(nn.Module):
    """q/k/v/out projections as children, their weights handed to the functional attention on (T, B, E)."""

    def __init__(self, E=6, H=2, bias=True, need_weights=True, mask=False, padding=False, cross=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E, bias=bias) for _ in range(3))
        self.out_proj, self.inp, self.head = nn.Linear(E, E, bias=bias), nn.Linear(3, E), nn.Linear(E, 2)
        self.E, self.H, self.need_weights, self.mask, self.padding, self.cross = E, H, need_weights, mask, \
            padding, cross
        self.bias = nn.Parameter(torch.randn(H, 1, 1) * 0.3)            # (the parent's own: a position bias)

    def forward(self, x):
        h = self.inp(x)                                                  # (B, T, E)
        B, T, _ = h.shape
        q = h.transpose(0, 1)
        kv = torch.tanh(q) if self.cross else q
        mask = None
        if self.mask:                                                    # (B·H, T, T), from the examples
            mask = (self.bias * h.sum(-1)[:, None, :, None]).reshape(B * self.H, T, 1).expand(-1, -1, T)
        kpm = x[..., 0] > 0.5                                            # (each example's own padding,
        kpm[:, 0] = False                                                # never all of it)
        bias = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)) if self.q_proj.bias \
            is not None else None
        out, _ = F.multi_head_attention_forward(
            q, kv, kv, self.E, self.H, torch.empty([0]), bias, None, None, False, 0.0, self.out_proj.weight,
            self.out_proj.bias, self.training, kpm if self.padding else None, need_weights=self.need_weights,
            attn_mask=mask, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)
        out = out.transpose(0, 1)                                        # (B, T, E)
        out = out if self.mask else out * (1 + self.bias.sum())       # (else a scale: used either way)
        return self.head(torch.tanh(out).mean(1))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("form", [{}, {"need_weights": False}, {"mask": True, "padding": True},
                                  {"bias": False, "cross": True}, {"mask": True, "need_weights": False}],
                         ids=["weights", "sdpa", "masks", "nobias-cross", "mask-sdpa"])
def test_children_weights_in_functional_attention_match_per_example_backward(fused, form):
    torch.manual_seed(0)
    model = FairseqAttention(**form).double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with torch.no_grad():
        plain = model(x)
    psn, got, _ = against_per_example(model, lambda s: _loss(model(x[s]), y[s]), 4, fused=fused,
                                      loss_reduction="sum", complete=True)
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"} <= set(got)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused):
        torch.testing.assert_close(model(x), plain, rtol=1e-12, atol=1e-12)      # (the same function)


def test_forms_it_does_not_take_are_still_refused_by_name():
    """bias_k/bias_v (here the parent's own): not rewritten, the readers name the parameter."""
    class WithBiasKV(FairseqAttention):
        def __init__(self):
            super().__init__()
            self.bk, self.bv = nn.Parameter(torch.randn(1, 1, 6)), nn.Parameter(torch.randn(1, 1, 6))

        def forward(self, x):
            q = self.inp(x).transpose(0, 1)
            bias = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
            out, _ = F.multi_head_attention_forward(
                q, q, q, 6, 2, torch.empty([0]), bias, self.bk, self.bv, False, 0.0, self.out_proj.weight,
                self.out_proj.bias, True, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
                k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)
            return self.head(out.mean(0))

    model = WithBiasKV()
    with PerSampleGradNorms(model) as psn:
        F.cross_entropy(model(torch.randn(3, 4, 3)), torch.tensor([0, 1, 0])).backward()
        with pytest.raises(RuntimeError, match=r"'bk' .*multi_head_attention_forward"):
            psn.param_sq_norms()


def test_a_bias_that_is_not_the_childrens_is_not_taken():
    model = FairseqAttention()
    with torch.no_grad():
        wrong = torch.cat((model.k_proj.bias, model.q_proj.bias, model.v_proj.bias))
    assert not mha_children._bias_matches(wrong, [model.q_proj, model.k_proj, model.v_proj])
    assert mha_children._bias_matches(torch.cat((model.q_proj.bias, model.k_proj.bias, model.v_proj.bias)),
                                      [model.q_proj, model.k_proj, model.v_proj])


def test_compiled_parent_runs_eagerly_and_its_norms_are_eager_ones():
    """Under torch.compile (aot_eager) the parent's own forward runs eagerly (it holds a bare parameter), the
    functional attention still becomes its children's calls: the same norms over two steps."""
    torch.manual_seed(0)
    model = FairseqAttention(mask=True, padding=True).double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    compiled = torch.compile(model, backend="aot_eager")
    against_per_example(model, lambda s: _loss(model(x[s]), y[s]), 4, steps=2,
                        batch_loss=lambda: _loss(compiled(x), y), loss_reduction="sum", complete=True)
