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


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def step_length(tokens_per_second: float, accepted_length: float, target_tps: float) -> float:
    """The accepted length at which a configuration whose steps cost what they cost at ``(accepted_length,
    tokens_per_second)`` would run at ``target_tps``.

    At a fixed n-max a step drafts the same block and verifies the same n-max + 1 positions whatever the target keeps,
    so a step's time is ``accepted_length / tokens_per_second`` and the speed at another length L is L over that time.
    ``forecast``'s synthetic curves measure how far a machine strays from this.
    """
    return target_tps * accepted_length / tokens_per_second


@dataclass(frozen=True)
class Placement:
    """Where one measured drafting configuration stands on its curve: the accepted length it reached, the length it
    breaks even with the target alone at, and the length it would need to beat the fastest of its sweep."""

    label: str
    n_max: int | None
    accepted_length: float  # measured: 1 + drafted tokens kept per verification step
    speedup: float
    break_even_length: float
    fastest_of_sweep: str | None  # None: this configuration is the fastest of its method
    length_to_win: float | None  # the length it would need to draw level with that fastest one

    @classmethod
    def of(cls, label: str, n_max: int | None, accepted_length: float, tokens_per_second: float, target_tps: float,
           fastest: tuple[str, float] | None) -> Placement:
        """``fastest``: (label, tokens/s) of the fastest configuration of the sweep, None when this one is it."""
        return cls(label, n_max, accepted_length, tokens_per_second / target_tps,
                   step_length(tokens_per_second, accepted_length, target_tps), fastest[0] if fastest else None,
                   step_length(tokens_per_second, accepted_length, fastest[1]) if fastest else None)

    @property
    def sentence(self) -> str:
        """"n-max 15 reached L 2.64; it breaks even at L 2.90 and would need L 4.10 to beat n-max 4"."""
        even = (f"it breaks even with the target alone at L {self.break_even_length:.2f}"
                + (" (reached)" if self.accepted_length >= self.break_even_length else ""))
        win = (f" and would need L {self.length_to_win:.2f} to draw level with {self.fastest_of_sweep}"
               if self.length_to_win is not None else "")
        return f"{self.label}: reached L {self.accepted_length:.2f} ({self.speedup:.2f}x); {even}{win}"

    def to_dict(self) -> dict[str, Any]:
        return {"configuration": self.label, "n_max": self.n_max, "acceptance_length": _r(self.accepted_length, 3),
                "speedup": _r(self.speedup, 3), "break_even_acceptance_length": _r(self.break_even_length, 3),
                "fastest_of_sweep": self.fastest_of_sweep, "acceptance_length_to_win": _r(self.length_to_win, 3)}
