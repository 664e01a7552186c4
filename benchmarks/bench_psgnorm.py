"""Per-example gradient norms: cost of a training step with norms against plain forward+backward.

Workloads of ``shared/reference/psgnorm-anchors.md``: W1–W4 (the CPU anchors) and the GPU workloads G1
(GPT-2-small class, B=8, T=1024), G2 (torchvision ResNet-18 with GroupNorm, B=128, 64×64; skipped without
torchvision) and G3 (the W2 block at D=1024, B=64, T=512); also R1, an LSTM language model (V=10000, D=256,
H=512, 2 layers, B=32, T=64), and V1, a small ViT (64×64 images in 8×8 patches, D=192, 6 pre-norm encoder
layers of 3 heads, a class token and a position embedding, B=64); neither is an anchor nor run by default.
Median of timed steps after warm-up (CUDA events on CUDA), methods interleaved round by round so that drift
hits all alike; a method slower than ``--slow-s`` a step is timed 3 times only. Methods: ``plain`` (the
baseline), ``psgn`` (elasticlab, fused backward), ``psgn-ref`` (the same with the compiled kernels off),
``psgn-cublas`` (the same without the Triton fused kernel: cuBLAS batched GEMMs + fold, on CUDA),
``psgn-triton32`` (the Triton fused kernel for float32 layers too, :data:`elasticlab.gns.triton_outer.FP32`),
``psgn-untuned`` (the Triton kernel's variant fixed, not timed per shape by :mod:`elasticlab.gns.triton_tune`:
its nested loop, pointer loads; the tuner's timings are printed under each workload as ``tuned``),
``psgn-tritonflat`` (fixed to the flat loop over (example, K step) pairs,
:data:`elasticlab.gns.triton_outer.FLAT`), ``psgn-tritontma`` and ``psgn-tritontmaflat`` (its operands through
TMA descriptors, :data:`elasticlab.gns.triton_outer.TMA`, in the nested and the flat loop), ``psgn-fusedbias``
and ``psgn-tmaflatbias`` (each example's bias gradient summed inside the Triton kernel wherever the tile can,
:data:`elasticlab.gns.triton_outer.FUSE_BIAS`: tuned, and fixed to the TMA flat loop, beside
``psgn-tritontmaflat``; ``psgn`` itself times each form both ways and keeps the faster), ``psgn-chunkshare``
(float32 layers on CUDA keep the cuBLAS outer form in chunks under the memory rule's share instead of the Gram
form, :data:`elasticlab.gns.form_choice.CHUNK_TO_SHARE`), ``psgn-convgrouped`` (convolutions on CUDA by one
grouped convolution's weight gradient instead of a batched GEMM over the patches,
:data:`elasticlab.gns.layers.conv.GROUPED_ON_CUDA`), ``psgn-convtriton`` (bfloat16 convolutions on CUDA by the
implicit-GEMM Triton kernel, :data:`elasticlab.gns.layers.conv.TRITON_ON_CUDA`), ``psgn-py`` (the fused
layers' Python autograd.Functions instead of their C++ ones), ``psgn-torchops`` (the fused layers' C++
operators called through torch.ops' boxed entry, not ``_C``'s direct one), ``psgn-calibrated`` (each layer
shape's form timed at its first backward and the fastest kept, :mod:`elasticlab.gns.calibrate`; the warm-up
steps pay for the measuring), ``psgn-hooks`` (elasticlab, hooks only), ``plain-compiled`` and
``psgn-compiled`` (the model under ``torch.compile``, plainly and with the fused norms; not run by default:
Inductor compiles each workload for minutes on the CPU), ``plain-graphed`` and ``psgn-graphed`` (the eager
step, norms read included, captured in one CUDA graph and replayed: no host work a step; CUDA only, not run by
default; ``psgn-graphed / plain-graphed`` printed), ``torch.func`` (vmap of grad, then the gradient as the sum
of per-example ones; skipped when B × #params × 4 bytes exceeds 40% of the free memory) and ``opacus-ghost``
(Opacus ghost clipping, one backward) when Opacus is installed. A method that raises is reported as ``error:
...`` for that workload; the others go on.

Precision: ``fp32`` (true fp32 matmuls, PyTorch's default) or ``bf16`` (forward and loss under
``torch.autocast(device, bfloat16)``, backward outside it, parameters fp32). A workload entry is ``NAME`` (run
at each precision of ``--precision``) or ``NAME:PREC[+PREC]``, e.g. ``--workloads W1,G1:fp32+bf16,G3:bf16``.
Defaults: on CPU ``W1,W2,W3,W4`` in fp32; on CUDA also ``G1:fp32+bf16,G2:fp32+bf16,G3:bf16``, the workloads
whose targets are still open first (G3, G2), so that a run cut by ``--max-s`` keeps them.

Checks: every method is first compared with ``torch.func`` (where vmap cannot batch a layer, as nn.LSTM's,
a loop of one backward per example) in float64 on a small batch of a shrunken model
(max relative error of the squared norms); for bf16 entries also the median relative error of psgn's bf16
norms against its fp32 norms on the same batch. Peak memory: on CUDA ``torch.cuda.max_memory_allocated``
beyond what model and data hold; on CPU the peak RSS of a child process per method.
Last line: ``RESULT {json}``; ``workloads`` is keyed ``NAME-PREC`` (e.g. ``G1-bf16``) with baseline_ms,
ratio, ms, extra_mb / extra_pct, check_rel_err, errors, skipped and (bf16) bf16_vs_fp32.

    python benchmarks/bench_psgnorm.py [--device cuda] [--workloads ...] [--precision fp32,bf16]
        [--methods ...] [--iters 15] [--warmup 3] [--threads 2] [--quick] [--no-memory] [--max-s S]
        [--rounds N]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import PerSampleGradNorms, calibrate, triton_tune
from elasticlab.gns.reference import func_sq_norms, loop_sq_norms

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(x, **_):
        return x

WORKLOADS = ("W1", "W2", "W3", "W4", "G1", "G2", "G3", "R1", "V1")
PRECISIONS = ("fp32", "bf16")
DEFAULT_CPU = "W1,W2,W3,W4"
DEFAULT_CUDA = "G3:bf16,G2:fp32+bf16,G1:fp32+bf16,W1,W2,W3,W4"
# Expected noise: functorch's fallback for SDPA under vmap, Opacus' full backward hook on the first layer.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
FUNC_MEM_FRACTION = 0.4          # torch.func is skipped when its per-example gradients need more of the free


class Unavailable(Exception):
    """A workload that cannot run here (a missing package)."""


# ---------------------------------------------------------------------------------------------- workloads
class SeqBlock(nn.Module):
    """W2/W3/G3: Linear D→4D, GELU, Linear 4D→D, LayerNorm, mean over T, Linear D→10."""

    def __init__(self, D=256, C=10):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, x):
        return self.head(self.ln(self.down(F.gelu(self.up(x)))).mean(1))


class SmallCNN(nn.Module):
    """W4: Conv 3→32 (3×3, pad 1), ReLU, MaxPool2, Conv 32→64, ReLU, MaxPool2, Linear 4096→10."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(4096, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        return self.fc(F.max_pool2d(F.relu(self.c2(h)), 2).flatten(1))


