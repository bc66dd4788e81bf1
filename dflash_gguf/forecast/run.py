"""``dflash-gguf forecast``: each drafter configuration's speed-up on this machine at every accepted length, from the
repos' configs alone, before their weights are downloaded.

How: precheck on the configs and cards (a pair that cannot work is refused with its code before anything is built);
stand-in checkpoints (:mod:`.standin`: the small files as they are, the weights from their safetensors headers, values
random); the pipeline itself converts them, so the stand-in GGUFs are what it would write for the real repos but for
the tensor data; then tune's engine serves each configuration with ``--spec-synth-len L``. The stand-in GGUFs are
kept by their inputs (made cache), so a second forecast of the same repos and types only measures.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import __version__, made_cache
from ..cores import machine_cores
from ..errors import InputError, TuneError
from ..folder_lock import WORK_DIR
from ..ggufio.reader import read_gguf
from ..pipeline import MANIFEST_NAME, read_manifest
from ..pipeline.naming import model_name
from ..pipeline.options import PipelineOptions
from ..pipeline.run import run_pipeline
from ..pipeline.sources import Source, resolve_source
from ..pipeline.stages import precheck_projector, precheck_sources
from ..tune import (
    Configuration,
    Measurement,
    TargetInfo,
    TuneOptions,
    check_target,
    coarse_n_max,
    inspect_drafter,
    measure_configurations,
)
from ..tune.curve import breadth_first, default_lengths, interpolate
from ..tune.report import Drafter, ServerInfo
from ..tune.sweep import OWN_MTP_MAX_N_MAX
from ..tune.workload import Sampling
from .curve import Curve
from .standin import make_standin

log = logging.getLogger(__name__)

STANDINS_KIND = "standins"  # made_cache's folder for stand-in pairs
SYNTHETIC_NOTE = ("acceptance was synthetic (llama-server --spec-synth-len: real drafting and verification, drafts "
                  "accepted at random to the length given); the text generated is not the model's, so the greedy "
                  "check does not apply")


@dataclass(frozen=True)
class ForecastOptions:
    """What ``dflash-gguf forecast`` takes; names mirror its flags."""

    target: str
    drafters: tuple[str, ...]
    quant: str | None = None  # the target's type (the pipeline's default when None)
    draft_quant: str | None = None
    n_max_values: tuple[int, ...] = ()  # () : tune's coarse sweep for each drafter
    lengths: tuple[float, ...] = ()  # () : 1, 2, ... n-max + 1 per configuration
    acceptance: tuple[float, ...] = ()  # lengths to name the fastest configuration at
    tune_options: TuneOptions = field(default_factory=TuneOptions)
    threads: int = field(default_factory=machine_cores)
    mmproj: bool = True  # judge the target's projector as dflash-convert would (--no-mmproj: as with it)
    sampling_from_model: bool = False  # --sampling model: the stand-in target's general.sampling.* under those given


@dataclass(frozen=True)
class Standins:
    """The stand-in pair: the pipeline's output folder for stand-ins of the repos, and whether an earlier forecast
    made it."""

    folder: Path
    target: Path
    drafters: tuple[Path, ...]
    reused: bool


@dataclass(frozen=True)
class ForecastReport:
    """The target alone and each drafter configuration's curve, measured on this machine."""

    standins: Standins
    baseline: Measurement
    curves: tuple[Curve, ...]
    server: ServerInfo
    options: ForecastOptions
    notes: tuple[str, ...] = ()

    @property
    def baseline_tps(self) -> float:
        return self.baseline.gen_tps or 0.0

    def fastest_at(self, length: float) -> tuple[Curve | None, float | None]:
        """The configuration predicted fastest at an accepted length (interpolated on each curve whose lengths span
        it; a configuration whose n-max + 1 is below ``length`` cannot reach it), and its predicted speed-up; (None,
        1.0) when the target alone is."""
        best: tuple[Curve | None, float | None] = (None, 1.0)
        for curve in self.curves:
            value = interpolate(curve.speedups(self.baseline_tps), length)
            if value is not None and value > (best[1] or 0.0):
                best = (curve, value)
        return best

    def curve_points(self) -> list[tuple[str, list[tuple[float, float]]]]:
        """(name, [(accepted length, speed-up), ...]) per configuration measured: what ``forecast.png`` draws."""
        return [(f"{c.name} n-max {c.n_max}", c.speedups(self.baseline_tps)) for c in self.curves]

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        predicted = []
        for length in o.acceptance:
            curve, speedup = self.fastest_at(length)
            predicted.append({"acceptance_length": length, "fastest": "target alone" if curve is None else
                              {"method": curve.config.method, "drafter": curve.drafter, "spec_type": curve.spec_type,
                               "n_max": curve.n_max},
                              "speedup": round(speedup, 3) if speedup is not None else None})
        return {"synthetic": True, "note": SYNTHETIC_NOTE, "target": o.target, "drafters": list(o.drafters),
                "quant": o.quant, "draft_quant": o.draft_quant,
                "standins": {"folder": str(self.standins.folder), "target": self.standins.target.name,
                             "drafters": [d.name for d in self.standins.drafters], "reused": self.standins.reused},
                "generation_tokens_per_second": self.baseline.gen_tps, "peak_rss": self.baseline.peak_rss,
                "target_alone": self.baseline.to_dict(self.baseline_tps),
                "shape": {"sampling": o.tune_options.workload.sampling.text, "parallel": o.tune_options.parallel,
                          "context_per_client": o.tune_options.ctx,
                          "memory_limit_bytes": o.tune_options.memory_limit},
                "configurations": [c.to_dict(self.baseline) for c in self.curves], "predicted": predicted,
                "server": self.server.to_dict(), "workload": o.tune_options.workload.to_dict(),
                "user_flags": list(o.tune_options.user_flags), "budget": o.tune_options.budget,
                "notes": list(self.notes)}


