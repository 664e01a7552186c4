"""A layer rule's norms against torch.func (vmap of grad) and its model's output and ``.grad`` against plain
autograd, in float64: the check the layer-rule tests share."""
import torch

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import func_param_sq_norms


def sq_loss(out, y):
    """A per-example loss, summed over the batch: ℓ_i = ‖out_i − y_i‖²."""
    return (out - y).pow(2).sum()


def grads_of(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_grads_and_norms(model, n, plain, ref):
    """.grad equals plain autograd's and the recorded norms equal torch.func's, parameter by parameter."""
    got_grads = grads_of(model)
    assert set(got_grads) == set(plain)
    for k in plain:
        torch.testing.assert_close(got_grads[k], plain[k], rtol=1e-10, atol=1e-12, msg=k)
    assert_norms(n.param_sq_norms(), ref, rtol=1e-6, atol=1e-10)


def assert_norms(got, want, rtol=1e-8, atol=1e-12, same_keys=True):
    """Recorded per-parameter norms ``got`` against ``want`` ({name: (B,)}), name by name; ``same_keys``: and
    the same names."""
    if same_keys:
        assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


def against_per_example(model, loss_of, B, steps=1, batch_loss=None, rtol=1e-8, atol=1e-12, same_keys=True,
                        complete=False, **kwargs):
    """A model's norms against one backward per example: ``loss_of(s)`` is the loss of the batch's slice s
    (``batch_loss()``, the whole batch's where it differs: a compiled model), each of ``steps`` steps;
    ``complete``: and no parameter left out. ``kwargs`` go to PerSampleGradNorms. (norms, got, want)."""
    from elasticlab.gns.reference import example_param_sq_norms
    want = example_param_sq_norms(model, (loss_of(slice(b, b + 1)) for b in range(B)))
    with PerSampleGradNorms(model, **kwargs) as psn:
        for _ in range(steps):
            model.zero_grad()
            (batch_loss or (lambda: loss_of(slice(None))))().backward()
            got = psn.param_sq_norms()
            assert_norms(got, want, rtol, atol, same_keys)
        if complete:
            assert psn.left_out == []
    return psn, got, want


def check(model, x, reduction, fused, loss_fn=sq_loss, ref=None, y=None):
    """Norms against torch.func (or ``ref``), and the output and ``.grad`` against plain autograd."""
    torch.manual_seed(1)
    with torch.no_grad():
        out0 = model(x)
    if y is None:
        y = torch.randn_like(out0)
    if ref is None:
        ref = func_param_sq_norms(model, loss_fn, x, y)
    div = x.shape[0] if reduction == "mean" else 1
    model.zero_grad()
    (loss_fn(model(x), y) / div).backward()
    plain = grads_of(model)
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as n:
        out = model(x)
        (loss_fn(out, y) / div).backward()
    torch.testing.assert_close(out, out0, rtol=1e-10, atol=1e-12)
    assert_grads_and_norms(model, n, plain, ref)
    assert all("forward" not in m.__dict__ for m in model.modules())      # restored on exit
    return n


def randomise_affine(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("weight", "bias")) and p.dim() == 1:
                p.normal_()
    return model


def on_device(model, x, y, loss_fn, device, autocast, B=None):
    """A model's norms in float32 (or bf16 autocast) on ``device`` against one float64 backward per example on
    the CPU: exact to float32; under autocast, each parameter's median relative error under 2%."""
    from elasticlab.gns.reference import example_param_sq_norms
    B = B or x.shape[0]
    model = model.double()
    ref = example_param_sq_norms(model, (loss_fn(model(x[b:b + 1]), y[b:b + 1]) for b in range(B)))
    model, x, y = model.float().to(device), x.float().to(device), y.to(device)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss_fn(out.float(), y).backward()
        got = psn.param_sq_norms()
    assert set(got) == set(ref)
    scale = max(float(v.max()) for v in ref.values())
    for k, want in ref.items():
        g = got[k].double().cpu()
        if float(want.max()) < 1e-12 * scale:      # (zero but for rounding: an attention's key bias)
            assert float(g.max()) < 1e-3 * scale, k
        elif autocast:
            assert float(((g - want).abs() / want.clamp_min(1e-30)).median()) < 0.02, k
        else:
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-8, msg=k)


def eager_then_compiled(model, loss_of, eager=(), compiled=(), refused=None, backend="aot_eager", **kwargs):
    """Steps under PerSampleGradNorms(model, **kwargs): eagerly on each batch of ``eager``, then through
    ``torch.compile(model, backend)`` on each of ``compiled``. Each step's loss is the plain model's, and its
    norms (each parameter's and the total) are one backward per example's, in float64. ``loss_of(m, x, s)``:
    the summed loss of examples ``s`` of batch ``x`` (a tensor, or a tuple of them such as (inputs, targets),
    the batch first) through ``m``; ``refused``: {index into ``compiled``: regex} for the steps whose readers
    must raise instead. Returns the PerSampleGradNorms."""
    import pytest
    import torch._dynamo

    from elasticlab.gns.reference import example_param_sq_norms
    refused = {len(eager) + i: r for i, r in (refused or {}).items()}
    steps = [(model, x) for x in eager] + [(None, x) for x in compiled]
    wants = [None if i in refused else example_param_sq_norms(
        model, (loss_of(model, x, slice(b, b + 1)) for b in range(len(x[0] if isinstance(x, tuple) else x))))
        for i, (_, x) in enumerate(steps)]
    plains = [loss_of(model, x, slice(None)).detach() for _, x in steps]
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend)
    try:
        with PerSampleGradNorms(model, **kwargs) as psg:
            for i, ((m, x), want, plain) in enumerate(zip(steps, wants, plains)):
                model.zero_grad()
                loss = loss_of(m or run, x, slice(None))
                torch.testing.assert_close(loss.detach(), plain, rtol=1e-10, atol=0)
                loss.backward()
                if i in refused:
                    with pytest.raises(RuntimeError, match=refused[i]):
                        psg.sq_norms()
                    continue
                assert_norms(psg.param_sq_norms(), want, rtol=1e-9, atol=1e-30)
                torch.testing.assert_close(psg.sq_norms(), sum(want.values()), rtol=1e-9, atol=0)
    finally:
        torch._dynamo.reset()
    return psg
