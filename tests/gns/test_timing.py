"""The timed choice among interchangeable forms (elasticlab.gns.timing): a form whose result departs from the
first form's is left out, however fast; rounding in another order, or the gradient in half precision, is
not a departure."""
import warnings

import pytest
import torch

from elasticlab.gns import timing

CPU = torch.device("cpu")


def _result(seed=0):
    g = torch.Generator().manual_seed(seed)
    norms = torch.rand(6, generator=g, dtype=torch.float64) + 0.1
    grad = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return norms.float(), grad.float()


def test_rounding_and_a_half_precision_gradient_agree():
    n, g = _result()
    assert timing.disagreement((n * (1 + 1e-4), g.bfloat16()), (n, g)) is None
    assert timing.disagreement((n, None), (n, None)) is None
    assert timing.disagreement("outer", "gram") is None                  # not tensors: not compared
    inf = n.clone()
    inf[2] = float("inf")
    assert timing.disagreement((inf, g), (inf.clone(), g)) is None        # overflowed alike (fp16)


@pytest.mark.parametrize("break_it, where", [
    (lambda n, g: (n.index_fill(0, torch.tensor([4]), 0.0), g), "result 0"),       # an example dropped
    (lambda n, g: (n, g.index_fill(0, torch.tensor([0, 1]), 0.0)), "result 1"),    # a tile not stored
    (lambda n, g: (n * 1.05, g), "result 0"),                                       # 5% off everywhere
    (lambda n, g: (n, None), "result 1: NoneType against shape (8, 5)"),
    (lambda n, g: (n, g[:4]), "result 1: torch.Size"),
    (lambda n, g: (n.index_fill(0, torch.tensor([1]), float("nan")), g), "non-finite entries elsewhere"),
    (lambda n, g: (n,), "1 results against 2"),
])
def test_a_wrong_result_is_a_departure(break_it, where):
    n, g = _result()
    why = timing.disagreement(break_it(n.clone(), g.clone()), (n, g))
    assert why is not None and where in why


def test_a_fast_form_with_a_wrong_result_is_left_out(monkeypatch):
    n, g = _result()
    forms = {"reference": lambda: (n, g), "fast-but-wrong": lambda: (n, g * 0.5), "slower": lambda: (n, g)}
    clock = {"reference": 3.0, "fast-but-wrong": 1.0, "slower": 2.0}
    calls = []

    def elapsed(fn, device, repeats=3):
        name = next(k for k, f in forms.items() if f is fn)
        calls.append(name)
        return clock[name]
    monkeypatch.setattr(timing, "elapsed", elapsed)
    with pytest.warns(RuntimeWarning, match="fast-but-wrong.*disagrees with reference: result 1"):
        name, out, times = timing.fastest(forms, CPU, 1, "test")
    assert name == "slower" and set(times) == {"reference", "slower"} and calls == ["reference", "slower"]
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # all agree: no warning
        assert timing.fastest({"a": lambda: (n, g), "b": lambda: (n, g.bfloat16())}, CPU, 1, "t")[0] in "ab"
