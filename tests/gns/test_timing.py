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


class _Bar:
    """A stand-in for tqdm that records what it is told."""
    made: list = []

    def __init__(self, total, desc, unit, leave, disable):
        self.total, self.desc, self.leave, self.n, self.names, self.closed = total, desc, leave, 0, [], False
        assert disable is None                      # tqdm's own rule: off where stderr is not a terminal
        _Bar.made.append(self)

    def set_postfix_str(self, s, refresh=True):
        self.names.append(s)

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def bars(monkeypatch):
    import tqdm.auto
    _Bar.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    return _Bar.made


def test_a_progress_bar_advances_a_form_at_a_time_and_closes(bars, monkeypatch):
    """Every form counts, kept or left out (one raises, one disagrees), and the bar closes even when all
    raise; no ``desc``, PROGRESS off or a distributed rank other than 0: no bar."""
    n, g = _result()

    def boom():
        raise RuntimeError("no")
    forms = {"a": lambda: (n, g), "b": boom, "c": lambda: (n * 2, g), "d": lambda: (n, g)}
    with pytest.warns(RuntimeWarning):
        timing.fastest(forms, CPU, 1, "label", desc="tune 2x3")
    (bar,) = bars
    assert (bar.total, bar.desc, bar.leave, bar.n, bar.names, bar.closed) == (
        4, "tune 2x3", False, 4, ["a", "b", "c", "d"], True)
    with pytest.raises(RuntimeError, match="no"):
        timing.fastest({"b": boom}, CPU, 1, "label", desc="all fail")
    assert bars[1].closed and bars[1].n == 1
    timing.fastest(forms | {"b": lambda: (n, g), "c": lambda: (n, g)}, CPU, 1, "label")        # no desc
    monkeypatch.setattr(timing, "PROGRESS", False)
    timing.fastest({"a": forms["a"]}, CPU, 1, "label", desc="off")
    monkeypatch.setattr(timing, "PROGRESS", True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    timing.fastest({"a": forms["a"]}, CPU, 1, "label", desc="rank 1")
    assert len(bars) == 2
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    timing.fastest({"a": forms["a"]}, CPU, 1, "label", desc="rank 0")
    assert [b.desc for b in bars] == ["tune 2x3", "all fail", "rank 0"]


def test_without_tqdm_the_forms_are_timed_without_a_bar(monkeypatch):
    """A bare environment running the package from source (a GPU machine) may lack tqdm: no bar, no error."""
    import sys
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)                      # import fails
    n, g = _result()
    assert timing._progress(2, "tune") is None
    assert timing.fastest({"a": lambda: (n, g), "b": lambda: (n, g)}, CPU, 1, "label", desc="tune")[0] in "ab"
