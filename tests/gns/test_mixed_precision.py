"""Per-example norms under mixed precision (autocast, GradScaler) and torch.compile, on the CPU."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import GNSEstimator, PerSampleGradNorms, broadcast, kernels
from elasticlab.gns.layers import broadcast_params


def mlp_seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 5)

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).flatten(1))


class TinyGPT(nn.Module):
    """Token + positional embedding (index expanded over the batch), one block, untied head."""

    def __init__(self, V=40, T=12, D=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).unsqueeze(0).expand(B, T)
        h = self.tok(idx) + self.pos(pos)
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, 2, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        h = h + self.proj(a)
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(h)


def norms_of(model, x, loss_fn, fused, dtype=None, compile_backend=None):
    model.zero_grad()
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    with PerSampleGradNorms(model, fused=fused) as n:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(run(x))
        loss.backward()
    return n.sq_norms(), n.param_sq_norms(), [p.grad.clone() for p in model.parameters()]


def unet3d():
    """Conv3d, InstanceNorm3d, PReLU and a transposed convolution (the hook rules of conv_nd, instancenorm and
    prelu)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.InstanceNorm3d(4, affine=True),
                         nn.PReLU(4), nn.ConvTranspose3d(4, 2, 2, stride=2), nn.Flatten(), nn.Linear(384, 3))


CASES = {
    "seq-mlp": (mlp_seq, lambda: torch.randn(8, 10, 16), lambda o: o.pow(2).mean()),
    "conv": (ConvNet, lambda: torch.randn(6, 3, 8, 8), lambda o: o.pow(2).mean()),
    "gpt": (TinyGPT, lambda: torch.randint(0, 40, (4, 12)),
            lambda o: F.cross_entropy(o.flatten(0, 1), torch.arange(o.numel() // o.shape[-1]) % 40)),
    "unet3d": (unet3d, lambda: torch.randn(6, 2, 4, 3, 2), lambda o: o.pow(2).mean()),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.02), (torch.float16, 0.005)])
@pytest.mark.parametrize("case", list(CASES))
def test_autocast_norms_match_fp32(case, dtype, tol, fused):
    """Under autocast the norms come back in float32, within bf16/fp16 rounding of the fp32 norms."""
    make, data, loss_fn = CASES[case]
    model, x = make(), data()
    ref, ref_params, ref_grads = norms_of(model, x, loss_fn, fused)
    got, got_params, grads = norms_of(model, x, loss_fn, fused, dtype=dtype)
    assert got.dtype == torch.float32 and all(v.dtype == torch.float32 for v in got_params.values())
    rel = ((got - ref).abs() / ref).median()
    assert rel < tol, f"median relative error {rel:.4f} of the total norms"
    for k, v in got_params.items():                     # every layer, not only the largest
        assert ((v - ref_params[k]).abs() / ref_params[k].clamp_min(1e-12)).median() < 5 * tol, k
    for g, gr in zip(grads, ref_grads):                  # the parameter gradients are unchanged by the norms
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, gr, rtol=0.1, atol=0.05 * gr.abs().max().item())


@pytest.mark.parametrize("fused", [True, False])
def test_autocast_gradients_equal_plain_autocast(fused):
    """The fused backward under autocast gives the same parameter gradients as plain autocast."""
    make, data, loss_fn = CASES["seq-mlp"]
    model, x = make(), data()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(model(x)).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    _, _, grads = norms_of(model, x, loss_fn, fused, dtype=torch.bfloat16)
    for g, w in zip(grads, plain):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_take_half_inputs_and_return_float32(dtype):
    g = torch.Generator().manual_seed(3)
    a, d = torch.randn(3, 20, 9, generator=g), torch.randn(3, 20, 5, generator=g)
    want, want_grad = kernels.seq_linear_outer_norms_ref(a.to(dtype).double(), d.to(dtype).double(), True)
    for use_kernel in (True, False):
        gram = kernels.seq_linear_gram_norms(a.to(dtype), d.to(dtype), use_kernel=use_kernel)
        outer, grad = kernels.seq_linear_outer_norms(a.to(dtype), d.to(dtype), True, use_kernel=use_kernel)
        assert gram.dtype == outer.dtype == grad.dtype == torch.float32
        torch.testing.assert_close(gram.double(), want, rtol=1e-5, atol=0)
        torch.testing.assert_close(outer.double(), want, rtol=1e-5, atol=0)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-5)
        rows = kernels.row_sq(a.to(dtype), use_kernel=use_kernel)
        assert rows.dtype == torch.float32
        torch.testing.assert_close(rows.double(), a.to(dtype).double().pow(2).sum((1, 2)), rtol=1e-5, atol=0)


def test_use_kernels_off_turns_row_norms_off_too(monkeypatch):
    """With ``USE_KERNELS = False`` no compiled operator is even looked up (kernels._op's cache, filled at
    import, or _ext.kernel); with it on, the same step looks some up (so the check can fail)."""
    calls = []

    class Recording(dict):
        def get(self, key, default=None):
            calls.append(key[0])
            return super().get(key, default)

    real = kernels._ext.kernel
    monkeypatch.setattr(kernels._ext, "kernel", lambda name, dev: calls.append(name) or real(name, dev))
    monkeypatch.setattr(kernels, "_OP_CACHE", Recording(kernels._OP_CACHE))
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    for on in (True, False):
        calls.clear()
        monkeypatch.setattr(kernels, "USE_KERNELS", on)
        with PerSampleGradNorms(model, fused=False) as n:       # (the hook rules: through kernels._op)
            model(torch.randn(4, 3, 5)).sum().backward()
        assert n.sq_norms().shape == (4,)
        assert bool(calls) == (on and kernels._ext.HAS_C), calls


