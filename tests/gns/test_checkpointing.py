"""Activation checkpointing (torch.utils.checkpoint) under PerSampleGradNorms: the checkpointed layers run
twice, once in the forward and once recomputed in the backward; their norms must be those of the same model
without checkpointing, for both kinds of checkpoint, fused and hooks, the C++ autograd functions (float32)
and the Python ones (float64). Before, every checkpointed layer stopped with "ran 2 times in one forward",
and the C++ backwards unpacked their saved tensors below autograd, so a non-reentrant recomputation of a
fused layer saved nothing (torch's CheckpointError)."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from elasticlab.gns import GNSMonitor, PerSampleGradNorms

B = 5


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Net(nn.Module):
    """Two blocks and a convolution over the sequence, each checkpointed when ``mode`` says how."""

    def __init__(self, mode=None):
        super().__init__()
        self.mode = mode
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def _run(self, f, x):
        if self.mode is None:
            return f(x)
        return checkpoint(f, x, use_reentrant=self.mode == "reentrant")

    def forward(self, x):
        h = self.emb(x)                      # requires grad: what reentrant checkpointing needs of its input
        for b in self.blocks:
            h = self._run(b, h)
        h = self._run(lambda t: self.conv(t.transpose(1, 2)).transpose(1, 2), h)
        return self.head(h)


def norms_of(model, x, fused, reduction="sum"):
    model.zero_grad(set_to_none=True)
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as psn:
        out = model(x)
        loss = out.pow(2).sum() if reduction == "sum" else out.pow(2).sum(dim=(1, 2)).mean()
        loss.backward()
        return psn.param_sq_norms(), psn.sq_norms(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointed_norms_equal_the_plain_models(mode, fused, dtype):
    torch.manual_seed(0)
    plain = Net().to(dtype)
    ckpt = Net(mode).to(dtype)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(B, 6, 4, dtype=dtype)
    want, want_total, want_grads = norms_of(plain, x, fused)
    got, got_total, got_grads = norms_of(ckpt, x, fused)
    tol = dict(rtol=1e-4, atol=0) if dtype == torch.float32 else dict(rtol=1e-10, atol=0)
    assert got.keys() == want.keys() and len(got) == 18
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=k)
    torch.testing.assert_close(got_total, want_total, **tol)
    for k in want_grads:                                   # the gradients themselves are untouched
        torch.testing.assert_close(got_grads[k], want_grads[k], **tol, msg=k)


@pytest.mark.parametrize("reentrant", [True, False])
def test_whole_model_checkpointed(reentrant):
    """The model's own forward recomputed in the backward: the step is not begun again there (which would
    reset what the forward recorded)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(B, 4, requires_grad=reentrant)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        want = psn.sq_norms()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        checkpoint(model, x, use_reentrant=reentrant).pow(2).sum().backward()
        got = psn.sq_norms()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_a_call_without_gradients_is_not_a_second_call():
    """A layer also called under no_grad in the same forward (a target from the same weights) brings no
    gradient: not counted, and the norms are those of the loss with that target held fixed."""
    torch.manual_seed(2)
    lin = nn.Linear(4, 4).double()

    class TwoPass(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            with torch.no_grad():             # (halved: else the bias's gradient is zero but for rounding)
                target = self.lin(0.5 * x.flip(1))
            return self.lin(x) - target

    x = torch.randn(B, 3, 4, dtype=torch.float64)
    model = TwoPass()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    with torch.no_grad():
        c = lin(0.5 * x.flip(1))
    ref_w, ref_b = [], []
    for i in range(B):
        lin.zero_grad()
        (lin(x[i:i + 1]) - c[i:i + 1]).pow(2).sum().backward()
        ref_w.append(lin.weight.grad.pow(2).sum())
        ref_b.append(lin.bias.grad.pow(2).sum())
    assert torch.stack(ref_w).min() > 0 and torch.stack(ref_b).min() > 1e-6
    torch.testing.assert_close(got["lin.weight"], torch.stack(ref_w), rtol=1e-10, atol=0)
    torch.testing.assert_close(got["lin.bias"], torch.stack(ref_b), rtol=1e-10, atol=0)


def test_monitor_counts_one_forward_of_a_checkpointed_model():
    """GNSMonitor's batch size from the forward: the recomputation in the backward is not a second
    micro-batch (which would switch it to the micro-batch form)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    mon = GNSMonitor(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(3):
        with mon.step():
            x = torch.randn(8, 4)
            checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(mon.history) == 3
    assert all(h["method"] == "per_example" and h["batch_size"] == 8 for h in mon.history), mon.history


def test_compiled_model_with_a_checkpointed_block_matches_eager():
    """torch.compile traces the checkpoint as one region whose recomputation happens in the compiled
    backward (no second eager call of the layers): the norms equal eager's without checkpointing."""
    torch.manual_seed(4)
    plain, ckpt = Net(), Net("non-reentrant")
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(B, 6, 4)
    _, want, _ = norms_of(plain, x, fused=True)
    compiled = torch.compile(ckpt, backend="aot_eager")
    with PerSampleGradNorms(ckpt, loss_reduction="sum") as psn:
        for _ in range(2):                                  # the second step runs the cached graph
            ckpt.zero_grad(set_to_none=True)
            compiled(x).pow(2).sum().backward()
            got = psn.sq_norms()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("autocast", [False, True])
def test_checkpointed_norms_under_autocast_equal_the_plain_models(device, mode, autocast):
    """bf16 autocast, and on CUDA the kernels (cuBLAS; Triton for 16-bit sequence layers): the recomputation
    runs in the forward's autocast state, so the norms are the unchecked model's, in float32."""
    torch.manual_seed(0)
    plain = Net().to(device)
    ckpt = Net(mode).to(device)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(B, 64, 4, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        _, want, _ = norms_of(plain, x, fused=True)
        _, got, _ = norms_of(ckpt, x, fused=True)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5 if not autocast else 1e-2, atol=0)


def _at(t):
    """(data pointer, shape) of a plain tensor with storage, else None (compile's fakes, vmap's wrappers)."""
    if type(t) is not torch.Tensor:
        return None
    try:
        return t.data_ptr(), t.shape
    except RuntimeError:
        return None


@pytest.mark.parametrize("where", ["checkpoint", "save_on_cpu"])
def test_hook_rules_inputs_follow_saved_tensor_hooks(where):
    """A hook rule's layer inputs are packed by the active saved-tensor hooks: under non-reentrant
    checkpointing they are dropped after the forward (recomputed in the backward), not held until it, so
    that checkpointing saves their memory on the hooks path too (before: every hooked layer's input was
    kept). The norms stay those of the unchecked model."""
    import gc
    torch.manual_seed(4)
    plain = Net()
    model = Net("non-reentrant" if where == "checkpoint" else None)
    model.load_state_dict(plain.state_dict())
    seen = []
    model.blocks[1].down.register_forward_hook(lambda m, i, o: seen.append((i[0].data_ptr(), i[0].shape)))
    x = torch.randn(B, 6, 4)
    _, want, _ = norms_of(plain, x, fused=False)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=False) as psn:
        if where == "checkpoint":
            loss = model(x).pow(2).sum()
        else:
            with torch.autograd.graph.save_on_cpu():
                loss = model(x).pow(2).sum()
        gc.collect()
        if where == "checkpoint":       # the forward's input to blocks[1].down: no tensor holds it
            assert not [t for t in gc.get_objects() if _at(t) == seen[0]]
        loss.backward()
        got = psn.sq_norms()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
