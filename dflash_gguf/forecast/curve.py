"""Speed against accepted length: the curve a drafter configuration follows on one machine, and where it crosses the
target alone (its break-even length).

For given shapes, types, flags and hardware, a speculative configuration's speed is a function of one number, its
mean accepted length L (tokens per verification step, the target's own token included: 1 when nothing is accepted,
n-max + 1 when everything is). b11434's llama-server measures that function directly with ``--spec-synth-len L``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..tune.report import Measurement


def default_lengths(n_max: int) -> tuple[float, ...]:
    """1, 2, ... n-max + 1: nothing accepted to everything accepted, a step of one token."""
    return tuple(float(v) for v in range(1, n_max + 2))


def breadth_first(lengths: Sequence[float]) -> list[float]:
    """The lengths in the order a budget should measure them: the two ends, then halving the gaps."""
    ordered = sorted(set(lengths))
    if len(ordered) <= 2:
        return ordered
    out = [ordered[0], ordered[-1]]
    spans = [(0, len(ordered) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                out.append(ordered[mid])
                nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return out


def crossing(points: Sequence[tuple[float, float]], level: float = 1.0) -> float | None:
    """The smallest x where the piecewise-linear curve through ``points`` (x, y) reaches ``level``: linear between
    the last point below and the first at or above it; the first x when the curve starts there; None when it never
    does within the points."""
    pts = sorted(points)
    for i, (x, y) in enumerate(pts):
        if y >= level:
            if i == 0:
                return x
            x0, y0 = pts[i - 1]
            return x0 + (level - y0) * (x - x0) / (y - y0)
    return None


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The curve's y at ``x`` (linear between measured points), None outside them."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == x else None


@dataclass(frozen=True)
class Curve:
    """One drafter configuration (file, spec type, n-max) measured at synthetic accepted lengths."""

    drafter: str  # the drafter's file name
    spec_type: str
    n_max: int
    points: tuple[Measurement, ...]  # each measured with Configuration.synth_len

    def speedups(self, baseline_tps: float) -> list[tuple[float, float]]:
        """(accepted length, speed-up over the target alone) of each point measured."""
        return sorted((m.config.synth_len or 0.0, m.gen_tps / baseline_tps) for m in self.points
                      if m.status == "ok" and m.gen_tps)

    def break_even(self, baseline_tps: float) -> float | None:
        """The accepted length where this configuration draws level with the target alone (None: never within the
        lengths measured)."""
        return crossing(self.speedups(baseline_tps))

    def to_dict(self, baseline: Measurement) -> dict[str, Any]:
        base_tps = baseline.gen_tps or 0.0
        rows = []
        for m in sorted(self.points, key=lambda m: m.config.synth_len or 0.0):
            rss = m.peak_rss
            rows.append({"acceptance_length": m.config.synth_len, "status": m.status,
                         "generation_tokens_per_second": _r(m.gen_tps),
                         "speedup": _r(m.gen_tps / base_tps, 3) if m.gen_tps and base_tps else None,
                         "peak_rss": rss, "error": m.error})
        rss_values = [m.peak_rss for m in self.points if m.peak_rss]
        peak = max(rss_values) if rss_values else None
        return {"drafter": self.drafter, "spec_type": self.spec_type, "n_max": self.n_max,
                "break_even_acceptance_length": _r(self.break_even(base_tps), 3) if base_tps else None,
                "peak_rss": peak, "drafter_rss": peak - baseline.peak_rss if peak and baseline.peak_rss else None,
                "lengths": rows}


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)
