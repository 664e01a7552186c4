import gc
import os
import shutil
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    have_browser = shutil.which("chromium") is not None or os.path.exists("/usr/bin/chromium")
    try:
        import playwright  # noqa: F401
    except ImportError:
        have_browser = False
    # CI sets ELASTICLAB_REQUIRE_BROWSER=1: there a missing browser is a failure, not a skip.
    require_browser = os.environ.get("ELASTICLAB_REQUIRE_BROWSER") == "1"
    no_browser = pytest.mark.skip(reason="needs /usr/bin/chromium and playwright")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "browser" in item.keywords and not have_browser and not require_browser:
            item.add_marker(no_browser)


def pytest_sessionfinish(session, exitstatus):
    """TorchDynamo's caches (compiled code, guards that hold tensors and closures) cleared while the
    interpreter is whole, not left to its teardown (a clean-clone run once segfaulted at its exit, after
    every test had passed)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    gc.collect()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _compiler_stance_given_back():
    """No test may leave torch.compile's stance changed (PerSampleGradNorms' eager_first holds it for one
    step): it would run every later test's compiled model eagerly. An error at the test that did."""
    yield
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and eval_frame._stance.stance != "default":
        left = eval_frame._stance.stance
        from elasticlab.gns.eager_first import EagerFirst
        EagerFirst._holders, EagerFirst._stance = 0, None
        torch.compiler.set_stance("default")
        pytest.fail(f"the test left torch.compile's stance at {left!r}")
