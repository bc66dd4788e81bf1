"""One drafting configuration's measured curve: its speed at each synthetic accepted length, and its break-even."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..tune.curve import crossing
from ..tune.report import Configuration, Measurement


@dataclass(frozen=True)
class Curve:
    """One drafting configuration (the target's own MTP head, or a drafter file, at one n-max) measured at synthetic
    accepted lengths."""

    config: Configuration  # its synth_len unset: what every point shares
    points: tuple[Measurement, ...]  # each measured with Configuration.synth_len

    @property
    def drafter(self) -> str | None:
        """The drafter's file name; None for the target's own head."""
        return self.config.drafter.path.name if self.config.drafter else None

    @property
    def spec_type(self) -> str:
        return ",".join(self.config.spec_types)

    @property
    def n_max(self) -> int:
        return self.config.n_max or 0

    @property
    def name(self) -> str:
        """The drafter file, or the method when the target drafts for itself."""
        return self.drafter or self.config.method

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
            rows.append({**m.to_dict(base_tps), "acceptance_length": m.config.synth_len, "status": m.status,
                         "generation_tokens_per_second": _r(m.gen_tps),
                         "speedup": _r(m.gen_tps / base_tps, 3) if m.gen_tps and base_tps else None,
                         "peak_rss": rss, "error": m.error})
        rss_values = [m.peak_rss for m in self.points if m.peak_rss]
        split = next((m.memory.to_dict() for m in reversed(self.points) if m.memory.buffers), {})
        peak = max(rss_values) if rss_values else None
        return {"method": self.config.method, "drafter": self.drafter, "spec_type": self.spec_type, "n_max": self.n_max,
                "break_even_acceptance_length": _r(self.break_even(base_tps), 3) if base_tps else None,
                "peak_rss": peak, "drafter_rss": peak - baseline.peak_rss if peak and baseline.peak_rss else None,
                "memory_mib": split,
                "lengths": rows}


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)
