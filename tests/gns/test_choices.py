"""Per-shape choices kept (elasticlab.gns.choices): saved and loaded as JSON, atomically, not taken from
another GPU model, agreed across gloo ranks; the tuners run a loaded choice without timing."""
import json
import os

import pytest
import torch
from gloo_util import run_gloo

from elasticlab.gns import calibrate, choices, triton_tune

CPU = torch.device("cpu")
TUNE_KEY = (4, 8, 16, 32, torch.float16, CPU, True, False, True, None)
CAL_KEY = calibrate.key_of("conv", "Conv2d", (2, 3, 8, 8), (4, 3, 3, 3), (1, 1), torch.float32, CPU)


@pytest.fixture(autouse=True)
def fresh():
    triton_tune.reset()
    calibrate.reset()
    yield
    triton_tune.reset()
    calibrate.reset()


def _choose():
    triton_tune.keep(TUNE_KEY, ("tma-flat-swap", (128, 128, 64, 8, 4, 1, True, True)),
                     {"tma-flat-swap": 1e-4, "pointer-nested": 2e-4})
    norms_only = (4, 8, 16, 32, torch.float16, CPU, False, False, True, "apart")
    triton_tune.keep(norms_only, ("ghost-64", (64, 32, 4, 3)), {"ghost-64": 3e-5})
    calibrate.keep(CAL_KEY, "gram", {"gram": 1e-3, "outer": 2e-3})


def test_saved_choices_load_back_as_they_were(tmp_path):
    _choose()
    before_tune, before_cal = triton_tune.kept(), calibrate.kept()
    times = triton_tune.tunings()
    path = tmp_path / "choices.json"
    assert choices.save(path) == 3
    data = json.loads(path.read_text())
    assert data["format"] == choices.FORMAT and data["devices"] == {"cpu": "cpu"}
    triton_tune.reset()
    calibrate.reset()
    assert choices.load(path, device=CPU) == 3
    assert triton_tune.kept() == before_tune and calibrate.kept() == before_cal
    assert triton_tune.tunings() == times
    assert isinstance(triton_tune.kept()[TUNE_KEY][1], tuple)            # configs come back as tuples


def test_load_keeps_this_process_choices_unless_replace(tmp_path):
    _choose()
    path = tmp_path / "c.json"
    choices.save(path)
    calibrate.keep(CAL_KEY, "outer", {"outer": 1e-3})
    assert choices.load(path, device=CPU) == 0                              # every shape already chosen here
    assert calibrate.kept()[CAL_KEY] == "outer"
    assert choices.load(path, device=CPU, replace=True) == 3
    assert calibrate.kept()[CAL_KEY] == "gram"


def test_choices_of_another_gpu_model_are_not_taken(monkeypatch):
    """A snapshot whose CUDA choices were measured on another GPU: those are left out with a warning that
    names both; a key's device comes back as the local device."""
    snap = {"format": choices.FORMAT, "torch": torch.__version__, "triton": choices._versions()["triton"],
            "devices": {"cuda": "NVIDIA H100 80GB HBM3", "cpu": "cpu"},
            "triton_tune": [{"key": choices._enc((4, 8, 16, 32, torch.bfloat16, torch.device("cuda", 3), True,
                                                   True, True, None)), "form": "tma-flat", "config": None,
                             "times": {}}],
            "calibrate": [{"key": choices._enc(CAL_KEY), "form": "gram", "config": None, "times": {}}]}
    monkeypatch.setattr(choices, "_device_name", lambda kind: "NVIDIA H200" if kind == "cuda" else "cpu")
    with pytest.warns(RuntimeWarning, match="measured on NVIDIA H100 80GB HBM3, not here \\(NVIDIA H200\\)"):
        assert choices.restore(snap, device=CPU) == 1
    assert triton_tune.kept() == {} and calibrate.kept() == {CAL_KEY: "gram"}
    monkeypatch.setattr(choices, "_device_name", lambda kind: snap["devices"][kind])
    assert choices.restore(snap, device=torch.device("cuda", 1)) == 1      # the H100's, on local cuda:1
    (key,) = triton_tune.kept()
    assert key[5] == torch.device("cuda", 1) and key[4] is torch.bfloat16


def test_a_version_change_is_warned_about_and_bad_files_name_themselves(tmp_path):
    _choose()
    snap = choices.snapshot()
    snap["torch"] = "0.0.1"
    triton_tune.reset()
    calibrate.reset()
    with pytest.warns(RuntimeWarning, match="measured with torch 0.0.1"):
        assert choices.restore(snap, device=CPU) == 3
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 99}')
    with pytest.raises(ValueError, match=f"cannot load '{bad}'.*format 1 \\(got 99\\)"):
        choices.load(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError, match="cannot load"):
        choices.load(bad)
    with pytest.raises(TypeError, match="cannot save a key part of type list"):
        choices._enc([1, 2])


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    _choose()
    path = tmp_path / "c.json"
    choices.save(path)
    old = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(choices.json, "dump", boom)
    with pytest.raises(OSError, match="disk full"):
        choices.save(path)
    assert path.read_text() == old
    assert os.listdir(tmp_path) == ["c.json"]


def test_a_loaded_choice_runs_without_timing(monkeypatch):
    """calibrate.run takes a loaded choice's form and times nothing."""
    monkeypatch.setattr(calibrate, "ENABLED", True)
    calibrate.keep(CAL_KEY, "gram", {})
    snap = choices.snapshot()
    calibrate.reset()
    choices.restore(snap, device=CPU)

    def no_timing(*a, **k):
        raise AssertionError("timed a loaded shape")
    monkeypatch.setattr(calibrate.timing, "fastest", no_timing)
    assert calibrate.run(CAL_KEY, {"outer": lambda: "outer", "gram": lambda: "gram"}, CPU) == "gram"


def _agree_body(rank):
    calibrate.reset()
    calibrate.keep(CAL_KEY, "gram" if rank == 0 else "outer", {})
    other = calibrate.key_of("linear", 1, 2, 3, 4, torch.float32, CPU)
    if rank == 1:
        calibrate.keep(other, "outer", {})                   # a shape rank 0 has not chosen: stays
    taken = choices.agree()
    return {"taken": taken, "kept": {repr(k): v for k, v in calibrate.kept().items()}}


def test_agree_gives_every_rank_rank_0s_choices(tmp_path):
    assert choices.agree() == 0                               # no process group: nothing
    res = run_gloo(_agree_body, 2, tmp_path)
    assert [r["taken"] for r in res] == [1, 1]
    assert res[0]["kept"] == {repr(CAL_KEY): "gram"}
    assert res[1]["kept"][repr(CAL_KEY)] == "gram" and len(res[1]["kept"]) == 2
