"""``tune``: measure every way llama-server can speculate for a target on this machine, and pick the fastest.

One server per configuration (:mod:`.engine`): the target alone first (the baseline every speed-up is relative to);
the target's own MTP head when its GGUF has one; model-free n-gram drafting; each drafter file; n-gram drafting before
the fastest drafter. Drafting methods go over an adaptive n-max sweep: a coarse pass over powers of two minus one,
then the neighbours of the best, then ``--spec-draft-p-min`` at the best n-max while the time budget lasts. Every
configuration's greedy tokens are compared with the target alone's: speculation must not change them. A configuration
that crashes or hangs is recorded and the sweep goes on. With the target's projector (``mmproj-``), every
configuration is served with ``--mmproj`` and the workload gains an image prompt, measured and checked apart from the
text prompts. Tests assert verdicts (acceptance near 1 against near 0, the report's shape), never absolute speed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..drafters import OWN_MTP_FAMILY, Drafter
from ..errors import DflashGgufError, TuneError
from ..llama_bin import FoundBinary
from ..verify import verify_files
from .engine import (
    METHOD_DRAFTERS,
    METHOD_NGRAM_DRAFTER,
    METHOD_OWN_MTP,
    METHODS,
    Budget,
    Engine,
    OnProgress,
    TargetInfo,
    TuneOptions,
    check_target,
    flag_value,
    inspect_drafter,
    served_projector,
    target_args,
    with_default_flags,
    with_projector,
)
from .report import NGRAM_FLAGS, Configuration, Measurement, TuneReport, compare_greedy
from .server import find_llama_server
from .workload import Workload

log = logging.getLogger(__name__)

# The n-max served when nothing was measured. Not block_size - 1: users' measured sweet spots are small (4 beat
# 15 for Gemma-4-12B + DFlash on an RTX 3060, 4 beat 7 for a DFlash2 27B on an RTX 3090, 6 was best and 4 within
# 12% of it for Qwen3-4B on an RTX 6000 Ada), and a longer draft costs verification time on every step.
DEFAULT_N_MAX = 4
COARSE_N_MAX = (1, 3, 7, 15)  # powers of two minus one: each step doubles the drafted block
P_MIN_SWEEP = (0.5, 0.75)  # llama.cpp's default is 0.0 (common.h); one report recovered acceptance at 0.75
_LONG_SWEEP = 600.0  # seconds: warn (with the way to bound it) when an unbounded sweep looks longer

COMBINED_NGRAM = "ngram-mod"
# The longest draft tried for the target's own head: an MTP assistant's, for the same reason (it runs once per
# drafted token on its own predicted hidden state, so acceptance falls with every step).
OWN_MTP_MAX_N_MAX: int = OWN_MTP_FAMILY.own_mtp_max_n_max or 1
PROBABILISTIC = "probabilistic"  # --spec-draft-sampling's other mode, measured when the requests sample


def _drafter_configuration(drafter: Drafter, n_max: int | None, p_min: float | None) -> Configuration:
    return Configuration(drafter, n_max, p_min)


def _method_plan(target: TargetInfo, drafters: Sequence[Drafter], opts: TuneOptions
                 ) -> tuple[list[_Sweep], list[Configuration], list[_Sweep]]:
    """The methods asked for that apply, as what is measured: the sweep of the target's own head, the n-gram
    configurations, and a sweep per drafter file."""
    def values(limit: int) -> list[int]:
        return [n for n in (opts.n_max_values or coarse_n_max(limit)) if n <= limit]

    own = [_Sweep("the target's own MTP head", lambda n, p: Configuration(n_max=n, p_min=p, own_mtp=True),
                  values(OWN_MTP_MAX_N_MAX), OWN_MTP_MAX_N_MAX, None)] \
        if METHOD_OWN_MTP in opts.methods and target.has_own_mtp else []
    ngrams = [Configuration(ngram=name) for name in NGRAM_FLAGS if name in opts.methods]
    files = [_Sweep(d.path.name, functools.partial(_drafter_configuration, d), values(d.max_n_max), d.max_n_max,
                    d.required_p_min) for d in drafters] if METHOD_DRAFTERS in opts.methods else []
    return own, ngrams, files


def first_configurations(target: TargetInfo, drafters: Sequence[Drafter], opts: TuneOptions) -> list[Configuration]:
    """Every configuration known before anything is measured, in the order measured: the target alone, its own
    MTP head, n-gram drafting, then each drafter file (refinement and the n-gram + drafter pair follow)."""
    own, ngrams, files = _method_plan(target, drafters, opts)
    return [Configuration(), *(c for sweep in own for c in sweep.coarse_configurations), *ngrams,
            *(c for sweep in files for c in sweep.coarse_configurations)]




def coarse_n_max(limit: int) -> list[int]:
    """The untuned default first (so a tight budget still measures it), then the coarse grid and the limit."""
    values = [min(DEFAULT_N_MAX, limit)] + [v for v in COARSE_N_MAX if v <= limit] + [limit]
    return list(dict.fromkeys(values))


def refine_n_max(speed: dict[int, float], limit: int) -> list[int]:
    """Unmeasured n-max values between the fastest one and its measured neighbours (midpoints and +-1)."""
    if not speed:
        return []
    measured = sorted(speed)
    best = max(measured, key=lambda n: speed[n])
    i = measured.index(best)
    lo = measured[i - 1] if i > 0 else None
    hi = measured[i + 1] if i + 1 < len(measured) else None
    cand = [best - 1, best + 1]
    if lo is not None:
        cand.append((lo + best) // 2)
    if hi is not None:
        cand.append((best + hi + 1) // 2)
    return [n for n in dict.fromkeys(cand) if 1 <= n <= limit and n not in speed]




@dataclass(frozen=True)
class TunePlan:
    """What ``tune`` would run, before anything is started (``--dry-run``): the server, the flags every
    configuration gets, and the configurations known up front (refinement depends on what is measured)."""

    target: TargetInfo
    drafters: tuple[Drafter, ...]
    server: FoundBinary
    flags: tuple[str, ...]
    workload: Workload
    first: tuple[Configuration, ...]
    later: str  # what may follow, in words
    methods: tuple[str, ...]  # the methods that apply and were not narrowed away
    projector: Path | None = None  # served with every configuration; the workload then has an image prompt
    target_args: tuple[str, ...] = ()  # what every configuration adds to -m TARGET (--mmproj PATH)

    def to_dict(self) -> dict[str, object]:
        return {"dry_run": True, "target": str(self.target.path), "target_arch": self.target.arch,
                "target_mtp_layers": self.target.nextn_layers, "methods": list(self.methods),
                "projector": str(self.projector) if self.projector else None,
                "server": str(self.server.path), "found_by": self.server.source, "flags": list(self.flags),
                "workload": self.workload.to_dict(), "configurations": [c.to_dict() for c in self.first],
                "then": self.later}


def applicable_methods(target: TargetInfo, drafters: Sequence[Drafter], opts: TuneOptions) -> tuple[str, ...]:
    """The methods that will be measured: asked for (``--methods``) and possible for these files."""
    possible = {METHOD_OWN_MTP: target.has_own_mtp, METHOD_DRAFTERS: bool(drafters),
                METHOD_NGRAM_DRAFTER: bool(drafters) and METHOD_DRAFTERS in opts.methods}
    return tuple(m for m in METHODS if m in opts.methods and possible.get(m, True))




def _prepare(target: Path, drafters: Sequence[Path], opts: TuneOptions) -> tuple[TargetInfo, list[Drafter],
                                                                                 tuple[str, ...]]:
    info = check_target(target)
    found = [inspect_drafter(d) for d in drafters]
    methods = applicable_methods(info, found, opts)
    if not methods:
        asked = ", ".join(sorted(opts.methods)) or "none"
        raise TuneError(f"Nothing to compare with the target alone: --methods {asked} names no method that applies "
                        f"to {Path(target).name} (its own MTP head: {info.own_mtp_in_words()}; drafter "
                        f"files: {len(found)}). Name one of {', '.join(METHODS)} that applies, or pass drafter files.")
    return info, found, methods


def plan_tune(target: Path, drafters: Sequence[Path], options: TuneOptions | None = None) -> TunePlan:
    """The configurations ``tune`` starts with, and the server and flags it would use; nothing is run.

    Raises:
        LlamaServerNotFound, TuneError, InputError: as :func:`tune`.
    """
    opts = with_projector(options or TuneOptions())
    info, found, methods = _prepare(target, drafters, opts)
    binary = find_llama_server(opts.llama_server)
    first = first_configurations(info, found, replace(opts, methods=frozenset(methods)))
    later_parts = []
    if not (opts.quick or opts.n_max_values):
        later_parts.append(f"per drafter (and the target's own head), up to 4 n-max values between the fastest and "
                           f"its neighbours, then --spec-draft-p-min {' and '.join(f'{p:g}' for p in P_MIN_SWEEP)} at "
                           "the best n-max")
    if METHOD_NGRAM_DRAFTER in methods:
        later_parts.append(f"{COMBINED_NGRAM} before the fastest drafter at its best n-max")
    if not opts.workload.sampling.greedy:
        later_parts.append(f"per drafter (and the target's own head), the fastest n-max with --spec-draft-sampling "
                           f"{PROBABILISTIC}")
    later_parts.append("the target alone again (when more than two configurations ran)")
    later = "; then ".join(later_parts)
    if opts.budget is not None:
        later += f"; no configuration starts once {opts.budget:g} s are spent"
    flags = tuple(with_default_flags(opts.user_flags, opts.parallel, opts.ctx))
    return TunePlan(info, tuple(found), binary, flags, opts.workload, tuple(first), later, methods,
                    served_projector(opts), tuple(target_args(opts)))


def tune(target: Path, drafters: Sequence[Path], options: TuneOptions | None = None,
         on_progress: OnProgress | None = None) -> TuneReport:
    """Measure the target alone, then every method that applies (its own MTP head, n-gram drafting, each drafter
    over the n-max sweep, n-gram drafting before the fastest drafter); returns the report with its verdict.

    Raises:
        LlamaServerNotFound: no llama-server.
        TuneError: an input is not a target/drafter, no method applies, or the target alone could not be served.
        InputError: a GGUF cannot be read.
    """
    opts = with_projector(options or TuneOptions())
    info, found, methods = _prepare(target, drafters, opts)
    opts = replace(opts, methods=frozenset(methods))
    binary = find_llama_server(opts.llama_server)
    budget = Budget(opts.budget)
    t = Engine(target, binary, opts, on_progress)
    own, ngrams, files = _method_plan(info, found, opts)
    sweeps = own + files
    n_first = 1 + len(ngrams) + sum(len(sweep.values) for sweep in sweeps)  # first_configurations, counted
    t.planned = n_first + (1 if METHOD_NGRAM_DRAFTER in methods else 0)
    base = t.measure(Configuration())
    budget.spent(base)
    if base.status != "ok":
        raise TuneError(f"Nothing could be measured: the target {target} alone could not be served "
                        f"({base.status}). {base.error} Check that llama-server loads it with these flags: "
                        f"{' '.join(t.flags)}.")
    notes: list[str] = []
    refined = 0 if opts.quick or opts.n_max_values else 4 + len(P_MIN_SWEEP)
    full = n_first + 1 + refined * len(sweeps)
    if opts.budget is None and base.seconds * full > _LONG_SWEEP:
        log.warning("the target alone took %.0f s to measure; the sweep is up to %d configurations, about %.0f min. "
                    "--budget SECONDS or --quick bounds it.", base.seconds, full, base.seconds * full / 60)
    # Breadth first, so that a budget still ranks every method: each method's first configuration (always run, in
    # the order --dry-run lists them), then the rest of each coarse sweep, then each refinement and p-min sweep.
    for sweep in own:
        sweep.first(t, budget, notes)
    for config in ngrams:
        budget.spent(t.measure(config))
    for sweep in files:
        sweep.first(t, budget, notes)
    for sweep in sweeps:
        sweep.coarse(t, budget)
    if not (opts.quick or opts.n_max_values):
        for sweep in sweeps:
            sweep.refine(t, budget)
    if not opts.workload.sampling.greedy:
        for sweep in sweeps:
            sweep.other_draft_sampling(t, budget)
    if METHOD_NGRAM_DRAFTER in methods:
        partial = TuneReport(Path(target), tuple(found), opts.workload, "", t.info, (), tuple(t.measurements), None,
                             0.0, serve_changed_output=opts.serve_changed_output)
        pure = [m for d in found if (m := partial.best_for(d)) is not None and partial.servable(m)
                and d not in partial.collapsed]
        if pure:
            top = max(pure, key=lambda m: m.gen_tps or 0.0).config
            _run_one(t, replace(top, ngram=COMBINED_NGRAM), budget)
        else:
            t.planned -= 1
            notes.append(f"{COMBINED_NGRAM} + drafter: not measured, no drafter was servable (measured, greedy text "
                         "unchanged, acceptance not collapsed).")
    if len(t.measurements) > 2:  # a long sweep: measure the baseline again, so drift shows and is averaged out
        if budget.allows_another():
            t.planned += 1
            t.measure(Configuration(again=True))
        else:
            budget.skipped.append("target alone, again (the baseline is from the start of the sweep only)")
    if budget.skipped:
        notes.append(f"not measured, the {budget.seconds:g} s budget was spent: {'; '.join(budget.skipped)}.")
    if opts.n_max_values and any(v > d.max_n_max for d in found for v in opts.n_max_values):
        notes.append("n-max values above a drafter's block_size - 1 were not measured: llama.cpp clamps them.")
    runs = [m for m in t.measurements if m.config.alone and m.status == "ok"]
    if len(runs) > 1 and (g := compare_greedy(runs[0].samples, runs[1].samples)).same is False:
        notes.append(f"the target alone generated different greedy text on its second run ({g.text}): this server "
                     "is not deterministic here, so the greedy check of the other configurations is not reliable.")
    assert t.rendered is not None
    report = TuneReport(Path(target), tuple(found), opts.workload, t.rendered.thinking, t.info,
                        tuple(opts.user_flags), tuple(t.measurements), opts.budget, budget.elapsed, tuple(notes),
                        opts.serve_changed_output, projector=served_projector(opts),
                        context=int(c) if (c := flag_value(t.flags, ("-c", "--ctx-size"))) and c.isdigit() else None,
                        memory_limit=opts.memory_limit)
    shown = [_lineage_of(d, Path(target)) for d in report.collapsed]
    return replace(report, lineage=tuple(x for x in shown if x[1]))




def _lineage_of(drafter: Drafter, target: Path) -> tuple[str, str]:
    """(file name, what verify's lineage checks say about this drafter and target; "" when they see nothing): the
    names often show why acceptance collapsed (a drafter trained for a QAT checkpoint, served with the original)."""
    try:
        checks = verify_files(drafter.path, target, allow_derived_target=False).results
    except DflashGgufError:
        return drafter.path.name, ""
    said = [f"{c.message}" for c in checks if c.id.startswith("lineage.") and c.status == "fail"]
    return drafter.path.name, " ".join(said)


def _run_one(t: Engine, config: Configuration, budget: Budget) -> Measurement | None:
    """Measure ``config`` if the budget allows another configuration; else record it as skipped."""
    if not budget.allows_another():
        budget.skipped.append(config.label)
        return None
    m = t.measure(config)
    budget.spent(m)
    return m


class _Sweep:
    """One drafting method over n-max: its first value always measured, the rest of the coarse pass while the
    budget lasts, then (unless --quick or --n-max) the neighbours of the fastest and the p-min sweep at it."""

    def __init__(self, name: str, make: Callable[[int, float | None], Configuration], values: list[int], limit: int,
                 fixed_p_min: float | None) -> None:
        self.name, self.make, self.values, self.limit, self.fixed_p_min = name, make, values, limit, fixed_p_min
        self.speed: dict[int, float] = {}
        self.stopped = not values

    @property
    def coarse_configurations(self) -> list[Configuration]:
        return [self.make(n, self.fixed_p_min) for n in self.values]

    def _record(self, m: Measurement | None, n: int) -> None:
        if m is not None and m.status == "ok" and m.gen_tps:
            self.speed[n] = m.gen_tps

    def first(self, t: Engine, budget: Budget, notes: list[str]) -> None:
        """The first n-max: always measured; a failure or a collapse there ends the sweep."""
        if self.stopped:
            return
        n = self.values[0]
        m = t.measure(self.make(n, self.fixed_p_min))
        budget.spent(m)
        self._record(m, n)
        rest = len(self.values) - 1
        if rest and m.status != "ok":
            notes.append(f"{self.name}: could not be served at n-max {n} ({m.status}); the rest of its sweep was "
                         "skipped.")
        elif rest and m.collapsed:
            notes.append(f"{self.name}: acceptance collapsed at n-max {n}; the rest of its sweep was skipped.")
        else:
            return
        t.planned -= rest
        self.stopped = True

    def coarse(self, t: Engine, budget: Budget) -> None:
        if self.stopped:
            return
        for n in self.values[1:]:
            self._record(_run_one(t, self.make(n, self.fixed_p_min), budget), n)

    def refine(self, t: Engine, budget: Budget) -> None:
        if self.stopped or not self.speed:
            return
        extra = refine_n_max(self.speed, self.limit)
        p_sweep = P_MIN_SWEEP if self.fixed_p_min is None else ()  # no confidence head: p-min must stay 0
        t.planned += len(extra) + len(p_sweep)
        for n in extra:
            self._record(_run_one(t, self.make(n, self.fixed_p_min), budget), n)
        best = max(self.speed, key=lambda n: self.speed[n])
        for p in p_sweep:
            _run_one(t, self.make(best, p), budget)

    def other_draft_sampling(self, t: Engine, budget: Budget) -> None:
        """When the requests sample: the fastest n-max again with the draft sampled and verified by rejection
        sampling (``--spec-draft-sampling probabilistic``); the sweep ran with b11434's default, greedy drafts."""
        if self.stopped or not self.speed:
            return
        best = max(self.speed, key=lambda n: self.speed[n])
        t.planned += 1
        _run_one(t, replace(self.make(best, self.fixed_p_min), draft_sampling=PROBABILISTIC), budget)


