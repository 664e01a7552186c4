"""PerSampleGradNorms for Conv3d, the transposed convolutions, InstanceNorm (instance and running
statistics), PReLU and Bilinear against torch.func (vmap of grad) in float64 with hypothesis shapes; the
output and ``.grad`` against plain autograd; bfloat16 autocast against float32."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layer_check import check, randomise_affine, sq_loss
from torch import nn

from elasticlab.gns import PerSampleGradNorms, rule_for
from elasticlab.gns.layers.conv_nd import grouped_conv_norms
from elasticlab.gns.reference import func_param_sq_norms

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
SETTINGS = settings(max_examples=10, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
red_fused = dict(reduction=st.sampled_from(["mean", "sum"]), fused=st.booleans(), B=st.integers(1, 3))


@SETTINGS
@given(G=st.integers(1, 2), cpg=st.integers(1, 2), cout_pg=st.integers(1, 2), k=st.integers(1, 3),
       stride=st.integers(1, 2), dilation=st.integers(1, 2), pad=st.sampled_from([0, 1, "same", "valid"]),
       mode=st.sampled_from(["zeros", "reflect", "circular", "replicate"]), bias=st.booleans(), **red_fused)
def test_conv3d(G, cpg, cout_pg, k, stride, dilation, pad, mode, bias, reduction, fused, B):
    if pad == "same":
        stride = 1                                    # (PyTorch: 'same' needs stride 1)
    m = nn.Conv3d(G * cpg, G * cout_pg, k, stride=stride, padding=pad, dilation=dilation, groups=G, bias=bias,
                  padding_mode=mode).double()
    x = torch.randn(B, G * cpg, 6, 5, 7, dtype=torch.float64)
    assert rule_for(m).norms is grouped_conv_norms
    check(m, x, reduction, fused)


@SETTINGS
@given(nd=st.integers(1, 3), G=st.integers(1, 2), cpg=st.integers(1, 2), cout_pg=st.integers(1, 3),
       k=st.integers(1, 3), stride=st.integers(1, 3), padding=st.integers(0, 1), dilation=st.integers(1, 2),
       extra=st.integers(0, 2), bias=st.booleans(), **red_fused)
def test_conv_transpose(nd, G, cpg, cout_pg, k, stride, padding, dilation, extra, bias, reduction, fused, B):
    cls = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[nd - 1]
    op = min(extra, max(stride, dilation) - 1)       # output_padding must be < stride or dilation
    m = cls(G * cpg, G * cout_pg, k, stride=stride, padding=padding, output_padding=op, groups=G,
            dilation=dilation, bias=bias).double()
    x = torch.randn(B, G * cpg, *(4, 3, 5)[:nd], dtype=torch.float64)
    check(m, x, reduction, fused)


class UpSampler(nn.Module):
    """A transposed convolution called with ``output_size``, which sets its output padding per call."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)

    def forward(self, x):
        return self.up(x, output_size=(2 * x.shape[2], 2 * x.shape[3]))


@pytest.mark.parametrize("fused", [True, False])
def test_conv_transpose_with_output_size(fused):
    m = UpSampler().double()
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    assert m(x).shape[2:] == (8, 10)                  # output padding 1: not the module's 0
    check(m, x, "mean", fused)


@SETTINGS
@given(nd=st.integers(1, 3), C=st.integers(1, 3), train=st.booleans(), track=st.booleans(), **red_fused)
def test_instancenorm(nd, C, train, track, reduction, fused, B):
    cls = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[nd - 1]
    m = randomise_affine(cls(C, affine=True, track_running_stats=track)).double()
    if track:
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    m.train(train)
    x = 2 * torch.randn(B, C, *(5, 3, 2)[:nd], dtype=torch.float64) + 1
    ref = None
    if train and track:       # torch.func cannot update the running statistics: the same layer without them
        twin = copy.deepcopy(m)
        twin.track_running_stats, twin.running_mean, twin.running_var = False, None, None
        torch.manual_seed(1)
        y = torch.randn_like(m(x))
        ref = func_param_sq_norms(twin, sq_loss, x, y)
        check(m, x, reduction, fused, ref=ref, y=y)
    else:
        check(m, x, reduction, fused)


@SETTINGS
@given(channels=st.sampled_from([None, 1, 3]), spatial=st.sampled_from([(), (4,), (2, 3)]), **red_fused)
def test_prelu(channels, spatial, reduction, fused, B):
    m = nn.PReLU(channels or 1, init=0.2).double()
    with torch.no_grad():
        m.weight.uniform_(-0.5, 0.5)
    x = torch.randn(B, channels or 3, *spatial, dtype=torch.float64)
    check(m, x, reduction, fused)


