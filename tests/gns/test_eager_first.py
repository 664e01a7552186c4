"""``eager_first`` (gns.eager_first): the first training step inside PerSampleGradNorms runs eagerly, the
compiled model's too, and the compiler's stance is given back after it: when the step is read, when the next
training forward begins, or when the context is left; the stance found before is what comes back."""
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

from elasticlab.gns import GNSMonitor, PerSampleGradNorms


def stance() -> str:
    from torch._dynamo import eval_frame
    return eval_frame._stance.stance


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _step(run, x):
    run(x).pow(2).sum().backward()


@pytest.mark.parametrize("release", ["read", "next_forward", "exit"])
def test_the_first_step_is_eager_and_the_stance_comes_back(release):
    """While held, the compiled model runs eagerly (no frame compiled); after the release point the next
    step compiles, and the stance is the default again."""
    assert stance() == "default"
    model, x = _model(), torch.randn(5, 3, dtype=torch.float64)
    torch._dynamo.reset()
    counter = CompileCounter()
    run = torch.compile(model, backend=counter)
    try:
        with PerSampleGradNorms(model) as psn:
            assert stance() == "force_eager"
            _step(run, x)
            assert counter.frame_count == 0 and stance() == "force_eager"
            if release == "read":
                psn.sq_norms()
                assert stance() == "default"
            if release != "exit":
                _step(run, x)
                assert stance() == "default"
                # read: this step compiled; next forward: it began eagerly, the one after compiles
                _step(run, x)
                assert counter.frame_count >= 1
                psn.sq_norms()
        assert stance() == "default"
    finally:
        torch._dynamo.reset()


def test_eager_first_false_and_later_entries_leave_the_stance_alone():
    """``eager_first=False`` never changes the stance; a context that has seen a training step (GNSMonitor
    enters it at every measured step) does not hold it again; a step without gradients does not count."""
    model, x = _model(), torch.randn(5, 3, dtype=torch.float64)
    with PerSampleGradNorms(model, eager_first=False):
        assert stance() == "default"
    psn = PerSampleGradNorms(model)
    with psn:
        with torch.no_grad():
            model(x)
        assert stance() == "force_eager"                 # (an evaluation forward is not the training step)
        _step(model, x)
        psn.sq_norms()
    with psn:
        assert stance() == "default"
    assert stance() == "default"


def test_contexts_released_in_any_order_give_the_stance_back():
    """Two contexts entered together (as a benchmark's methods are) and released first-in first-out: the
    stance is forced until the last one releases, then the default (before: a second holder's saved
    stance was the first one's forced one, and it stayed forced)."""
    a_model, b_model, x = _model(), _model(), torch.randn(5, 3, dtype=torch.float64)
    a, b = PerSampleGradNorms(a_model).__enter__(), PerSampleGradNorms(b_model).__enter__()
    try:
        _step(a_model, x)
        a.sq_norms()
        assert stance() == "force_eager"
        _step(b_model, x)
        b.sq_norms()
        assert stance() == "default"
    finally:
        a.__exit__(None, None, None)
        b.__exit__(None, None, None)
    assert stance() == "default"


def test_a_stance_set_by_the_user_is_restored():
    model, x = _model(), torch.randn(5, 3, dtype=torch.float64)
    torch.compiler.set_stance("eager_on_recompile")
    try:
        with PerSampleGradNorms(model) as psn:
            assert stance() == "force_eager"
            _step(model, x)
            psn.sq_norms()
            assert stance() == "eager_on_recompile"
    finally:
        torch.compiler.set_stance("default")


def test_a_monitor_on_a_compiled_model_compiles_from_its_second_step():
    """GNSMonitor on a compiled model: the first measured step eager, the second compiled, every step
    measured per example (a compiled graph exists after the second step, none after the first)."""
    model = _model()
    torch._dynamo.reset()
    counter = CompileCounter()
    run = torch.compile(model, backend=counter)
    mon = GNSMonitor(model, every=1)
    frames = []
    try:
        for _ in range(3):
            with mon.step():
                _step(run, torch.randn(6, 3, dtype=torch.float64))
            frames.append(counter.frame_count)
            assert stance() == "default"
        assert frames[0] == 0 and frames[1] >= 1
        assert [h["method"] for h in mon.history] == ["per_example"] * 3
    finally:
        mon.close()
        torch._dynamo.reset()
