"""The per-layer choice between the outer and the Gram form (``form_choice.use_gram``): the CPU rule, and the
CUDA cost model with its scratch rule (issue 14's memory target), the latter as the pure function
``cuda_prefers_gram`` since CI has no GPU."""
from __future__ import annotations

import pytest
import torch

from elasticlab.gns import form_choice
from elasticlab.gns.form_choice import cuda_prefers_gram

MB = 1 << 20


def test_cpu_rule_crossover():
    """Unfused: Gram below T = Din·Dout/(Din+Dout) (205 for 256→1024); fused: below an eighth of it."""
    assert form_choice.use_gram(204, 256, 1024) and not form_choice.use_gram(206, 256, 1024)
    assert form_choice.use_gram(25, 256, 1024, fused_outer=True)
    assert not form_choice.use_gram(26, 256, 1024, fused_outer=True)


@pytest.mark.parametrize("din, dout", [(256, 1024), (1024, 256)])
def test_small_model_takes_gram_when_the_products_would_dominate_its_memory(din, dout):
    """W2's float32 layers (B=32, T=128): by time alone the outer form (1 MB of products an example, 32 MB
    for the batch, +46% of W2's peak on the H100); with 6 MB in use the Gram form (4 MB of scratch)."""
    assert not cuda_prefers_gram(128, din, dout, torch.float32, True, False, 32, lambda: 10_000 * MB)
    assert cuda_prefers_gram(128, din, dout, torch.float32, True, False, 32, lambda: 6 * MB)
    # the boundary: products (32 MB) against 10% of what is in use
    assert not cuda_prefers_gram(128, din, dout, torch.float32, True, False, 32, lambda: 330 * MB)
    assert cuda_prefers_gram(128, din, dout, torch.float32, True, False, 32, lambda: 310 * MB)


def test_time_wins_when_gram_is_much_slower():
    """G1's float32 MLP and head layers (B=8, T=1024): the Gram form would cost far more than twice the
    outer form's extra time, so the outer form stays even with little memory in use."""
    for dout in (3072, 50304):
        assert not cuda_prefers_gram(1024, 768, dout, torch.float32, True, False, 8, lambda: 1 * MB)


def test_gram_with_more_scratch_is_not_taken_for_memory():
    """W3 (B=8, T=512): the Gram matrices (16 MB) would exceed the products (8 MB): outer."""
    assert not cuda_prefers_gram(512, 256, 1024, torch.float32, True, False, 8, lambda: 1 * MB)


def test_fused_kernel_writes_no_products():
    """Layers the Triton kernel serves (products in registers) are chosen by time only."""
    assert not cuda_prefers_gram(128, 256, 1024, torch.bfloat16, True, True, 32, lambda: 1 * MB)
    assert cuda_prefers_gram(128, 256, 1024, torch.bfloat16, True, False, 32, lambda: 1 * MB)


def test_memory_is_read_only_when_the_rule_applies():
    """The allocator is asked only when the rule could change the answer (not for Triton-served layers, not
    when Gram is far slower); without a reading (``None``, as while compiling) the choice is by time."""
    calls = []

    def in_use():
        calls.append(1)
        return 6 * MB
    assert not cuda_prefers_gram(128, 256, 1024, torch.bfloat16, True, True, 32, in_use)
    assert not cuda_prefers_gram(1024, 768, 3072, torch.float32, True, False, 8, in_use)
    assert not calls
    assert cuda_prefers_gram(128, 256, 1024, torch.float32, True, False, 32, in_use) and calls == [1]
    assert not cuda_prefers_gram(128, 256, 1024, torch.float32, True, False, 32, None)


def test_share_and_slowdown_are_the_knobs(monkeypatch):
    monkeypatch.setattr(form_choice, "SCRATCH_SHARE", 10.0)           # 10× what is in use may be scratch
    assert not cuda_prefers_gram(128, 256, 1024, torch.float32, True, False, 32, lambda: 6 * MB)
    monkeypatch.setattr(form_choice, "SCRATCH_SHARE", 0.10)
    monkeypatch.setattr(form_choice, "GRAM_SLOWDOWN_OK", 1.0)         # W2's Gram form is ~1.3× the outer's
    assert not cuda_prefers_gram(128, 256, 1024, torch.float32, True, False, 32, lambda: 6 * MB)


def test_scratch_cap_is_the_cuda_chunk_budget():
    """``SCRATCH_CAP`` is ``_C``'s chunk budget of the CUDA forms (``scratch_bytes`` in csrc/ops.h): pushed at
    import, moved with it by ``scratch_cap`` and put back after; a bad size is a clear error."""
    from elasticlab import _ext
    if _ext.set_scratch_bytes(form_choice.SCRATCH_CAP) is None:
        pytest.skip("_C is not built")
    assert _ext.set_scratch_bytes(form_choice.SCRATCH_CAP) == form_choice.SCRATCH_CAP
    before = form_choice.SCRATCH_CAP
    with form_choice.scratch_cap(3 << 20):
        assert form_choice.SCRATCH_CAP == 3 << 20
        assert _ext.set_scratch_bytes(3 << 20) == 3 << 20
        assert form_choice.scratch_bytes("outer", 64, 512, 1024, 4096, torch.float32) == 3 << 20
    assert form_choice.SCRATCH_CAP == before and _ext.set_scratch_bytes(before) == before
    with pytest.raises(ValueError, match="positive number of bytes, got 0"):
        with form_choice.scratch_cap(0):
            pass
    with pytest.raises(ValueError, match="got -5"):
        _ext.set_scratch_bytes(-5)
    assert _ext.set_scratch_bytes(before) == before


