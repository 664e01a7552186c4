"""Several forwards of the model feeding one backward (elasticlab.gns.forwards): the readers raise, where
the norms were silently wrong (a two-view MLP: up to 4× off one backward per example); a forward no backward
reaches changes nothing."""
import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms

B = 5


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("fused", [True, False])
def test_two_views_into_one_loss_raise(fused):
    model = mlp()
    x1, x2 = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        (model(x1) - model(x2)).pow(2).sum().backward()
        for read in (psn.sq_norms, psn.param_sq_norms, psn.layer_sq_norms, psn.grad_sq_norm):
            with pytest.raises(RuntimeError, match="earlier forward of the model .1 before the last"):
                read()
        # the next step, one forward and one backward, reads again
        model.zero_grad()
        model(x1).pow(2).sum().backward()
        got = psn.param_sq_norms()
    ref = example_param_sq_norms(model, (model(x1[i:i + 1]).pow(2).sum() for i in range(B)))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_micro_batch_losses_summed_before_one_backward_raise(fused):
    model = mlp()
    x = torch.randn(2 * B, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, fused=fused) as psn:
        (model(x[:B]).pow(2).mean() + model(x[B:]).pow(2).mean()).backward()
        with pytest.raises(RuntimeError, match="several forwards feeding one backward"):
            psn.sq_norms()


@pytest.mark.parametrize("fused", [True, False])
def test_a_forward_no_backward_reaches_changes_nothing(fused):
    """An evaluation forward with gradients on (no ``no_grad``), then the training step's forward and
    backward: exact norms, no error."""
    model = mlp()
    x, held_out = torch.randn(B, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        model(held_out).sum()
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    ref = example_param_sq_norms(model, (model(x[i:i + 1]).pow(2).sum() for i in range(B)))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=0)
