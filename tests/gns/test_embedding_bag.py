"""PerSampleGradNorms for nn.EmbeddingBag (each bag an example) against per-bag autograd gradients in float64:
sum / mean / max modes, 2-D inputs and 1-D inputs cut by offsets (with include_last_offset, its last offset
short of the input too; empty bags, padding_idx, per-sample weights), both loss reductions, offsets by
keyword; the errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms


class Bags(nn.Module):
    """An EmbeddingBag with a Linear head, called with its bag arguments by keyword."""

    def __init__(self, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 3, **kw)
        self.head = nn.Linear(3, 2)

    def forward(self, idx, offsets=None, psw=None):
        return self.head(self.bag(idx, offsets=offsets, per_sample_weights=psw))


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(["sum", "mean", "max"]), form=st.sampled_from(["2d", "offsets", "last"]),
       pad=st.sampled_from([None, 0]), weighted=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
       fused=st.booleans(), cuts=st.lists(st.integers(0, 9), min_size=1, max_size=4), data=st.data())
def test_against_per_bag_autograd(mode, form, pad, weighted, reduction, fused, cuts, data):
    torch.manual_seed(0)
    model = Bags(mode=mode, padding_idx=pad, include_last_offset=form == "last").double()
    offsets, psw = None, None
    if form == "2d":
        B = len(cuts)
        idx = torch.tensor(data.draw(st.lists(st.integers(0, 6), min_size=3 * B, max_size=3 * B))).view(B, 3)
    else:
        n = 9
        idx = torch.tensor(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
        starts = sorted([0] + cuts[1:])                       # repeated starts: empty bags
        # include_last_offset: PyTorch (CPU and CUDA) runs the last bag to the input's end, whatever the
        # last offset says (documented as equal to it, not checked)
        offsets = torch.tensor(starts + ([data.draw(st.integers(starts[-1], n))] if form == "last" else []))
    if weighted and mode == "sum":
        psw = torch.randn(idx.shape, dtype=torch.float64)
    args = (idx, offsets, psw)
    out = model(*args)
    B = out.shape[0]
    y = torch.randn(B, 2, dtype=torch.float64)
    # The reference: ‖∇ ℓ_b‖² of every parameter, bag by bag, ℓ_b = ‖out_b − y_b‖² (bags do not interact).
    want = example_param_sq_norms(model, ((out[b] - y[b]).pow(2).sum() for b in range(B)))
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as n:
        loss = (model(*args) - y).pow(2).sum()
        (loss / (B if reduction == "mean" else 1)).backward()
    got = n.param_sq_norms()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("fused", [True, False])
def test_last_offset_short_of_the_input_keeps_the_trailing_indices(fused):
    """include_last_offset with offsets[-1] < len(input): the bag PyTorch makes (to the end), not the cut."""
    torch.manual_seed(0)
    model = Bags(mode="sum", include_last_offset=True).double()
    idx, offsets = torch.tensor([1, 2, 1, 0, 3, 0, 0, 4, 2, 3, 5]), torch.tensor([0, 5, 8, 10])
    assert torch.equal(model.bag(idx, offsets)[2], model.bag.weight[idx[8:]].sum(0))
    want = example_param_sq_norms(model, (model(idx, offsets)[b].sum() for b in range(3)))["bag.weight"]
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as n:
        model(idx, offsets).sum().backward()
    torch.testing.assert_close(n.param_sq_norms()["bag.weight"], want, rtol=1e-12, atol=0)


def test_errors_and_a_frozen_table():
    model = Bags(scale_grad_by_freq=True)
    with PerSampleGradNorms(model):
        with pytest.raises(ValueError, match=r"scale_grad_by_freq=True\): its gradient depends on the whole"):
            model(torch.tensor([[1, 2]]))
    model = Bags()
    model.bag.weight.requires_grad_(False)
    with PerSampleGradNorms(model) as n:                 # only the head is measured
        model(torch.tensor([[1, 2], [3, 3]])).sum().backward()
    assert set(n.param_sq_norms()) == {"head.weight", "head.bias"}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_cuda_matches_the_cpu(mode):
    torch.manual_seed(0)
    cpu = Bags(mode=mode, padding_idx=0).double()
    cuda = Bags(mode=mode, padding_idx=0).double().cuda()
    cuda.load_state_dict(cpu.state_dict())
    idx, offsets = torch.randint(0, 7, (40,)), torch.tensor([0, 3, 3, 10, 25, 39])
    norms = []
    for m, dev in ((cpu, "cpu"), (cuda, "cuda")):
        with PerSampleGradNorms(m) as n:
            m(idx.to(dev), offsets.to(dev)).pow(2).sum().backward()
        norms.append(n.param_sq_norms())
    for k, want in norms[0].items():
        torch.testing.assert_close(norms[1][k].cpu(), want, rtol=1e-9, atol=1e-14, msg=k)