def test_chunk_to_share_keeps_the_outer_form_in_chunks_under_the_share(monkeypatch):
    """``CHUNK_TO_SHARE``: W2's float32 layers keep the outer form wherever one example's products (1 MB) fit
    in the share of what is in use, Gram only below that; the layer's own chunk budget is the share (None
    where the products fit whole, the switch is off, or no rule applies)."""
    w2 = (128, 256, 1024, torch.float32, True, False, 32)
    assert cuda_prefers_gram(*w2, lambda: 61 * MB)                     # the rule: Gram (products 32 MB)
    monkeypatch.setattr(form_choice, "CHUNK_TO_SHARE", True)
    assert not cuda_prefers_gram(*w2, lambda: 61 * MB)                 # 6.1 MB: chunks of 6 examples
    assert not cuda_prefers_gram(*w2, lambda: 10 * MB)                 # 1 MB: one example a chunk
    assert cuda_prefers_gram(*w2, lambda: 9 * MB)                      # 0.9 MB: no example fits
    assert not cuda_prefers_gram(1024, 768, 3072, torch.float32, True, False, 8, lambda: 1 * MB)  # time
    limit = {"v": 6.1 * MB}
    monkeypatch.setattr(form_choice, "scratch_limit", lambda device: limit["v"])
    cuda = torch.device("cuda")
    assert form_choice.outer_chunk_budget(32, 256, 1024, torch.float32, cuda) == int(6.1 * MB)
    assert form_choice.outer_chunk_budget(4, 256, 1024, torch.float32, cuda) is None     # 4 MB: fits whole
    limit["v"] = 0.5 * MB
    assert form_choice.outer_chunk_budget(32, 256, 1024, torch.float32, cuda) is None     # Gram's case
    limit["v"] = None
    assert form_choice.outer_chunk_budget(32, 256, 1024, torch.float32, cuda) is None     # no rule (CPU)
    limit["v"] = 100 * MB
    with form_choice.scratch_cap(3 * MB):                              # never above the cap
        assert form_choice.outer_chunk_budget(4096, 256, 1024, torch.float32, cuda) == 3 * MB
    limit["v"] = 6.1 * MB
    monkeypatch.setattr(form_choice, "CHUNK_TO_SHARE", False)
    assert form_choice.outer_chunk_budget(32, 256, 1024, torch.float32, cuda) is None


def test_a_layer_with_a_budget_of_its_own_sets_it_for_its_fused_call(monkeypatch):
    """A fused Linear whose choice carries a chunk budget hands it to ``_C`` for the call that records its
    backward (which keeps it) and puts the process-wide one back; norms and gradients are unchanged."""
    from torch import nn

    from elasticlab import _ext
    from elasticlab.gns import PerSampleGradNorms, kernels
    from elasticlab.gns.layers import linear
    if _ext.set_scratch_bytes(form_choice.SCRATCH_CAP) is None or kernels.cxx_autograd(
            "linear_norms", torch.zeros(1)) is None:
        pytest.skip("_C is not built")
    torch.manual_seed(0)
    lin, x = nn.Linear(6, 5), torch.randn(3, 7, 6)
    want = {}
    with PerSampleGradNorms(lin, loss_reduction="sum") as n:
        lin(x).pow(2).sum().backward()
        want = n.param_sq_norms()
    grads = [p.grad.clone() for p in lin.parameters()]
    sets, real = [], _ext.set_scratch_bytes
    monkeypatch.setattr(_ext, "set_scratch_bytes", lambda b: sets.append(b) or real(b))
    monkeypatch.setattr(linear, "_choice", lambda module, x, dtype: (0, 3 * MB))
    lin.zero_grad()
    with PerSampleGradNorms(lin, loss_reduction="sum") as n:
        lin(x).pow(2).sum().backward()
        got = n.param_sq_norms()
    assert sets == [3 * MB, form_choice.SCRATCH_CAP]
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    for p, g in zip(lin.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.gpu
def test_cuda_chunked_outer_form_gives_the_same_norms(monkeypatch):
    """On a GPU, W2's float32 layers with ``CHUNK_TO_SHARE`` and a 2 MB share take the cuBLAS outer form in
    chunks of two examples (their own budget, kept from the forward to the backward): the same norms and
    gradients as the Gram form the memory rule picks otherwise, and a peak no higher than the Gram form's
    plus one chunk."""
    from torch import nn

    from elasticlab.gns import PerSampleGradNorms
    from elasticlab.gns.layers import linear
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    x = torch.randn(32, 128, 256, device="cuda")
    monkeypatch.setattr(form_choice, "scratch_limit", lambda device: 2 * MB)
    monkeypatch.setattr(form_choice, "SCRATCH_SHARE", 2 * MB / max(torch.cuda.memory_allocated(), 1))
    out, peaks, choices = {}, {}, []
    real = linear._choice
    monkeypatch.setattr(linear, "_choice", lambda *a: choices.append(real(*a)) or choices[-1])
    for chunked in (False, True):
        monkeypatch.setattr(form_choice, "CHUNK_TO_SHARE", chunked)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with PerSampleGradNorms(model) as psg:
            model(x).pow(2).mean().backward()
            out[chunked] = (psg.sq_norms(), [p.grad.clone() for p in model.parameters()])
        torch.cuda.synchronize()
        peaks[chunked] = torch.cuda.max_memory_allocated() - base
    assert [c[0] for c in choices] == [1, 1, 0, 0] and all(c[1] == 2 * MB for c in choices[2:])
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=0)
    for g1, g0 in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert peaks[True] <= peaks[False] + 2 * MB + MB
