"""Phases of learning in a layer-norm (or loss) curve: plateau, growth bursts, saturation (P3-T3).

For a two-layer linear net with balanced weights ‖W_j‖²_F = Σ_α u_α, a sum of Saxe sigmoids (saxe.py) whose
midpoints t_α ≈ ln(s_α/ε)/(2s_α) are spread out in log-time. The growth rate with respect to log-time,
dy/d ln t, therefore shows one peak per distinct nonzero singular value; each peak is a "burst". This is our
operational reading of P3's "distinct phases" (P3's own definition is not available).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.signal import find_peaks

__all__ = ["Burst", "Phases", "detect_phases"]


@dataclass
class Burst:
    """One burst of growth: peak time, start and end, and the rise of y across it (see detect_phases)."""

    t_peak: float
    t_start: float
    t_end: float
    rise: float


@dataclass
class Phases:
    """plateau: [t_0, plateau_end) where y grew < ``frac`` of its total growth; bursts in time order;
    saturation: [saturation_start, t_end] where y is within ``frac`` of its final value."""

    plateau_end: float
    saturation_start: float
    bursts: list = field(default_factory=list)
    total_growth: float = 0.0

    @property
    def n_bursts(self) -> int:
        return len(self.bursts)


def detect_phases(t, y, frac: float = 0.01, prominence: float = 0.01, grid: int = 2000,
                  edge: float = 0.05) -> Phases:
    """Find the phases of a growing curve y(t) (t > 0 except possibly t[0] = 0).

    Bursts are peaks of dy/d ln t (y resampled on ``grid`` log-spaced times) whose prominence exceeds
    ``prominence`` × (total growth of y); ``frac`` sets the plateau and saturation thresholds. A burst
    spans the times where its rate is >= ``edge`` × its peak rate; its rise is the growth of y between the
    slowest points separating it from its neighbours, so the rises add up to nearly all of the growth.
    """
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if t.ndim != 1 or t.shape != y.shape or t.size < 4:
        raise ValueError(f"t and y must be 1-D of the same length >= 4, got {t.shape} and {y.shape}")
    if np.any(np.diff(t) <= 0):
        raise ValueError("t must be strictly increasing")
    if not (0 < frac < 1) or prominence <= 0:
        raise ValueError(f"need 0 < frac < 1 and prominence > 0, got frac={frac!r}, "
                         f"prominence={prominence!r}")
    total = y[-1] - y[0]
    if not total > 0:
        raise ValueError(f"y does not grow (y[-1] - y[0] = {total!r}); nothing to segment")
    grown = (y - y[0]) / total
    plateau_end = t[np.argmax(grown >= frac)]
    above = np.flatnonzero(np.abs(1.0 - grown) > frac)
    saturation_start = t[above[-1] + 1] if above.size and above[-1] + 1 < t.size else t[-1]
    pos = t > 0
    lt = np.log(t[pos])
    g = np.linspace(lt[0], lt[-1], int(grid))
    yg = np.interp(g, lt, y[pos])
    rate = np.gradient(yg, g) / total
    peaks, props = find_peaks(rate, prominence=prominence)
    keep = rate[peaks] > 0                      # a local maximum of a shrinking stretch is no burst
    peaks = peaks[keep]
    props = {k: v[keep] for k, v in props.items()}
    bursts = []
    if peaks.size:
        # split the curve between consecutive peaks at the slowest growth in between
        cuts = [int(props["left_bases"][0])]
        cuts += [int(a + np.argmin(rate[a:b + 1])) for a, b in zip(peaks[:-1], peaks[1:])]
        cuts.append(int(props["right_bases"][-1]))
        for k, p in enumerate(peaks):
            a, b = cuts[k], cuts[k + 1]
            active = np.flatnonzero(rate[a:b + 1] >= edge * rate[p]) + a
            t_peak, t_start, t_end = np.exp(g[[p, active[0], active[-1]]])
            bursts.append(Burst(float(t_peak), float(t_start), float(t_end), float(yg[b] - yg[a])))
    return Phases(float(plateau_end), float(saturation_start), bursts, float(total))
