"""Device time of one call, and the fastest of several interchangeable calls: what the per-shape choices
share (:mod:`elasticlab.gns.calibrate`'s forms, :mod:`elasticlab.gns.triton_tune`'s Triton forms)."""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable

import torch


def elapsed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Seconds of one call of ``fn``: the best of ``repeats`` calls, between CUDA events on a GPU (the stream
    is drained at each call's end), by the wall clock elsewhere. The caller warms ``fn`` up first (a Triton
    kernel compiles at its first call)."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            with torch.cuda.device(device):          # the events on the stream of the device that runs fn
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                fn()
                t1.record()
                t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


# Forms compute the same sums in other orders (and the fused Gram form its gradient in the inputs' dtype, one
# half-precision rounding: 2^-9 relative): their results agree to this relative tolerance, with an absolute
# floor of AGREE_FLOOR of it times the largest entry (sums that cancel to near zero). A form further off is
# wrong, not rounded differently: a kernel that drops an example, a tile or a row is off by O(1).
AGREE_RTOL, AGREE_FLOOR = 2e-2, 5e-2


def disagreement(out, ref) -> str | None:
    """Where ``out`` departs from ``ref`` (a tensor, or a tuple or list of tensors and Nones, as the forms
    return): None where every tensor agrees, elementwise, to |x − r| ≤ AGREE_RTOL·(|r| + AGREE_FLOOR·max|r|)
    with its non-finite entries where ``ref`` has them; else which entry and how far. Results that are not
    tensors are not compared."""
    outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
    if not isinstance(refs, (tuple, list)) or len(outs) != len(refs):
        return f"{len(outs)} results against {len(refs) if isinstance(refs, (tuple, list)) else 1}"
    for i, (x, r) in enumerate(zip(outs, refs)):
        if not isinstance(r, torch.Tensor):
            if isinstance(x, torch.Tensor) or (r is None) != (x is None):
                return f"result {i}: {type(x).__name__} against {type(r).__name__}"
            continue
        if not isinstance(x, torch.Tensor) or x.shape != r.shape:
            return f"result {i}: {getattr(x, 'shape', type(x).__name__)} against shape {tuple(r.shape)}"
        x, r = x.detach().float(), r.detach().float()
        fin = torch.isfinite(r)
        if not torch.equal(fin, torch.isfinite(x)):
            return f"result {i}: non-finite entries elsewhere"
        x, r = x[fin], r[fin]
        if r.numel() == 0:
            continue
        diff, scale = (x - r).abs(), r.abs()
        if bool((diff > AGREE_RTOL * (scale + AGREE_FLOOR * scale.max())).any()):
            return (f"result {i}: max |difference| {float(diff.max()):.3g} against max |reference| "
                    f"{float(scale.max()):.3g}")
    return None


# A tqdm bar (``leave=False``) while :func:`fastest` times its forms: on a GPU a shape's first call compiles
# and times each of its forms (a couple of dozen for a wide 16-bit sequence Linear), which can take seconds.
# Not on a distributed rank other than 0 (every rank times its own shapes: one bar is enough).
PROGRESS = True


def _progress(total: int, desc: str | None):
    """The bar of :data:`PROGRESS` for ``total`` forms, or None (off, no ``desc``, a rank other than 0, or no
    tqdm)."""
    if not (PROGRESS and desc):
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:        # installed with the package, but a bare GPU environment may run it from source
        return None
    # disable=None: off where stderr is no terminal (a log file); a notebook shows its widget either way
    return tqdm(total=total, desc=desc, unit="form", leave=False, disable=None)


def fastest(forms: dict[str, Callable[[], object]], device: torch.device, repeats: int,
            label: str, desc: str | None = None) -> tuple[str, object, dict[str, float]]:
    """(name, result, {name: seconds}) of the fastest of ``forms`` (name → call; their results
    interchangeable): each called once to warm up (Triton compiles there), then timed by :func:`elapsed`. A
    form that raises, or whose warm-up result departs from the first form's (:func:`disagreement`: a wrong
    kernel, which could otherwise be kept for being fast), is left out, with a RuntimeWarning "``label``:
    {name: why}"; if all raise, the last error propagates. ``desc``: the progress bar's title
    (:data:`PROGRESS`), the bar advancing a form at a time (closed on leaving, an error too)."""
    best_name, best_out, best_t, times, err, failed = None, None, float("inf"), {}, None, {}
    ref_name = ref = None
    bar = _progress(len(forms), desc)
    with bar if bar is not None else contextlib.nullcontext():
        for name, fn in forms.items():
            if bar is not None:
                bar.set_postfix_str(name, refresh=False)
                bar.update()
            try:
                out = fn()
                why = None if ref_name is None else disagreement(out, ref)
                if why is not None:
                    failed[name] = f"disagrees with {ref_name}: {why}"
                    continue
                t = elapsed(fn, device, repeats)
            except Exception as e:       # e.g. Triton's OutOfResources for this tile, CUDA out of memory
                err, failed[name] = e, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                continue
            if ref_name is None:
                ref_name, ref = name, out
            times[name] = t
            if t < best_t:
                best_name, best_out, best_t = name, out, t
            del out
    if best_name is None:
        raise err if err is not None else ValueError(f"{label}: no form to time")
    if failed:
        warnings.warn(f"{label}: {failed}", RuntimeWarning, stacklevel=3)
    return best_name, best_out, times
