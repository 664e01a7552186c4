"""Per-example convolution norm forms on CUDA against the weight-gradient convolution they replace.

For the convolutions of the GPU workload G2 (torchvision ResNet-18 at B=128, 64×64 inputs; bfloat16) and of
W4 (float32), each form's time as a ratio to cuDNN's weight gradient alone (``convolution_backward`` with only
the weight output), in one run: ``patches`` (the default on CUDA: one strided copy of the patches, cuBLAS
batched GEMMs and the fold; ``layers.conv._conv_outer_unfolded``), ``grouped`` (per-example gradients as one
grouped convolution's weight gradient, cuDNN; ``GROUPED_ON_CUDA``), ``triton`` (the implicit-GEMM kernel of
``elasticlab.gns.triton_conv``; ``TRITON_ON_CUDA``), ``triton-k32`` (the same with K steps of at most 32:
its 16-bit 128×128 and 64×64 tiles with K steps of 64 spill registers as Triton compiles them for sm_90,
``.ci/triton_aot.py``, where K steps of 32 do not) and ``gram`` (the Gram form over the patches, plus the
weight gradient it still needs). Each form gives the weight gradient too. Every form is first checked
against float64 on two examples (max relative error of the norms). Peak scratch (MB one call allocates,
outputs included) is printed beside the ratios.

    python benchmarks/bench_conv_cuda.py [--iters 10]
Last line: ``RESULT {json}``.
"""
from __future__ import annotations

import argparse
import json

import torch
from bench_seq_linear_cuda import _scratch_mb, timed
from torch import nn

from elasticlab.gns import triton_conv
from elasticlab.gns.layers import conv as conv_rule

# name: (Cin, Cout, kernel, stride, padding, input side, batch, dtype)
LAYERS = {
    "G2.conv1": (3, 64, 7, 2, 3, 64, 128, torch.bfloat16),
    "G2.l1": (64, 64, 3, 1, 1, 16, 128, torch.bfloat16),
    "G2.l2a": (64, 128, 3, 2, 1, 16, 128, torch.bfloat16),
    "G2.l2": (128, 128, 3, 1, 1, 8, 128, torch.bfloat16),
    "G2.l2ds": (64, 128, 1, 2, 0, 16, 128, torch.bfloat16),
    "G2.l3": (256, 256, 3, 1, 1, 4, 128, torch.bfloat16),
    "G2.l4": (512, 512, 3, 1, 1, 2, 128, torch.bfloat16),
    "W4.c1": (3, 32, 3, 1, 1, 32, 128, torch.float32),
    "W4.c2": (32, 64, 3, 1, 1, 16, 128, torch.float32),
}
FORMS = ("patches", "grouped", "triton", "triton-k32", "gram")


def forms_of(name: str, device: str = "cuda", batch: int | None = None, dtype: torch.dtype | None = None):
    """({form: call returning (norms, weight gradient)}, the weight gradient alone, float64 norms of the first
    two examples) for layer ``name`` (``batch`` and ``dtype`` replace the layer's: a smoke test's)."""
    cin, cout, k, s, p, side, B, dt = LAYERS[name]
    B, dt = batch or B, dtype or dt
    m = nn.Conv2d(cin, cout, k, stride=s, padding=p, bias=False).to(device)
    w = m.weight.detach().to(dt)
    x = torch.randn(B, cin, side, side, device=device).to(dt)
    with torch.no_grad():
        out = m.to(dt)(x)
    g = (torch.randn_like(out, dtype=torch.float32) / out[0, 0].numel() ** 0.5).to(dt)
    d3 = g.reshape(B, cout, -1)
    K, L = w[0].numel(), d3.shape[2]
    geom = (list(m.stride), list(m.padding), list(m.dilation), False, [0, 0], 1)

    def wgrad():
        return torch.ops.aten.convolution_backward(g, x, w, None, *geom, [False, True, False])[1]

    forms = {"patches": lambda: conv_rule._conv_outer_unfolded(m, x, d3, w),
             "grouped": lambda: conv_rule._conv_per_example(m, x, g, w),
             "gram": lambda: (conv_rule._conv_gram_norms(m, x, d3, 1, K, L), wgrad())}
    if triton_conv.HAS_TRITON:
        forms["triton"] = lambda: triton_conv.conv_outer_norms(m, x, g, True)
        k32 = triton_conv._config(L, K, cout)
        if k32[2] > 32:                                       # else the same config as "triton"
            k32 = k32[:2] + (32,) + k32[3:]
            forms["triton-k32"] = lambda: triton_conv.conv_outer_norms(m, x, g, True, k32)
    ref = torch.stack([torch.nn.grad.conv2d_weight(x[b:b + 1].double(), w.shape, g[b:b + 1].double(),
                                                   m.stride, m.padding).pow(2).sum() for b in range(2)])
    return forms, wgrad, ref, (L, K)


def run_layer(name: str, iters: int) -> dict:
    forms, wgrad, ref, (L, K) = forms_of(name)
    errs = {f: float(((fn()[0][:2].double().cpu() - ref.cpu()).abs() / ref.cpu()).max())
            for f, fn in forms.items()}
    base = timed(wgrad, iters)
    return {"wgrad_ms": base, "ratio": {f: timed(fn, iters) / base for f, fn in forms.items()},
            "rel_err": errs, "scratch_mb": {f: _scratch_mb(fn) for f, fn in forms.items()}, "T": L, "K": K}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    rows = {}
    print(f"{'layer':9s} {'dtype':9s} {'T':>5s} {'K':>5s} {'wgrad ms':>9s} "
          + " ".join(f"{f:>8s}" for f in FORMS) + "   rel.err vs fp64 / scratch MB")
    for name in LAYERS:
        try:
            r = rows[name] = run_layer(name, args.iters)
        except Exception as e:                                      # one layer's failure: record, go on
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            print(f"{name:9s} error: {rows[name]['error']}")
            continue
        torch.cuda.empty_cache()
        rt, e, sc = r["ratio"], r["rel_err"], r["scratch_mb"]
        dtype = str(LAYERS[name][7]).split('.')[-1]
        print(f"{name:9s} {dtype:9s} {r['T']:5d} {r['K']:5d} {r['wgrad_ms']:9.3f} "
              + " ".join(f"{rt[f]:7.2f}x" if f in rt else f"{'-':>8s}" for f in FORMS) + "   "
              + " ".join(f"{e[f]:.0e}/{sc[f]:.0f}" if f in e else "-" for f in FORMS))
    print("RESULT " + json.dumps({"layers": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