def make_standins(opts: ForecastOptions, on_step: Callable[[str], None] | None = None) -> Standins:
    """The stand-in pair for the repos and types, made by the pipeline from stand-in checkpoints, or the one an
    earlier forecast made for the same inputs.

    Raises:
        IncompatiblePairError, ConfigError, UnsupportedModelError, NotCoveredError: precheck refused the pair (before
            anything is built), with its code.
        ResolveError: the Hub refused or could not be reached.
    """
    step = on_step or (lambda text: None)
    target = resolve_source(opts.target)
    drafters = [resolve_source(d) for d in opts.drafters]
    for drafter in drafters:
        precheck_sources(drafter, target)
    if opts.mmproj:  # not needed to measure, but the pair the user would make has it: the same verdict
        precheck_projector(target)
    key = {"target": target.identity(), "drafters": [d.identity() for d in drafters], "quant": opts.quant,
           "draft_quant": opts.draft_quant, "tool": f"dflash-gguf {__version__}"}
    folder = made_cache.folder_for(STANDINS_KIND, key)
    pair = folder / "pair"
    reused = made_cache.folder_complete(folder, key) and (pair / MANIFEST_NAME).is_file()
    if not reused:
        shutil.rmtree(folder, ignore_errors=True)
        checkpoints = folder / "checkpoints"
        step(f"stand-in of {target.label}")
        t_dir = make_standin(target.resolved, checkpoints / "target" / _name(target))
        d_dirs = []
        for i, d in enumerate(drafters):
            step(f"stand-in of {d.label}")
            d_dirs.append(make_standin(d.resolved, checkpoints / f"drafter-{i}" / _name(d)))
        step("converting the stand-ins")
        run_pipeline(PipelineOptions(str(t_dir), str(d_dirs[0]), opts.quant, pair, draft_quant=opts.draft_quant,
                                     more_drafters=tuple(map(str, d_dirs[1:])), mmproj=False, threads=opts.threads))
        shutil.rmtree(checkpoints)
        shutil.rmtree(pair / WORK_DIR, ignore_errors=True)  # the run's scratch (its links into the checkpoints)
        made_cache.mark_complete(folder, key)
    record = read_manifest(pair / MANIFEST_NAME)
    return Standins(pair, record.file("target"), tuple(record.drafter_files()), reused)


def acceptance_from_record(path: Path) -> tuple[float, ...]:
    """The mean accepted lengths an earlier ``tune`` measured, from the pair.json it recorded into (or its folder):
    per method and drafter file, the length at its fastest configuration.

    Raises:
        InputError: not a pair manifest, or it records no drafting ``tune`` measured.
    """
    manifest = Path(path) / MANIFEST_NAME if Path(path).is_dir() else Path(path)
    tuning = read_manifest(manifest).tuning or {}
    fastest: dict[tuple[Any, Any], tuple[float, float]] = {}
    for c in tuning.get("configurations") or ():
        per_step, tps = c.get("mean_accepted_per_step"), c.get("generation_tokens_per_second")
        if (c.get("status") != "ok" or not isinstance(per_step, int | float) or not isinstance(tps, int | float)
                or c.get("synthetic_acceptance_length") is not None or c.get("changed_output")):
            continue
        key = (c.get("method"), c.get("drafter"))
        if key not in fastest or tps > fastest[key][1]:
            fastest[key] = (round(1.0 + per_step, 2), tps)
    if not fastest:
        raise InputError(f"{manifest}: no drafting configuration measured by tune is recorded there (its 'tuning' "
                         "section). Run dflash-gguf tune on it first, or pass the lengths as numbers: --acceptance "
                         "2.6,3.4.")
    return tuple(sorted({length for length, _ in fastest.values()}))