class Block(nn.Module):
    """G1: pre-LN transformer block (causal self-attention with H heads, then a 4D GELU MLP; residuals)."""

    def __init__(self, D: int, H: int):
        super().__init__()
        self.H = H
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.H, D // self.H).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(D, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """G1: GPT-2-small class. Token and learned positional embeddings (the positions ``arange(T)`` expanded
    over the batch, so that the positional table has per-example gradients), L blocks, final LayerNorm,
    untied head without bias. Plain nn.Linear / nn.LayerNorm / nn.Embedding, so elasticlab covers all.
    ``contiguous_pos``: copy the expanded positions (a 64 KB copy at B=8, T=1024) before the lookup, for
    Opacus, whose embedding norm sampler calls ``.view`` on the indices and fails on the expanded ones."""

    contiguous_pos = False

    def __init__(self, V=50304, n_ctx=1024, D=768, L=12, H=12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(n_ctx, D)
        self.blocks = nn.ModuleList(Block(D, H) for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).unsqueeze(0).expand(B, T)
        x = self.tok(idx) + self.pos(pos.contiguous() if self.contiguous_pos else pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LSTMLM(nn.Module):
    """R1 (not in the anchors' list; not run by default): an LSTM language model, token embedding, L-layer
    LSTM, Linear head. Its LSTM runs as elasticlab's loop over time while norms are measured
    (:mod:`elasticlab.gns.layers.recurrent`)."""

    def __init__(self, V=10000, D=256, H=512, L=2):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(H, V)
        self.lstm = nn.LSTM(D, H, L, batch_first=True)

    def forward(self, idx):
        return self.head(self.lstm(self.emb(idx))[0])


class ViT(nn.Module):
    """V1 (not in the anchors' list; not run by default): a ViT (Dosovitskiy et al. 2021) in plain torch, its
    class token and position embedding bare parameters of the root
    (:mod:`elasticlab.gns.layers.broadcast_params`), the encoder nn.TransformerEncoderLayer's."""

    def __init__(self, S=64, P=8, D=192, L=6, H=3, classes=100):
        super().__init__()
        self.patch = nn.Conv2d(3, D, P, stride=P)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (S // P) ** 2 + 1, D) * 0.02)
        self.blocks = nn.Sequential(*(nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, activation="gelu",
                                                                 batch_first=True, norm_first=True)
                                      for _ in range(L)))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _resnet18_gn() -> nn.Module:
    try:
        import torchvision
    except ImportError as e:
        raise Unavailable("torchvision not installed") from e
    return torchvision.models.resnet18(num_classes=100, norm_layer=lambda c: nn.GroupNorm(8, c))


def workload(name: str, quick: bool = False, check: bool = False):
    """(model, x, y) of a workload on the CPU: full size, ``quick`` (small, for smoke runs) or ``check`` (a
    shrunken model and 4–8 examples for the float64 comparison with torch.func)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "W1":
        B = 8 if check else 32 if quick else 256
        mlp = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                            nn.Linear(1024, 10))
        return (mlp, torch.randn(B, 784, generator=g), torch.randint(0, 10, (B,), generator=g))
    if name in ("W2", "W3"):
        B, T = (32, 128) if name == "W2" else (8, 512)
        if quick or check:
            B = 4
        return SeqBlock(), torch.randn(B, T, 256, generator=g), torch.randint(0, 10, (B,), generator=g)
    if name == "W4":
        B = 8 if check else 16 if quick else 128
        return SmallCNN(), torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    if name == "G1":
        (V, D, L, H), (B, T) = ((512, 64, 2, 4), (4, 32)) if check else \
            ((8192, 256, 2, 4), (4, 128)) if quick else ((50304, 768, 12, 12), (8, 1024))
        return (GPT(V=V, D=D, L=L, H=H), torch.randint(0, V, (B, T), generator=g),
                torch.randint(0, V, (B, T), generator=g))
    if name == "G2":
        B, S = (4, 32) if check else (8, 32) if quick else (128, 64)
        x = torch.randn(B, 3, S, S, generator=g)
        return _resnet18_gn(), x, torch.randint(0, 100, (B,), generator=g)
    if name == "G3":
        D, B, T = (64, 4, 16) if check else (1024, 2, 128) if quick else (1024, 64, 512)
        return SeqBlock(D), torch.randn(B, T, D, generator=g), torch.randint(0, 10, (B,), generator=g)
    if name == "R1":
        (V, D, H), (B, T) = ((64, 8, 16), (4, 6)) if check else ((1000, 64, 128), (4, 16)) if quick else \
            ((10000, 256, 512), (32, 64))
        return (LSTMLM(V, D, H), torch.randint(0, V, (B, T), generator=g),
                torch.randint(0, V, (B, T), generator=g))
    if name == "V1":
        (S, D, L), B = ((16, 16, 2), 4) if check else ((32, 64, 2), 4) if quick else ((64, 192, 6), 64)
        x = torch.randn(B, 3, S, S, generator=g)
        return ViT(S=S, D=D, L=L, H=2 if check else 3 if D % 3 == 0 else 4), x, \
            torch.randint(0, 100, (B,), generator=g)
    raise ValueError(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over all targets: per example for (B, C) logits, over all B·T tokens for (B, T, V)
    (which is the mean over the batch of per-example token means, as loss_reduction="mean" assumes)."""
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


_cache: dict = {}


def _built(name: str, device, quick: bool):
    """(model, x, y) of workload ``name`` on ``device``, built once and kept until another one is built."""
    key = (name, quick, str(device))
    if key not in _cache:
        _cache.clear()
        model, x, y = workload(name, quick)
        _cache[key] = (model.to(device), x.to(device), y.to(device))
    return _cache[key]


def build(name: str, device, quick: bool = False):
    """A fresh copy of workload ``name`` on ``device`` (a deep copy of the kept model, the same data)."""
    model, x, y = _built(name, device, quick)
    return copy.deepcopy(model), x, y


# ---------------------------------------------------------------------------------------------- methods
def _have_opacus() -> bool:
    try:
        import opacus  # noqa: F401
        return True
    except ImportError:
        return False


def autocast(device: torch.device, prec: str):
    """The forward's context: nothing for fp32, ``torch.autocast(device, bfloat16)`` for bf16."""
    if prec == "fp32":
        return contextlib.nullcontext()
    if prec == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {prec!r} ({', '.join(PRECISIONS)})")


# Workloads with sequence Linear layers, and with convolutions (those the switched methods below change).
SEQUENCE_LINEAR = ("W2", "W3", "G1", "G3")
CONVOLUTIONS = ("W4", "G2")

# Methods that are psgn with switches flipped: method -> (settings: "module:attribute=value" joined by
# spaces, where it differs from psgn (device type, workload, precision) -> bool, or None for everywhere, and
# what the skip line says).
def _bf16_seq(dev: str, name: str, prec: str) -> bool:
    """Where a switch of the Triton kernel that serves bfloat16 sequence Linear layers on CUDA applies."""
    return dev == "cuda" and prec == "bf16" and name in SEQUENCE_LINEAR


_KERNEL_VARIANT = ("it changes the Triton kernel's variant, which serves bfloat16 sequence Linear layers on "
                   "CUDA")
# The model under torch.compile (default Inductor backend), plainly and with elasticlab's fused norms, whose
# layers then hand their norms out of the compiled backward as gradients (elasticlab.gns.sink).
COMPILED = {"plain-compiled": "plain", "psgn-compiled": "psgn"}
# The whole eager step (forward, backward, and the norms' read) captured in one CUDA graph and replayed: no
# host work a step, so the ratio of the two is the device's alone.
GRAPHED = {"plain-graphed": "plain", "psgn-graphed": "psgn"}


def graphed(inner, device: torch.device):
    """``inner``, a step over fixed input tensors, captured in a CUDA graph after three eager steps on a side
    stream (kernel lookups, the Triton tuner's measuring, first-call allocations); each call replays it and
    returns what the captured step returned, refilled by the replay (issue 14: a step with norms has no host
    synchronisation, so it can be captured)."""
    if device.type != "cuda":
        raise Unavailable("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            inner()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = inner()

    def step():
        graph.replay()
        return out
    step.close = getattr(inner, "close", lambda: None)
    return step


def compiled(model: nn.Module, backend: str = "inductor"):
    """``torch.compile(model)`` for the compiled methods, with room in Dynamo's cache for one compiled model
    per workload copy and method (its default of 8 entries a frame would send later copies back to eager)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(model, backend=backend)

SWITCHED = {
    "psgn-ref": ("kernels:USE_KERNELS=False", None, ""),                 # the compiled kernels off
    "psgn-py": ("kernels:USE_CXX_AUTOGRAD=False", None, ""),             # Python autograd.Functions
    "psgn-torchops": ("kernels:USE_DIRECT_CALLS=False", None, ""),       # torch.ops' boxed entry
    "psgn-cublas": ("triton_outer:ENABLED=False", None, ""),             # no Triton: cuBLAS + fold
    "psgn-calibrated": ("calibrate:ENABLED=True", None, ""),             # forms timed per shape
    "psgn-triton32": ("triton_outer:FP32=True",
                      lambda dev, name, prec: dev == "cuda" and prec == "fp32" and name in SEQUENCE_LINEAR,
                      "it changes float32 sequence Linear layers on CUDA"),
    # the Triton kernel's variants, fixed instead of tuned per shape (elasticlab.gns.triton_tune)
    "psgn-untuned": ("triton_tune:ENABLED=False", _bf16_seq, _KERNEL_VARIANT),
    "psgn-tritonflat": ("triton_tune:ENABLED=False triton_outer:FLAT=True", _bf16_seq, _KERNEL_VARIANT),
    "psgn-tritontma": ("triton_tune:ENABLED=False triton_outer:TMA=True", _bf16_seq, _KERNEL_VARIANT),
    "psgn-tritontmaflat": ("triton_tune:ENABLED=False triton_outer:TMA=True triton_outer:FLAT=True",
                           _bf16_seq, _KERNEL_VARIANT),
    # each example's bias gradient summed in the Triton kernel (triton_outer.FUSE_BIAS), tuned and fixed
    "psgn-fusedbias": ("triton_outer:FUSE_BIAS=True", _bf16_seq, _KERNEL_VARIANT),
    "psgn-tmaflatbias": ("triton_tune:ENABLED=False triton_outer:TMA=True triton_outer:FLAT=True "
                         "triton_outer:FUSE_BIAS=True", _bf16_seq, _KERNEL_VARIANT),
    # the cuBLAS outer form chunked to the memory rule's share instead of giving way to the Gram form
    "psgn-chunkshare": ("form_choice:CHUNK_TO_SHARE=True",
                        lambda dev, name, prec: dev == "cuda" and prec == "fp32",
                        "it changes float32 layers on CUDA whose products pass the memory rule"),
    "psgn-convgrouped": ("layers.conv:GROUPED_ON_CUDA=True",
                         lambda dev, name, prec: dev == "cuda" and name in CONVOLUTIONS,
                         "it changes convolutions on CUDA"),
    "psgn-convtriton": ("layers.conv:TRITON_ON_CUDA=True",
                        lambda dev, name, prec: dev == "cuda" and prec == "bf16" and name in CONVOLUTIONS,
                        "it changes bfloat16 convolutions on CUDA"),
}


def _switch(method: str) -> list[tuple]:
    """[(module, attribute, value)] of a switched method's settings (modules under elasticlab.gns)."""
    import importlib
    out = []
    for item in SWITCHED[method][0].split():
        where, value = item.split("=")
        mod, attr = where.split(":")
        out.append((importlib.import_module(f"elasticlab.gns.{mod}"), attr, value == "True"))
    return out


def make_step(method: str, model: nn.Module, x, y, prec: str = "fp32", run=None):
    """A closure running one training step (forward and loss in ``prec``, backward, norms); returns the (B,)
    squared norms (None for plain). ``run``: what runs the forward (``model``, or its compiled form)."""
    dev = x.device
    run = model if run is None else run
    if method in COMPILED:
        return make_step(COMPILED[method], model, x, y, prec, run=compiled(model))
    if method in GRAPHED:
        if dev.type != "cuda":     # (before the inner step: its context would stay entered, its hooks on)
            raise Unavailable("CUDA graphs need a CUDA device")
        return graphed(make_step(GRAPHED[method], model, x, y, prec, run=run), dev)
    if method == "plain":
        def step():
            model.zero_grad(set_to_none=True)
            with autocast(dev, prec):
                loss = loss_fn(run(x), y)
            loss.backward()
        return step
    if method in SWITCHED:
        # elasticlab with switches flipped for the step (see SWITCHED)
        settings = _switch(method)
        inner = make_step("psgn", model, x, y, prec)

        def step():
            before = [getattr(mod, a) for mod, a, _ in settings]
            for mod, a, v in settings:
                setattr(mod, a, v)
            try:
                return inner()
            finally:
                for (mod, a, _), v in zip(settings, before):
                    setattr(mod, a, v)
        step.close = inner.close
        return step
    if method in ("psgn", "psgn-hooks"):
        ctx = PerSampleGradNorms(model, fused=method == "psgn").__enter__()

        def step():
            model.zero_grad(set_to_none=True)
            with autocast(dev, prec):
                loss = loss_fn(run(x), y)
            loss.backward()
            return ctx.sq_norms()
        step.close = lambda: ctx.__exit__(None, None, None)
        return step
    if method == "torch.func":
        from torch.func import functional_call, grad, vmap
        names = [k for k, _ in model.named_parameters()]

        def one(p, xi, yi):
            with autocast(dev, prec):
                return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        def step():
            params = {k: v.detach() for k, v in model.named_parameters()}
            g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
            norms = sum(v.flatten(1).pow(2).sum(1) for v in g.values())
            for k, p in zip(names, model.parameters()):
                p.grad = g[k].mean(0)
            return norms
        return step
    if method == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        if isinstance(model, GPT):
            model.contiguous_pos = True                # this copy only (see GPT)
        out_of_place(model)
        gm = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", use_ghost_clipping=True)

        def step():
            gm.zero_grad(set_to_none=True)
            with autocast(dev, prec):
                loss = loss_fn(gm(x), y)
            loss.backward()
            return gm.get_norm_sample().pow(2)        # Opacus returns norms, not squared norms
        step.close = lambda: gm._close()
        return step
    raise ValueError(f"unknown method {method!r}")


def out_of_place(model: nn.Module) -> int:
    """Turns the model's in-place activations (``inplace=True``: torchvision ResNet's ReLUs) out of place, for
    Opacus: its backward hooks wrap each layer's output in a view that an in-place op may not modify (G2
    raised "... is a view and is being modified inplace"). Same values; returns how many it changed."""
    changed = 0
    for m in model.modules():
        if getattr(m, "inplace", None) is True:
            m.inplace = False
            changed += 1
    return changed


def close(step) -> None:
    if hasattr(step, "close"):
        step.close()


def error_text(e: BaseException) -> str:
    """``error: <type>: <first line of the message>`` (at most ~160 characters), for the table and JSON."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"error: {type(e).__name__}" + (f": {lines[0]}" if lines else "")
    return text if len(text) <= 160 else text[:157] + "..."


def _free_cuda(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_memory(device) -> float:
    """Free bytes on the device (CUDA) or MemAvailable (CPU)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float("inf")


def func_skip_reason(model: nn.Module, batch: int, device) -> str | None:
    """Why torch.func should not run: its per-example gradients (B × #params × 4 bytes) would take more than
    FUNC_MEM_FRACTION of the free memory."""
    need = 4.0 * batch * sum(p.numel() for p in model.parameters() if p.requires_grad)
    free = free_memory(device)
    if need > FUNC_MEM_FRACTION * free:
        return (f"per-example gradients {need / 2**30:.1f} GiB > {FUNC_MEM_FRACTION:.0%} of free "
                f"{free / 2**30:.1f} GiB")
    return None


def check_methods(name: str, methods, device) -> tuple[dict, dict]:
    """({method: max relative error of its squared norms against torch.func}, {method: error text}), in
    float64 on the small ``check`` variant of the workload; {"reference": error text} if torch.func fails."""
    model, x, y = workload(name, check=True)
    model, x, y = model.double().to(device), x.to(device), y.to(device)
    if x.is_floating_point():
        x = x.double()
    per_example = lambda o, t: loss_fn(o, t) * o.shape[0]    # noqa: E731  (ℓ_i, the loss of example i alone)
    try:
        ref = func_sq_norms(model, per_example, x, y)
    except Exception:                                  # vmap cannot batch some layers (nn.LSTM): a loop
        try:
            ref = loop_sq_norms(model, per_example, x, y)
        except Exception as e:
            return {}, {"reference": "check " + error_text(e)}
    errs, failed = {}, {}
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)             # for scratch tensors made without a dtype (Opacus)
    try:
        for m in methods:
            if m in ("plain", "plain-compiled", "plain-graphed") or (m in GRAPHED and device.type != "cuda"):
                continue
            step = None
            try:
                step = make_step(m, model, x, y)
                got = step()
                errs[m] = float(((got - ref).abs() / ref.abs().clamp_min(1e-30)).max())
            except Exception as e:                     # reported, and the method is still timed
                failed[m] = "check " + error_text(e)
            finally:
                if step is not None:
                    close(step)
                model.zero_grad(set_to_none=True)
    finally:
        torch.set_default_dtype(dtype)
    return errs, failed


def bf16_vs_fp32(name: str, device, quick: bool) -> dict:
    """psgn's per-example squared norms under bf16 autocast against its fp32 ones, same model and batch."""
    model, x, y = build(name, device, quick)
    norms = {}
    for prec in ("fp32", "bf16"):
        step = make_step("psgn", model, x, y, prec)
        try:
            norms[prec] = step().double()
        finally:
            close(step)
    rel = (norms["bf16"] - norms["fp32"]).abs() / norms["fp32"].abs().clamp_min(1e-30)
    return {"median_rel_err": float(rel.median()), "max_rel_err": float(rel.max())}


# ---------------------------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _form_times(us: dict[str, float]) -> str:
    """"form 123 us, other 98 us*": each form's time, the fastest starred."""
    best = min(us, key=us.get)
    return ", ".join(f"{f} {t:.0f} us" + ("*" if f == best else "") for f, t in us.items())


def _layer_label(key: tuple) -> str:
    """A calibrated layer shape's key (:func:`elasticlab.gns.calibrate.key_of`), short: "linear BxTxDin->Dout"
    or "Conv2d (B, C, H, W) * (Cout, Cin/G, k...) /stride"."""
    if key[0] == "linear":
        return "linear {}x{}x{}->{}".format(*key[1:5])
    if key[0] == "conv":
        return f"{key[1]} {key[2]} * {key[3]} /{key[4]}" + (f" groups {key[7]}" if key[7] != 1 else "")
    return str(key)


def time_methods(name: str, methods, device, iters: int, warmup: int, quick: bool, prec: str = "fp32",
                 clock=time.perf_counter, slow_s: float = 1.0) -> tuple[dict, dict]:
    """({method: median seconds a step}, {method: error text}). Methods run round by round; one whose step
    takes more than ``slow_s`` skips the rest of its warm-up and is timed 3 times only."""
    steps, errors = {}, {}
    for m in methods:                                  # one model per method
        try:
            model, x, y = build(name, device, quick)
            steps[m] = make_step(m, model, x, y, prec)
        except Exception as e:
            errors[m] = error_text(e)
    times = {m: [] for m in steps}
    slow = set()
    try:
        for r in tqdm(range(warmup + iters), desc=f"{name}-{prec}", leave=False,
                      disable=not sys.stderr.isatty()):
            for m in list(steps):
                if len(times[m]) >= (min(3, iters) if m in slow else iters):
                    continue
                try:
                    if device.type == "cuda":
                        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        t0.record()
                        steps[m]()
                        t1.record()
                        _sync(device)
                        dt = t0.elapsed_time(t1) / 1e3
                    else:
                        t = clock()
                        steps[m]()
                        dt = clock() - t
                except Exception as e:
                    errors[m] = error_text(e)
                    close(steps.pop(m))
                    times.pop(m)
                    _free_cuda(device)
                    continue
                if r >= warmup or m in slow:
                    times[m].append(dt)
                if dt > slow_s:
                    slow.add(m)                        # e.g. torch.func on W1: a few timings suffice
    finally:
        for s in steps.values():
            close(s)
        steps.clear()
        _free_cuda(device)
    return {m: statistics.median(v) for m, v in times.items() if v}, errors


def peak_memory(name: str, method: str, device, quick: bool, prec: str = "fp32") -> float:
    """Peak bytes of a step beyond what model and data hold (CUDA), or the child process's peak RSS (CPU)."""
    if device.type == "cuda":
        _free_cuda(device)
        model, x, y = build(name, device, quick)
        step = make_step(method, model, x, y, prec)
        try:
            step()
            model.zero_grad(set_to_none=True)
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            _sync(device)
            return float(torch.cuda.max_memory_allocated(device) - base)
        finally:
            close(step)
            del model, step
            _free_cuda(device)
    cmd = [sys.executable, os.path.abspath(__file__), "--mem-child", name, method, prec,
           "--threads", str(torch.get_num_threads())]
    if quick:
        cmd.append("--quick")
    # Large blocks straight from mmap, so that freed memory leaves the RSS and its peak is the step's.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        raise RuntimeError(f"memory child: {last}")
    return float(res.stdout.strip().splitlines()[-1])


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _mem_child(name: str, method: str, prec: str, quick: bool) -> None:
    """Peak RSS of steps 2–3 above the RSS before them (VmHWM reset through /proc/self/clear_refs)."""
    model, x, y = workload(name, quick)
    step = make_step(method, model, x, y, prec)
    step()                                             # first step: grads, lazily built state
    model.zero_grad(set_to_none=True)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_kb("VmRSS")
        for _ in range(2):
            step()
        print(_status_kb("VmHWM") - base)
    except OSError:                                    # no clear_refs: fall back to ru_maxrss
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        for _ in range(2):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0 - base)


# ---------------------------------------------------------------------------------------------- main
def parse_entries(spec: str, precisions) -> list[tuple[str, str]]:
    """``"W1,G1:fp32+bf16"`` → [(W1, p) for p in precisions] + [(G1, fp32), (G1, bf16)]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, prec = item.partition(":")
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")
        for p in (prec.split("+") if prec else precisions):
            if p not in PRECISIONS:
                raise SystemExit(f"unknown precision {p!r} in {item!r} ({', '.join(PRECISIONS)})")
            if (name, p) not in out:
                out.append((name, p))
    return out


def print_rounds(workloads: dict, entries) -> dict:
    """{NAME-PREC: {method: [ratio of each round that timed it]}} from the RESULT entries of ``--rounds``
    (keys NAME-PREC, NAME-PREC#2, …), printed with their median, minimum and maximum."""
    out = {}
    print("\nrounds (ratio to plain in each round; median, min-max):")
    for name, prec in entries:
        key = f"{name}-{prec}"
        runs = [v for k, v in workloads.items() if k == key or k.startswith(key + "#")]
        methods = dict.fromkeys(m for r in runs for m in r.get("ratio", {}))
        out[key] = {m: [r["ratio"][m] for r in runs if m in r.get("ratio", {})] for m in methods}
        for m, v in out[key].items():
            print(f"  {key:10s} {m:16s} " + " ".join(f"{x:.2f}" for x in v)
                  + f"   median {statistics.median(v):.2f}, {min(v):.2f}-{max(v):.2f}")
        for m, (paired, wins) in against_psgn(runs).items():
            print(f"  {key:10s} {m:16s} / psgn " + " ".join(f"{x:.3f}" for x in paired)
                  + f"   faster in {wins} of {len(paired)} rounds")
    return out


def against_psgn(runs: list[dict]) -> dict[str, tuple[list[float], int]]:
    """Each method derived from psgn (``psgn-…``: a switch flipped) against psgn in the same round, where
    both were timed: {method: (its time over psgn's in each such round, in how many it was faster)}. Paired
    within a round, so that the drift between rounds of a host-bound step cancels; a switch goes on only
    where it is faster in every round."""
    out = {}
    for m in dict.fromkeys(m for r in runs for m in r.get("ratio", {}) if m.startswith("psgn-")):
        paired = [r["ratio"][m] / r["ratio"]["psgn"] for r in runs
                  if m in r.get("ratio", {}) and r["ratio"].get("psgn")]
        if paired:
            out[m] = (paired, sum(x < 1.0 for x in paired))
    return out


def run_entry(name: str, prec: str, methods, device, args, checked: dict, first: bool = True) -> dict:
    """Check, time and measure one (workload, precision); prints its table and returns its RESULT entry.
    ``first``: the entry's first round (later ones skip the bf16-against-fp32 comparison)."""
    quick = args.quick
    if name not in checked:                            # the float64 check does not depend on the precision
        checked[name] = check_methods(name, methods, device)
    errs, failed = checked[name]
    entry = {"precision": prec, "check_rel_err": errs, "skipped": {},
             "errors": {m: e for m, e in failed.items() if m != "reference"}}
    if "reference" in failed:
        entry["check_error"] = failed["reference"]
    run = list(methods)
    for m in [m for m in run if m in SWITCHED and SWITCHED[m][1] is not None]:
        if not SWITCHED[m][1](device.type, name, prec):
            entry["skipped"][m] = f"= psgn here ({SWITCHED[m][2]})"
            run.remove(m)
    for m in [m for m in run if m in GRAPHED and device.type != "cuda"]:
        entry["skipped"][m] = "CUDA graphs need a CUDA device"
        run.remove(m)
    for m in [m for m in run if "tma" in m and not triton_tune.TMA]:
        entry["skipped"][m] = "TMA kept out (ELASTICLAB_TRITON_TMA=0)"
        run.remove(m)
    if "torch.func" in run:
        model, x, _ = _built(name, device, quick)
        why = func_skip_reason(model, x.shape[0], device)
        if why:
            entry["skipped"]["torch.func"] = why
            run.remove("torch.func")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tuned_before, calibrated_before = set(triton_tune.tunings()), set(calibrate.timings())
    med, terr = time_methods(name, run, device, args.iters, args.warmup, quick, prec, clock, args.slow_s)
    entry["errors"].update(terr)
    # the Triton kernel's variants timed for this workload's shapes (psgn's first steps; triton_tune)
    entry["tuned_us"] = {"{}x{}x{}->{}".format(*k[:4]) + ("" if k[6] else " norms only"):
                         {v: t * 1e6 for v, t in times.items()}
                         for k, times in triton_tune.tunings().items() if k not in tuned_before}
    # every form of each layer shape timed by psgn-calibrated (elasticlab.gns.calibrate), and those its memory
    # rule kept out: which form each layer would best take, beside the static choice psgn makes
    left = calibrate.left_out()
    entry["calibrated_us"] = {
        _layer_label(k): {"us": {f: t * 1e6 for f, t in times.items()},
                          "left_out_mb": {f: b / 2**20 for f, b in left.get(k, {}).items()}}
        for k, times in calibrate.timings().items() if k not in calibrated_before}
    if "plain" not in med:
        raise RuntimeError(f"plain step failed: {terr.get('plain')}")
    base = med["plain"]
    entry["baseline_ms"] = base * 1e3
    entry["ms"] = {m: t * 1e3 for m, t in med.items()}
    entry["ratio"] = {m: t / base for m, t in med.items() if m != "plain"}
    if "psgn-graphed" in med and "plain-graphed" in med:           # replays against replays
        entry["graphed_ratio"] = med["psgn-graphed"] / med["plain-graphed"]
    if not args.no_memory:
        mem = {}
        for m in [m for m in run if m in med]:
            try:
                mem[m] = peak_memory(name, m, device, quick, prec)
            except Exception as e:
                entry["errors"].setdefault(m, "memory " + error_text(e))
        if "plain" in mem:
            entry["baseline_peak_mb"] = mem["plain"] / 2**20
            entry["extra_mb"] = {m: (v - mem["plain"]) / 2**20 for m, v in mem.items() if m != "plain"}
            entry["extra_pct"] = {m: 100 * (v - mem["plain"]) / max(mem["plain"], 1.0)
                                  for m, v in mem.items() if m != "plain"}
    if prec == "bf16" and "psgn" in methods and first:
        try:
            entry["bf16_vs_fp32"] = bf16_vs_fp32(name, device, quick)
        except Exception as e:
            entry["bf16_vs_fp32"] = {"error": error_text(e)}
    _free_cuda(device)

    head = f"\n{name}-{prec}: plain {base * 1e3:.2f} ms"
    if "baseline_peak_mb" in entry:
        head += f", step peak {entry['baseline_peak_mb']:.0f} MB"
    print(head + "  (check vs torch.func, float64: "
          + ", ".join([f"{m} {e:.1e}" for m, e in errs.items()]
                      + [f"{m} error" if m != "reference" else e for m, e in failed.items()]) + ")")
    for m in methods[1:]:
        if m in entry["skipped"]:
            line = f"skipped: {entry['skipped'][m]}"
        elif m not in med:
            line = entry["errors"].get(m, "error: no timing")
        else:
            line = f"{med[m] * 1e3:9.2f} ms  {med[m] / base:6.2f}x"
            if m in entry.get("extra_mb", {}):
                line += f"  extra peak {entry['extra_mb'][m]:+8.1f} MB ({entry['extra_pct'][m]:+.1f}%)"
            if m in entry["errors"]:
                line += f"  [{entry['errors'][m]}]"
        print(f"  {m:16s} {line}")
    if "graphed_ratio" in entry:
        print(f"  psgn-graphed / plain-graphed {entry['graphed_ratio']:.2f}x")
    for shape, times in entry["tuned_us"].items():
        print(f"  tuned {shape}: {_form_times(times)}")
    for layer, c in entry["calibrated_us"].items():
        print(f"  calibrated {layer}: {_form_times(c['us'])}"
              + "".join(f", {f} left out ({mb:.0f} MB)" for f, mb in c["left_out_mb"].items()))
    if "bf16_vs_fp32" in entry:
        b = entry["bf16_vs_fp32"]
        print("  bf16 vs fp32 psgn norms (same batch): " + (b["error"] if "error" in b else
              f"median rel err {b['median_rel_err']:.2e}, max {b['max_rel_err']:.2e}"))
    bad = {m: e for m, e in errs.items() if e > 1e-6}
    if bad:
        print(f"  WARNING: methods disagree with torch.func: {bad}")
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--workloads", default=None,
                    help=f"entries NAME or NAME:PREC[+PREC] (default {DEFAULT_CPU}; on cuda {DEFAULT_CUDA})")
    ap.add_argument("--precision", default="fp32", help="precisions of entries without one: fp32,bf16")
    ap.add_argument("--methods",
                    default="plain,psgn,psgn-ref,psgn-hooks,psgn-calibrated,psgn-triton32,psgn-untuned,"
                            "psgn-tritonflat,"
                            "psgn-tritontma,psgn-tritontmaflat,psgn-fusedbias,psgn-chunkshare,psgn-convgrouped,"
                            "psgn-convtriton,torch.func,"
                            "opacus-ghost")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--slow-s", type=float, default=1.0, help="a method slower than this a step is timed 3×")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time, steadier on a busy machine (use with --threads 1)")
    ap.add_argument("--quick", action="store_true", help="small batches and few iterations (smoke test)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every entry this many times, round-robin (keys NAME-PREC#2, …), and print "
                    "each method's ratios over the rounds: the spread of a host-bound step's ratio")
    ap.add_argument("--max-s", type=float, default=0.0,
                    help="start no new workload entry after this many seconds (0: no limit)")
    ap.add_argument("--mem-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mem_child:
        _mem_child(*args.mem_child, args.quick)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    spec = args.workloads or (DEFAULT_CUDA if device.type == "cuda" else DEFAULT_CPU)
    entries = parse_entries(spec, [p for p in args.precision.split(",") if p])
    methods = [m for m in args.methods.split(",") if m]
    if "opacus-ghost" in methods and not _have_opacus():
        print("opacus not installed: skipping opacus-ghost (pip install 'elasticlab[bench]')")
        methods.remove("opacus-ghost")
    methods = ["plain"] + [m for m in methods if m != "plain"]
    if args.quick:
        args.iters, args.warmup = 3, 1
    from elasticlab import _ext
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, _C built {_ext.HAS_C}, "
          f"kernels {_ext.operators()}")
    result = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "clock": args.clock, "quick": args.quick, "workloads": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    checked: dict = {}
    start = time.perf_counter()
    for rnd, (name, prec) in [(r, e) for r in range(args.rounds) for e in entries]:
        key = f"{name}-{prec}" + (f"#{rnd + 1}" if rnd else "")
        t0 = time.perf_counter()
        if args.max_s and t0 - start > args.max_s:     # so that RESULT comes before an outer timeout
            print(f"\n{key}: skipped (past --max-s {args.max_s:.0f} s)")
            result["workloads"][key] = {"precision": prec, "skipped_workload": f"past --max-s {args.max_s} s"}
            continue
        try:
            result["workloads"][key] = run_entry(name, prec, methods, device, args, checked, rnd == 0)
        except Unavailable as e:
            print(f"\n{key}: skipped ({e})")
            result["workloads"][key] = {"precision": prec, "skipped_workload": str(e)}
        except Exception as e:                         # the plain step itself failed: record, go on
            print(f"\n{key}: {error_text(e)}")
            result["workloads"][key] = {"precision": prec, "error": error_text(e)}
        result["workloads"][key]["wall_s"] = time.perf_counter() - t0
        print(f"  ({time.perf_counter() - t0:.1f} s)")
        _free_cuda(device)
    if args.rounds > 1:
        result["rounds"] = print_rounds(result["workloads"], entries)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
