"""DynamicsExplorer constructs and updates headless: changing a control retrains and redraws."""
import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from elasticlab.widgets import DynamicsExplorer  # noqa: E402


def _ys(fig):
    return [np.asarray(tr.y, dtype=float).copy() for tr in fig.data]


def test_explorer_builds_and_matches_saxe():
    ex = DynamicsExplorer(s=(3.0, 1.0), d=3, horizon=8, records=120, lr=1e-3)
    assert len(ex.norm_fig.data) == 2            # one growth curve per layer
    assert len(ex.mode_fig.data) == 4            # GD + Saxe per nonzero mode
    assert not ex.summary["diverged"]
    assert ex.summary["saxe_max_error"] < 0.01    # aligned linear start follows the closed form
    assert ex.summary["growth_spread"] < 0.01     # balanced layers grow equally


def test_changing_controls_updates_figures():
    ex = DynamicsExplorer(s=(3.0, 1.0), d=3, horizon=8, records=120)
    before = _ys(ex.norm_fig)
    ex.controls["depth"].value = 3
    after = _ys(ex.norm_fig)
    assert len(after) == 3 and ex.trajectory.net.depth == 3
    assert not np.allclose(before[0], after[0][: len(before[0])])
    modes_before = _ys(ex.mode_fig)
    ex.controls["lr"].value = 10 ** -1.5
    assert any(not np.array_equal(a, b) for a, b in zip(modes_before, _ys(ex.mode_fig)))


def test_biases_and_relu_break_weight_symmetry_in_the_view():
    ex = DynamicsExplorer(s=(3.0, 1.0), d=3, width=12, horizon=10, records=120, activation="relu",
                          start="random", init_scale=0.3, lr=5e-3)
    n_plain = len(ex.norm_fig.data)
    ex.controls["biases"].value = True
    assert len(ex.norm_fig.data) == n_plain + 1   # dotted weight+bias curve for the hidden layer
    assert ex.summary["invariant_drift"] < 1e-2   # the corrected invariant still holds (finite-step drift)


def test_divergence_is_reported_not_raised():
    ex = DynamicsExplorer(s=(3.0, 1.0), d=3, horizon=5, records=50, start="random")
    ex.controls["init_scale"].value = 1.0
    ex.controls["lr"].value = 10 ** -0.5
    assert ex.summary["diverged"]
    assert "diverged" in ex.status.value


@pytest.mark.parametrize("kwargs, msg", [
    ({"activation": "tanh"}, "activation"),
    ({"depth": 0}, r"depth must be a whole number in \[1, 6\], got 0"),       # was clamped to 1
    ({"width": 65}, r"width must be a whole number in \[1, 64\], got 65"),
    ({"lr": -1}, r"lr must be in \[0.0001, 0.316228\], got -1"),
    ({"lr": "x"}, "lr must be in .* got 'x'"),                                   # was a TraitError
    ({"horizon": 0}, r"horizon must be in \[1, 60\], got 0"),
])
def test_bad_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DynamicsExplorer(**kwargs)


def test_explorer_phase_rates():
    """theory/03 §3.3, §3.5: the explorer draws d ln‖W_j‖²/dt per layer with the phases, its plateau's end
    against the theory (aligned start: first burst within 10% of the midpoint (1.12) / N-layer half-time), and
    a per-phase table in which every layer of a linear net grows by the same amount, while the relative
    rates are ordered inversely to the layers' norms (the wide middle layer is slowest on the plateau)."""
    for depth in (2, 3):
        ex = DynamicsExplorer(depth=depth, init_scale=0.1, lr=5e-3, horizon=20, records=200)
        sm = ex.summary
        assert len(ex.rate_fig.data) == depth
        assert abs(sm["first_burst"] / sm["plateau_end_theory"] - 1) < 0.10
        assert set(sm["phases"]) == {"plateau", "burst", "saturation"}
        for ph in sm["phases"].values():
            assert np.ptp(ph["growth"]) < 1e-6 * max(1.0, abs(np.mean(ph["growth"])))
        assert "burst" in ex.phase_table.value
    ex = DynamicsExplorer(depth=3, width=16, start="random", init_scale=0.1, lr=5e-3, horizon=20, records=200)
    rates = ex.summary["phases"]["plateau"]["mean_log_rate"]
    assert rates[1] < 0.5 * min(rates[0], rates[2])        # W2 has 2x the entries of W1, W3 (16x16 vs 16x8)
    ex.controls["activation"].value = "relu"
    ex.controls["biases"].value = True
    g = ex.summary["phases"]["burst"]["growth"]
    assert np.ptp(g) > 0.1 * np.mean(g)                    # biases break the weight-only symmetry