def _name(source: Source) -> str:
    """The folder name the pipeline names its files after: the repo's basename, or the local folder's name."""
    return model_name(source.repo, source.path)


def configurations(target: TargetInfo, drafters: Sequence[Drafter], opts: ForecastOptions
                   ) -> list[tuple[Configuration, list[float]]]:
    """Each configuration (its ``synth_len`` unset) with the lengths to measure it at: the target's own MTP head when
    its GGUF has one b11434 can run, then each drafter, over the n-max values given (or tune's coarse sweep) at or under
    the method's limit, at the lengths given (or 1 ... n-max + 1) within [1, n-max + 1]."""
    def sweep(limit: int) -> list[int]:
        return list(dict.fromkeys(v for v in (opts.n_max_values or tuple(coarse_n_max(limit))) if v <= limit))

    def lengths(n: int) -> list[float]:
        return breadth_first([v for v in (opts.lengths or default_lengths(n)) if 1.0 <= v <= n + 1])

    out = [(Configuration(own_mtp=True, n_max=n), lengths(n)) for n in sweep(OWN_MTP_MAX_N_MAX)] \
        if target.has_own_mtp else []
    return out + [(Configuration(drafter=d, n_max=n), lengths(n)) for d in drafters for n in sweep(d.max_n_max)]


def forecast(opts: ForecastOptions, on_progress: Callable[[int, int, str], None] | None = None,
             on_step: Callable[[str], None] | None = None) -> ForecastReport:
    """Stand-ins made (or reused), then the target alone and every configuration at every length, breadth first
    (each configuration's ends before any interior point) within the budget.

    Raises:
        as :func:`make_standins`; LlamaServerNotFound: no llama-server; TuneError: the target alone could not be
        served.
    """
    standins = make_standins(opts, on_step)
    if opts.sampling_from_model:
        given = opts.tune_options.workload.sampling
        how = replace(Sampling.of_model(read_gguf(standins.target), **{
            k: v for k, v in given.to_dict().items() if k in ("top_k", "top_p", "min_p") and v is not None}
            | ({"temperature": given.temperature} if not given.greedy else {})), seed=given.seed)
        opts = replace(opts, tune_options=replace(opts.tune_options, workload=replace(
            opts.tune_options.workload, sampling=how)))
    plan = configurations(check_target(standins.target), [inspect_drafter(p) for p in standins.drafters], opts)
    order = [Configuration()]
    depth = max((len(lengths) for _, lengths in plan), default=0)
    for i in range(depth):  # breadth first: every configuration's i-th length before any (i+1)-th
        order += [replace(config, synth_len=lengths[i]) for config, lengths in plan if i < len(lengths)]
    measured, server = measure_configurations(standins.target, order, opts.tune_options, on_progress,
                                              budget=opts.tune_options.budget)
    baseline = measured[0]
    if baseline.status != "ok" or not baseline.gen_tps:
        raise TuneError(f"The stand-in target {standins.target} alone could not be served ({baseline.status}). "
                        f"{baseline.error or ''} Check that llama-server loads it with these flags: "
                        f"{' '.join(opts.tune_options.user_flags) or '(defaults)'}.")
    curves = tuple(Curve(config, tuple(m for m in measured[1:] if replace(m.config, synth_len=None) == config))
                   for config, _ in plan)
    notes = [SYNTHETIC_NOTE]
    if len(measured) < len(order):
        notes.append(f"the {opts.tune_options.budget:g} s budget was spent: {len(order) - len(measured)} of "
                     f"{len(order)} configurations were not measured (each curve's ends were measured first).")
    return ForecastReport(standins, baseline, tuple(c for c in curves if c.points), server, opts, tuple(notes))


__all__ = ["ForecastOptions", "ForecastReport", "Standins", "acceptance_from_record", "configurations", "forecast",
           "make_standins"]
