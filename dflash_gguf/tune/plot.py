"""``tune.png``: tokens/s against n-max, one line per method and drafter file, for readers who would rather look.

The target alone is a horizontal band (its repeat range) with its median; n-gram drafting, which has no n-max,
is a dashed level; the served configuration is starred. Matplotlib is an optional extra
(``pip install 'dflash-gguf[plot]'``): without it :func:`write_plot` raises :class:`PlotUnavailable` and the
caller still prints the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import atomic_output
from ..errors import PlotUnavailable
from .report import Measurement, TuneReport

PLOT_NAME = "tune.png"
INSTALL_HINT = "pip install 'dflash-gguf[plot]'"


def _series(report: TuneReport) -> dict[str, list[Measurement]]:
    """Measured configurations with an n-max, by method and drafter file: llama.cpp's default p-min (the p-min
    sweep would draw a line per value), and n-gram drafting before a drafter at whatever p-min it was measured."""
    out: dict[str, list[Measurement]] = {}
    for m in report.drafting:
        combined = m.config.ngram is not None and m.config.drafter is not None  # one point, at the drafter's best
        if m.config.n_max is None or (m.config.p_min not in (None, 0.0) and not combined):
            continue
        name = m.config.method if m.config.drafter is None else \
            f"{m.config.method}: {m.config.drafter.path.name}"
        out.setdefault(name, []).append(m)
    return {k: sorted(v, key=lambda m: m.config.n_max or 0) for k, v in out.items()}


def _pyplot(picture: str) -> Any:
    """matplotlib's pyplot on its file backend.

    Raises:
        PlotUnavailable: matplotlib is not installed (naming ``picture``, which is then not drawn).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(f"{picture} was not drawn: matplotlib is not installed. {INSTALL_HINT} draws it; the "
                              "table above has the same numbers.") from None
    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path, *, legend: str | None) -> Path:
    """Every picture's finish: a light grid, the legend (``outside``: right of the axes, for long labels;
    ``inside``; None), written atomically as PNG and the figure closed; returns ``path``."""
    ax.grid(True, alpha=0.3)
    if legend == "outside":
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    elif legend == "inside":
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_output(Path(path)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)


def write_plot(report: TuneReport, path: Path) -> Path:
    """Draw the measurement into ``path`` (PNG, written atomically); returns it.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        OutputError: the folder is missing or not writable.
    """
    plt = _pyplot(PLOT_NAME)
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    base = report.baseline
    if base is not None and base.gen_tps:
        lo, hi = base.gen_tps_range or (base.gen_tps, base.gen_tps)
        ax.axhspan(lo, hi, color="0.85", label=f"target alone ({lo:.0f}-{hi:.0f} tokens/s)")
        ax.axhline(base.gen_tps, color="0.45", linewidth=1)
    served = report.best
    for name, ms in _series(report).items():
        ax.plot([m.config.n_max for m in ms], [m.gen_tps for m in ms], marker="o" if len(ms) > 1 else "D",
                label=name)
    levels = [m for m in report.drafting if m.config.n_max is None]
    for i, m in enumerate(levels):  # axhline does not advance the colour cycle: colours after the series'
        ax.axhline(m.gen_tps or 0.0, linestyle="--", linewidth=1.2, label=m.config.method, color=f"C{6 + i}")
    if served is not None and not served.config.alone and served.gen_tps:
        x = served.config.n_max if served.config.n_max is not None else 0
        ax.plot([x], [served.gen_tps], marker="*", markersize=16, color="black", linestyle="none",
                label=f"served: {served.config.label}")
    ax.set_xlabel("--spec-draft-n-max (n-gram drafting has none: dashed)")
    ax.set_ylabel("generation tokens/s (median of repeats)")
    wl = report.workload
    ax.set_title(f"{report.target.name}: {len(wl.prompts)} prompts x {wl.n_predict} tokens, {wl.repeats} repeat(s), "
                 f"threads {report.server.threads if report.server.threads is not None else 'default'}",
                 fontsize=9)
    return _save(plt, fig, ax, path, legend="outside")


TAGS_PLOT_NAME = "tags.png"


def write_tags_plot(points: Sequence[tuple[str, float, float]], path: Path, title: str) -> Path:
    """``tags.png``: each quant tag's fastest tokens/s with its drafter against its mean KL divergence from the 16-bit
    target (``points``: tag, mean KLD, tokens/s), the question a lower-bit tag raises; beside tune.png, which draws one
    tag's configurations. Written atomically; returns ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    plt = _pyplot(TAGS_PLOT_NAME)
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=110)
    for tag, kld, tps in points:
        ax.plot([kld], [tps], marker="o", linestyle="none", label=tag)
        ax.annotate(tag, (kld, tps), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("mean KL divergence from the 16-bit target (llama-perplexity)")
    ax.set_ylabel("generation tokens/s, fastest with its drafter")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, ax, path, legend=None)


QUALITY_PLOT_NAME = "quality.png"


def write_quality_plot(points: Sequence[tuple[str, int, float]], front: Sequence[str], path: Path,
                       title: str) -> Path:
    """``quality.png``: each tag's mean KL divergence from the 16-bit target against its size (``points``: tag,
    bytes, mean KLD), the tags on the Pareto front (``front``) joined and marked: the picture the best quant cards
    publish. Written atomically; returns ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    plt = _pyplot(QUALITY_PLOT_NAME)
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=110)
    on_front = [p for p in sorted(points, key=lambda p: p[1]) if p[0] in front]
    ax.plot([p[1] / 2**20 for p in on_front], [p[2] for p in on_front], color="0.6", linewidth=1, zorder=1,
            label="Pareto front (least drift for its size)")
    for tag, size, kld in points:
        ax.plot([size / 2**20], [kld], marker="*" if tag in front else "o", markersize=12 if tag in front else 7,
                linestyle="none", zorder=2)
        ax.annotate(tag, (size / 2**20, kld), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("mean KL divergence from the 16-bit target (llama-perplexity)")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, ax, path, legend="inside")


FORECAST_PLOT_NAME = "forecast.png"


def write_curve_plot(curves: Sequence[tuple[str, Sequence[tuple[float, float]]]], marks: Sequence[float], path: Path,
                     title: str) -> Path:
    """``forecast.png``: each configuration's speed-up over the target alone against the mean accepted length
    (``curves``: name, (length, speed-up) points), the break-even line at 1x, and the lengths given (``marks``: a
    card's, or what tune measured) as vertical lines. Written atomically; returns ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    plt = _pyplot(FORECAST_PLOT_NAME)
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax.axhline(1.0, color="0.3", linewidth=1.2, label="target alone (break-even)")
    for name, points in curves:
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    for i, length in enumerate(marks):
        ax.axvline(length, color="0.5", linestyle=":", linewidth=1.2,
                   label="accepted length given" if i == 0 else None)
    ax.set_xlabel("mean accepted length L (tokens per step, the target's own included; synthetic)")
    ax.set_ylabel("speed-up over the target alone")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, ax, path, legend="outside")