# ---------------------------------------------------------------------------------------------- GradScaler
def _scaled_step(model, x, scaler, fused, unscale_first=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model.zero_grad()
    with PerSampleGradNorms(model, fused=fused, grad_scaler=scaler) as n:
        scaler.scale(model(x).pow(2).mean()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        out = n.sq_norms(), n.grad_sq_norm(), n.layer_grad_sq_norms()
    scaler.step(opt)
    scaler.update()
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_round_trip(fused, unscale_first):
    """With a GradScaler the loss scale is divided out of the norms and of ‖ḡ‖², before or after unscale_."""
    model, x = mlp_seq(), torch.randn(8, 10, 16)
    model.zero_grad()
    with PerSampleGradNorms(model, fused=fused) as n:
        model(x).pow(2).mean().backward()
        ref = n.sq_norms(), n.grad_sq_norm()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for _ in range(2):                # the first step uses the initial scale, the next the scaler's _scale
        got = _scaled_step(model, x, scaler, fused, unscale_first)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
        assert got[1] == pytest.approx(ref[1], rel=1e-5)
        assert sum(got[2].values()) == pytest.approx(ref[1], rel=1e-5)


def test_overflowed_fp16_step_is_skipped_and_counted():
    model, x = mlp_seq(), torch.randn(8, 10, 16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)          # fp16 gradients overflow
    est = GNSEstimator(beta=0.9)
    model.zero_grad()
    with PerSampleGradNorms(model, grad_scaler=scaler) as n:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        assert not torch.isfinite(n.sq_norms()).all()
        assert est.update_from(n) is False
    assert est.skipped == 1 and est.num_updates == 0


def test_grad_scaler_argument_is_checked():
    with pytest.raises(ValueError, match="GradScaler"):
        PerSampleGradNorms(nn.Linear(2, 2), grad_scaler=2.0 ** 16)


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("case,fused", [("seq-mlp", False), ("gpt", True), ("unet3d", True)])
def test_compiled_model_norms_equal_eager(case, fused):
    """torch.compile (aot_eager: Dynamo + AOTAutograd with fake tensors, no code generation) gives eager's
    norms and gradients."""
    make, data, loss_fn = CASES[case]
    model, x = make(), data()
    ref, _, ref_grads = norms_of(model, x, loss_fn, fused)
    torch._dynamo.reset()
    got, _, grads = norms_of(model, x, loss_fn, fused, compile_backend="aot_eager")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    for g, w in zip(grads, ref_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_compiled_with_inductor_under_autocast():
    make, data, loss_fn = CASES["seq-mlp"]
    model, x = make(), data()
    ref, _, _ = norms_of(model, x, loss_fn, True, dtype=torch.bfloat16)
    torch._dynamo.reset()
    got, _, _ = norms_of(model, x, loss_fn, True, dtype=torch.bfloat16, compile_backend="inductor")
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=0)


def test_fake_kernels_trace():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, d = torch.empty(3, 7, 5, dtype=torch.bfloat16), torch.empty(3, 7, 4, dtype=torch.bfloat16)
        n, g = torch.ops.elasticlab.seq_linear_outer_norms(a, d, True)
        assert n.shape == (3,) and g.shape == (4, 5) and n.dtype == g.dtype == torch.float32
        assert torch.ops.elasticlab.seq_linear_gram_norms(a, d).shape == (3,)
        assert torch.ops.elasticlab.row_sq_norms(a).dtype == torch.float32
        gw, gb = torch.ops.elasticlab.layernorm_per_example(a, a, torch.empty(3, 7), torch.empty(3, 7))
        assert gw.shape == gb.shape == (3, 5)


# ---------------------------------------------------------------------------------------------- batch dim
def test_positional_embedding_without_batch_dimension_says_how_to_fix(monkeypatch):
    """arange(T) with T = B cannot be told from a batched index: the audit names the layer. Where T ≠ B it is
    followed to its broadcast (gns.layers.broadcast_params); with that and the audit off, the sizes
    disagree."""
    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(10, 4), nn.Embedding(6, 4), nn.Linear(4, 3)

        def forward(self, idx):
            return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))

    model = Pos()
    with PerSampleGradNorms(model) as n:            # the broadcast audit's verdict
        model(torch.randint(0, 10, (6, 6))).sum().backward()
        with pytest.raises(RuntimeError, match=r"module 'pos' \(Embedding\).*expand its input"):
            n.sq_norms()
    monkeypatch.setattr(broadcast, "ENABLED", False)
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    with PerSampleGradNorms(model) as n:
        model(torch.randint(0, 10, (3, 6))).sum().backward()
        with pytest.raises(RuntimeError, match=r"\{'pos': 6\}.*expand its input over the batch"):
            n.sq_norms()


@pytest.mark.parametrize("fused", [True, False])
def test_cpu_autocast_forward_is_the_plain_one(fused):
    """On the CPU, autocast runs layer_norm and group_norm in their input's dtype (bf16 in, bf16 out; CUDA's
    run them in float32): the fused norm layers give that dtype too, so the model's forward under
    PerSampleGradNorms is the plain one, bit for bit (before: float32 out, and every layer after ran in
    float32; WavLM's loss moved by 5e-5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, 3), nn.GroupNorm(2, 8), nn.GELU(), nn.Flatten(1), nn.Linear(48, 16),
                          nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    with PerSampleGradNorms(model, fused=fused) as psn:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.float().pow(2).sum().backward()
        assert all(v.isfinite().all() for v in psn.param_sq_norms().values())