def test_a_small_unet_of_the_new_layers():
    """Conv3d, InstanceNorm3d, PReLU and ConvTranspose3d in one model, with a Linear head."""
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.PReLU(4),
                          nn.ConvTranspose3d(4, 2, 2, stride=2), nn.Flatten(), nn.Linear(2 * 8 * 6 * 4, 3))
    model = randomise_affine(model).double()
    x = torch.randn(3, 2, 4, 3, 2, dtype=torch.float64)
    for fused in (True, False):
        check(model, x, "mean", fused)


@pytest.mark.parametrize("layer, shape", [(nn.Conv3d(2, 3, 2), (2, 4, 4, 4)),
                                          (nn.ConvTranspose2d(2, 3, 2), (2, 4, 4)),
                                          (nn.InstanceNorm2d(2, affine=True), (2, 4, 4)),
                                          (nn.PReLU(), (5,))])
def test_unbatched_input_is_an_error(layer, shape):
    with PerSampleGradNorms(layer, fused=False):
        with pytest.raises(ValueError, match="batch dimension first"):
            layer(torch.randn(*shape)).sum().backward()


@pytest.mark.parametrize("which", ["conv3d", "convT", "inorm", "prelu"])
def test_bf16_autocast_close_to_float32(which):
    torch.manual_seed(0)
    layers = {"conv3d": [nn.Conv3d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 4)],
              "convT": [nn.ConvTranspose2d(3, 8, 3, stride=2), nn.Flatten(), nn.Linear(8 * 81, 4)],
              "inorm": [nn.Conv2d(3, 8, 3, bias=False),             # (a bias before it has no gradient)
                        nn.InstanceNorm2d(8, affine=True), nn.Flatten(), nn.Linear(8 * 4, 4)],
              "prelu": [nn.Linear(12, 16), nn.PReLU(16), nn.Linear(16, 4)]}[which]
    model = randomise_affine(nn.Sequential(*layers))
    shape = {"conv3d": (8, 3, 4, 4, 4), "convT": (8, 3, 4, 4), "inorm": (8, 3, 4, 4), "prelu": (8, 12)}[which]
    x, y = torch.randn(*shape), torch.randn(8, 4)
    norms = {}
    for dt in (None, torch.bfloat16):
        model.zero_grad()
        with PerSampleGradNorms(model, loss_reduction="sum", fused=False) as n:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt is not None):
                out = model(x)
            sq_loss(out.float(), y).backward()
        norms[dt] = n.param_sq_norms()
    for k, ref in norms[None].items():
        got = norms[torch.bfloat16][k]
        assert got.dtype == torch.float32
        assert ((got - ref).abs() / ref.clamp_min(1e-12)).median() < 0.02, k


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_new_layers_on_cuda_match_the_cpu(fused):
    """The small U-Net of the new layers in float64 on CUDA (cuDNN's grouped convolutions) against the CPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1, padding_mode="reflect"),
                          nn.InstanceNorm3d(4, affine=True), nn.PReLU(4),
                          nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), nn.Flatten(),
                          nn.Linear(2 * 8 * 6 * 4, 3))
    cpu_model = randomise_affine(model).double()
    cuda_model = copy.deepcopy(cpu_model).cuda()      # a copy: moving a model moves its gradients
    x, y = torch.randn(5, 2, 4, 3, 2, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    norms = []
    for m, dev in ((cpu_model, "cpu"), (cuda_model, "cuda")):
        with PerSampleGradNorms(m, fused=fused) as n:
            sq_loss(m(x.to(dev)), y.to(dev)).backward()
        norms.append(n.param_sq_norms())
    assert set(norms[0]) == set(norms[1]) and len(norms[0]) == 9
    for k, want in norms[0].items():
        torch.testing.assert_close(norms[1][k].cpu(), want, rtol=1e-9, atol=1e-14, msg=k)


class BilinearHead(nn.Module):
    """A Bilinear over two views of the input (its two arguments differ in width)."""

    def __init__(self, bias):
        super().__init__()
        self.bil = nn.Bilinear(3, 2, 4, bias=bias)

    def forward(self, x):
        return self.bil(x, x[..., :2].sin())


@SETTINGS
@given(seq=st.sampled_from([(), (1,), (5,), (2, 3)]), bias=st.booleans(), **red_fused)
def test_bilinear(seq, bias, reduction, fused, B):
    m = BilinearHead(bias).double()
    x = torch.randn(B, *seq, 3, dtype=torch.float64)
    check(m, x, reduction, fused)
