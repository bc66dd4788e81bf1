"""The tuner's typed records: a configuration, its measurement, and the report with its verdict.

Everything a reader needs to trust a number travels with it: the workload (prompts, tokens, repeats),
the server build and hardware it printed, the threads, the user's flags, and the spread over repeats.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from statistics import median
from typing import Any, Literal

from ..drafters import OWN_MTP_FAMILY, Drafter
from .curve import Placement
from .memory import MemorySplit
from .workload import PromptKind, Workload

# Acceptance below this, over enough drafts, is a collapse: the field report's QAT target drafted 7844 tokens
# and kept 2 (0.00025). A matched pair on the worst prompt stays well above it.
COLLAPSE_ACCEPTANCE = 0.05
MIN_DRAFTS_TO_JUDGE = 32

# how one configuration ran ("skipped": not started, for the reason its error gives, e.g. over --memory-limit)
RunStatus = Literal["ok", "crashed", "timeout", "refused", "skipped"]


# The target's own multi-token-prediction head: llama-server b11434 builds a second context of type
# LLAMA_CONTEXT_TYPE_MTP over the target's weights when --spec-type draft-mtp is given without -md
# (common_speculative_init_result), and loads the nextn tensors only then (mparams.load_mtp).
# the spec type that runs an MTP head, an assistant's or the target's own
OWN_MTP_SPEC_TYPE = OWN_MTP_FAMILY.spec_type
OWN_MTP_METHOD = "draft-mtp (target's own head)"
# Model-free n-gram drafting (common/speculative.cpp). ngram-mod is served with --spec-default's settings
# (common/arg.cpp: n_match 24, n_min 48, n_max 64); ngram-simple with its own defaults.
NGRAM_FLAGS: dict[str, tuple[str, ...]] = {
    "ngram-mod": ("--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"),
    "ngram-simple": (),
}


@dataclass(frozen=True)
class Configuration:
    """One server launch: the target alone, its own MTP head, n-gram drafting, a drafter file, or n-gram
    drafting before a drafter (b11434 tries the types of a comma-separated --spec-type in order)."""

    drafter: Drafter | None = None
    n_max: int | None = None
    p_min: float | None = None  # None: llama.cpp's default (0.0)
    again: bool = False  # the target alone measured a second time, after the sweep (drift shows as a difference)
    own_mtp: bool = False  # the target's own nextn head (draft-mtp, no -md)
    ngram: str | None = None  # a key of NGRAM_FLAGS: alone, or tried before ``drafter``
    # --spec-synth-len: drafts accepted at random to this mean accepted length (the target's token included) instead
    # of by the target's choice (b11434 server_sample_and_accept_synth, "benchmarking only"): the speed a drafter
    # would have at that acceptance, the output not the model's
    synth_len: float | None = None
    # --spec-draft-sampling: "probabilistic" samples the draft and verifies it by rejection sampling; None is b11434's
    # default, greedy (the draft's argmax held to the target's sample)
    draft_sampling: str | None = None

    @property
    def alone(self) -> bool:
        """The target alone: no speculation at all (the baseline)."""
        return self.drafter is None and not self.own_mtp and self.ngram is None

    @property
    def method(self) -> str:
        """What drafts: 'target alone', 'draft-mtp (target's own head)', 'ngram-mod', 'draft-dflash',
        'ngram-mod + draft-dflash'."""
        if self.own_mtp:
            return OWN_MTP_METHOD
        drafter = (self.drafter.spec_type or "draft model") if self.drafter else None
        return " + ".join(m for m in (self.ngram, drafter) if m) or "target alone"

    @property
    def spec_types(self) -> tuple[str, ...]:
        """The --spec-type values, in the order llama-server tries them."""
        if self.own_mtp:
            return (OWN_MTP_SPEC_TYPE,)
        return tuple(t for t in (self.ngram, self.drafter.spec_type if self.drafter else None) if t)

    @property
    def _draft_length(self) -> str:
        """``n-max 4 p-min 0.5``, or "" for a method without one (n-gram drafting alone)."""
        p = f" p-min {self.p_min:g}" if self.p_min is not None else ""
        mode = f" {self.draft_sampling} draft" if self.draft_sampling is not None else ""
        return f"n-max {self.n_max}{p}{mode}" if self.n_max is not None else ""

    @property
    def label(self) -> str:
        if self.alone:
            return "target alone, again" if self.again else "target alone"
        if self.drafter is None:
            return f"{self.method} {self._draft_length}".strip()
        return f"{self.ngram + ' + ' if self.ngram else ''}{self.detail}"

    @property
    def detail(self) -> str:
        """The label without the method: what varies within one method (file, n-max, p-min)."""
        if self.alone:
            return "again" if self.again else "baseline"
        synth = f" at synthetic accepted length {self.synth_len:g}" if self.synth_len is not None else ""
        if self.drafter is not None:
            return f"{self.drafter.path.name} {self._draft_length}{synth}".strip()
        return (self._draft_length or "llama.cpp's settings") + synth

    def server_args(self, *, by_name: bool = False) -> list[str]:
        """The llama-server flags this configuration adds to the target and the user's flags (``by_name``: the
        drafter file by its name, as a record that may be published names it)."""
        if self.alone:
            return []
        args = ["--model-draft", self.drafter.path.name if by_name else str(self.drafter.path)] if self.drafter else []
        if self.spec_types:
            args += ["--spec-type", ",".join(self.spec_types)]
        if self.ngram:
            args += NGRAM_FLAGS[self.ngram]
        if self.n_max is not None:
            args += ["--spec-draft-n-max", str(self.n_max)]
        if self.p_min is not None:
            args += ["--spec-draft-p-min", f"{self.p_min:g}"]
        if self.draft_sampling is not None:
            args += ["--spec-draft-sampling", self.draft_sampling]
        if self.synth_len is not None:
            args += ["--spec-synth-len", f"{self.synth_len:g}"]
        return args

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "method": self.method, "drafter": self.drafter.path.name if self.drafter else None,
                "drafter_type": self.drafter.type_name if self.drafter else None,
                "spec_type": ",".join(self.spec_types) or None, "n_max": self.n_max,
                "p_min": self.p_min, "synthetic_acceptance_length": self.synth_len,
                "draft_sampling": self.draft_sampling or ("greedy" if self.drafter or self.own_mtp else None),
                "server_args": self.server_args(by_name=True)}


@dataclass(frozen=True)
class Sample:
    """One measured /completion: llama-server's own ``timings``."""

    prompt: str
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_accepted: int = 0
    tokens: tuple[int, ...] = ()  # the generated token ids (``return_tokens``), for the greedy check
    kind: PromptKind = "text"  # "image": the prompt carried an image (its tokens are in prompt_n)
    slot: int | None = None  # the server slot that ran it (``id_slot``)
    client: int = 0  # which of the clients sent it (several at once: --parallel)

    @classmethod
    def from_timings(cls, prompt: str, t: dict[str, Any], tokens: Sequence[int] = (),
                     kind: PromptKind = "text") -> Sample:
        return cls(prompt, int(t.get("prompt_n", 0)), float(t.get("prompt_ms", 0.0)), int(t.get("predicted_n", 0)),
                   float(t.get("predicted_ms", 0.0)), int(t.get("draft_n", 0) or 0),
                   int(t.get("draft_n_accepted", 0) or 0), tuple(int(x) for x in tokens), kind)

    @classmethod
    def from_answer(cls, prompt: str, answer: dict[str, Any], kind: PromptKind = "text") -> Sample:
        """One /completion answer: its ``timings`` and, when asked for, its ``tokens``."""
        tokens = answer.get("tokens")
        slot = answer.get("id_slot")
        return replace(cls.from_timings(prompt, answer.get("timings") or {}, tokens if isinstance(tokens, list) and all(
            isinstance(x, int) for x in tokens) else (), kind), slot=slot if isinstance(slot, int) else None)


@dataclass(frozen=True)
class GreedyCheck:
    """Whether a configuration generated, under greedy sampling, exactly the target alone's tokens.

    Speculation must not change greedy text: a difference means a broken drafter file or runtime. ``same`` is
    None when nothing could be compared (no tokens returned)."""

    same: bool | None
    prompt: str | None = None
    position: int | None = None  # index of the first differing generated token
    expected: int | None = None  # the target alone's token there (None: its text ended first)
    got: int | None = None  # this configuration's token there (None: its text ended first)

    @property
    def text(self) -> str:
        if self.same is None:
            return "not compared"
        if self.same:
            return "same"
        return f"differs at token {self.position} of {self.prompt!r}"

    def to_dict(self) -> dict[str, Any]:
        return {"same": self.same, "prompt": self.prompt, "position": self.position, "expected": self.expected,
                "got": self.got}


def compare_greedy(reference: Sequence[Sample], candidate: Sequence[Sample]) -> GreedyCheck:
    """Every sample of ``candidate`` against the first sample of the same prompt in ``reference``."""
    expected: dict[str, tuple[int, ...]] = {}
    for s in reference:
        if s.tokens:
            expected.setdefault(s.prompt, s.tokens)
    compared = False
    for s in candidate:
        want = expected.get(s.prompt)
        if want is None or not s.tokens:
            continue
        compared = True
        for i, (a, b) in enumerate(zip(want, s.tokens, strict=False)):
            if a != b:
                return GreedyCheck(False, s.prompt, i, a, b)
        if len(want) != len(s.tokens):
            i = min(len(want), len(s.tokens))
            return GreedyCheck(False, s.prompt, i, want[i] if i < len(want) else None,
                               s.tokens[i] if i < len(s.tokens) else None)
    return GreedyCheck(True if compared else None)


@dataclass(frozen=True)
class DeviceMemory:
    """What llama-server allocated on one device (a GPU or other accelerator), over every context it made."""

    name: str  # the ggml buffer's device name, e.g. "CUDA0"
    mib: float  # model + KV/recurrent state + compute + output buffers


# llama.cpp logs every buffer it allocates at load, for the target's context and the drafter's alike
# (llama_model::load_tensors, llama_kv_cache, llama_memory_recurrent, llama_context: "<name> model buffer size =
# 897.00 MiB"). Host buffers are named CPU, CPU_Mapped, CPU_REPACK or <backend>_Host; the rest live on a device.
_BUFFER_LINE = re.compile(r"^.*?\b\w+:\s+(\S+)\s+(?:[\w ]+ )?buffer size =\s+([\d.]+) MiB", re.M)


def device_memory_from_log(log: str) -> tuple[DeviceMemory, ...]:
    """Device buffers llama-server logged, summed per device; empty when everything stayed on the host."""
    per: dict[str, float] = {}
    for m in _BUFFER_LINE.finditer(log):
        name = m.group(1)
        if name.startswith("CPU") or "Host" in name:
            continue
        per[name] = per.get(name, 0.0) + float(m.group(2))
    return tuple(DeviceMemory(name, mib) for name, mib in per.items())


@dataclass(frozen=True)
class Measurement:
    """What one configuration measured (or why it could not)."""

    config: Configuration
    status: RunStatus
    samples: tuple[Sample, ...] = ()
    repeats: int = 0
    draft_steps: int | None = None  # llamacpp:spec_decode_num_drafts_total over the measured requests
    peak_rss: int | None = None
    seconds: float = 0.0
    error: str | None = None
    device_memory: tuple[DeviceMemory, ...] = ()  # offloaded: what each device held (host RSS misses it)
    memory: MemorySplit = field(default_factory=MemorySplit)  # every buffer, the target's and the drafter's apart
    parallel: int = 1  # clients at once (-np): gen_tps is then their aggregate throughput
    round_seconds: tuple[float, ...] = ()  # wall time of each repeat's requests, every client's

    @property
    def kinds(self) -> tuple[PromptKind, ...]:
        """The prompt kinds measured, text first ("text", then "image" when the projector was served)."""
        present = {s.kind for s in self.samples}
        return tuple(k for k in ("text", "image") if k in present) + tuple(sorted(present - {"text", "image"}))

    def of_kind(self, kind: PromptKind) -> Measurement:
        """This measurement over the prompts of one kind only (their repeats kept; no step count, which
        /metrics gives for the whole run)."""
        return replace(self, samples=tuple(s for s in self.samples if s.kind == kind), draft_steps=None)

    def kind_dict(self) -> dict[str, dict[str, Any]]:
        """Per prompt kind: requests, tokens/s, prompt tokens and acceptance (drafters see text tokens only, so an
        image prompt's acceptance can differ)."""
        out = {}
        for kind in self.kinds:
            m = self.of_kind(kind)
            out[kind] = {"requests": len(m.samples), "generation_tokens_per_second": _r(m.gen_tps),
                         "prompt_tokens_per_second": _r(m.prompt_tps),
                         "prompt_tokens": round(sum(x.prompt_n for x in m.samples) / len(m.samples), 1),
                         "acceptance": _r(m.acceptance, 4), "draft_tokens": m.drafted,
                         "draft_tokens_accepted": m.accepted}
        return out

    @property
    def offloaded_bytes(self) -> int | None:
        """Bytes allocated on devices, when any were; None on a host-only run."""
        total = round(sum(d.mib for d in self.device_memory) * 1024 * 1024)
        return total or None

    @property
    def memory_text(self) -> str:
        """Device memory when the model was offloaded (host RSS would miss it), else the host's peak RSS."""
        if self.offloaded_bytes:
            return " + ".join(f"{d.mib:.0f} MiB {d.name}" for d in self.device_memory if d.mib)
        return f"{self.peak_rss / 1e6:.0f} MB RSS" if self.peak_rss else "-"

    def _per_repeat(self, n_attr: str, ms_attr: str) -> list[float]:
        """Tokens per second of each repeat over the whole prompt set (sum of tokens / sum of time)."""
        if not self.samples or self.repeats < 1:
            return []
        per = len(self.samples) // self.repeats
        out = []
        for r in range(self.repeats):
            chunk = self.samples[r * per:(r + 1) * per]
            ms = sum(getattr(s, ms_attr) for s in chunk)
            if ms > 0:
                out.append(sum(getattr(s, n_attr) for s in chunk) * 1000.0 / ms)
        return out

    def _throughput(self) -> list[float]:
        """Generated tokens per second of each repeat: one client's by the server's timings; several clients' as
        their aggregate, every token of the round over its wall time."""
        if self.parallel == 1 or len(self.round_seconds) != self.repeats or not self.samples:
            return self._per_repeat("predicted_n", "predicted_ms")
        per = len(self.samples) // self.repeats
        return [sum(s.predicted_n for s in self.samples[r * per:(r + 1) * per]) / seconds
                for r, seconds in enumerate(self.round_seconds) if seconds > 0]

    @property
    def gen_tps(self) -> float | None:
        """Median generated tokens/s over repeats: what a configuration is ranked by (aggregate when several
        clients were measured at once)."""
        v = self._throughput()
        return median(v) if v else None

    @property
    def gen_tps_range(self) -> tuple[float, float] | None:
        v = self._throughput()
        return (min(v), max(v)) if v else None

    @property
    def client_tps(self) -> float | None:
        """Median over repeats of a client's own generation speed (the server's timings of its requests)."""
        v = self._per_repeat("predicted_n", "predicted_ms")
        return median(v) if v else None

    def slots(self) -> list[dict[str, Any]]:
        """Per server slot: its requests, their generation speed (the server's timings) and acceptance."""
        out = []
        for slot in sorted({s.slot for s in self.samples if s.slot is not None}):
            mine = [s for s in self.samples if s.slot == slot]
            drafted, kept = sum(s.draft_n for s in mine), sum(s.draft_accepted for s in mine)
            ms = sum(s.predicted_ms for s in mine)
            out.append({"slot": slot, "requests": len(mine), "generation_tokens_per_second":
                        _r(sum(s.predicted_n for s in mine) * 1000.0 / ms) if ms else None,
                        "acceptance": _r(kept / drafted, 4) if drafted else None, "draft_tokens": drafted,
                        "draft_tokens_accepted": kept})
        return out

    @property
    def acceptance_per_slot(self) -> dict[int, float | None]:
        """Each server slot's share of drafted tokens kept (slots named by ``id_slot``)."""
        return {x["slot"]: x["acceptance"] for x in self.slots()}

    @property
    def prompt_tps(self) -> float | None:
        v = self._per_repeat("prompt_n", "prompt_ms")
        return median(v) if v else None

    @property
    def drafted(self) -> int:
        return sum(s.draft_n for s in self.samples)

    @property
    def accepted(self) -> int:
        return sum(s.draft_accepted for s in self.samples)

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted over every measured request, a fraction in [0, 1]; None without drafts."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Drafted tokens the target kept per verification step (0 .. n-max)."""
        return self.accepted / self.draft_steps if self.draft_steps else None

    @property
    def request_seconds(self) -> float:
        """Time llama-server spent on the measured requests (prompt + generation), by its own timings."""
        return sum(s.prompt_ms + s.predicted_ms for s in self.samples) / 1000.0

    @property
    def collapsed(self) -> bool:
        a = self.acceptance
        return a is not None and self.drafted >= MIN_DRAFTS_TO_JUDGE and a < COLLAPSE_ACCEPTANCE

    def to_dict(self, baseline_tps: float | None = None) -> dict[str, Any]:
        rng = self.gen_tps_range
        gen = self.gen_tps
        return {**self.config.to_dict(), "status": self.status, "error": self.error,
                "generation_tokens_per_second": _r(gen), "generation_tokens_per_second_range": [_r(x) for x in rng]
                if rng else None, "speedup": _r(gen / baseline_tps, 3) if gen and baseline_tps else None,
                "prompt_tokens_per_second": _r(self.prompt_tps), "acceptance": _r(self.acceptance, 4),
                "draft_tokens": self.drafted, "draft_tokens_accepted": self.accepted, "draft_steps": self.draft_steps,
                "mean_accepted_per_step": _r(self.mean_accepted_per_step, 3), "peak_rss_bytes": self.peak_rss,
                "device_memory_mib": {d.name: round(d.mib, 2) for d in self.device_memory},
                "memory_mib": self.memory.to_dict(),
                "requests": len(self.samples), "request_seconds": _r(self.request_seconds, 2),
                "parallel": self.parallel, "aggregate_generation_tokens_per_second": _r(gen),
                "per_client_generation_tokens_per_second": _r(self.client_tps),
                "slots": self.slots() if self.parallel > 1 else None,
                "memory_bytes": round(self.memory.mib() * 2**20) if self.memory.buffers else None,
                "drafter_memory_bytes": round(self.memory.mib(["drafter"]) * 2**20) if self.memory.buffers else None,
                "skipped": self.error if self.status == "skipped" else None,
                "seconds": _r(self.seconds, 1), "by_prompt_kind": self.kind_dict()}


def _r(x: float | None, nd: int = 2) -> float | None:
    return round(x, nd) if x is not None else None


def _pct(x: float | None) -> str:
    return f"{x * 100:.1f}%" if x is not None else "no drafts"


def _tps(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


@dataclass(frozen=True)
class ServerInfo:
    """The llama-server that measured: where it was found, and what it printed about itself."""

    path: Path
    source: str
    build: str | None = None
    system_info: str | None = None
    devices: tuple[str, ...] = ()
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"binary": self.path.name, "found_by": self.source, "build": self.build, "threads": self.threads,
                "system_info": self.system_info, "devices": list(self.devices)}


@dataclass(frozen=True)
class TuneReport:
    """Every configuration measured, in order, and the verdict that follows from them."""

    target: Path
    drafters: tuple[Drafter, ...]
    workload: Workload
    thinking: str
    server: ServerInfo
    user_flags: tuple[str, ...]
    measurements: tuple[Measurement, ...]
    budget: float | None
    seconds: float
    notes: tuple[str, ...] = field(default=())
    serve_changed_output: bool = False  # a configuration whose greedy text differs may still win (the user asked)
    # (drafter file name, what its and the target's names say) for a collapsed drafter whose files show why
    lineage: tuple[tuple[str, str], ...] = ()
    projector: Path | None = None  # served with every configuration (--mmproj): the workload has an image prompt
    context: int | None = None  # the server's -c, which b11434 divides among the -np slots
    memory_limit: int | None = None  # --memory-limit, bytes

    @property
    def shape(self) -> dict[str, Any]:
        """How it was served and asked: the sampling, the clients at once, the context and the memory limit. The
        winner is the winner for this shape."""
        return {"sampling": self.workload.sampling.text, "parallel": self.parallel, "context": self.context,
                "context_per_client": self.context // self.parallel if self.context else None,
                "memory_limit_bytes": self.memory_limit}

    @property
    def shape_text(self) -> str:
        """"greedy (temperature 0, top_k 1); 1 client; context 4096 per client"."""
        d = self.shape
        limit = f"; memory limit {d['memory_limit_bytes'] / 2**30:.1f} GiB" if d["memory_limit_bytes"] else ""
        context = f"; context {d['context_per_client']} per client" if d["context_per_client"] else ""
        return f"{d['sampling']}; {d['parallel']} client(s) at once{context}{limit}"

    @cached_property
    def baseline(self) -> Measurement | None:
        """The target alone: its measurements before and after the sweep, pooled (every repeat counts)."""
        runs = [m for m in self.measurements if m.config.alone and m.status == "ok"]
        if len(runs) <= 1:
            return runs[0] if runs else None
        return Measurement(Configuration(), "ok", tuple(s for m in runs for s in m.samples),
                           sum(m.repeats for m in runs), None, max(m.peak_rss or 0 for m in runs) or None,
                           sum(m.seconds for m in runs), device_memory=runs[0].device_memory)

    @cached_property
    def _greedy(self) -> dict[int, GreedyCheck]:
        """Each measurement's check (by id), compared once: every verdict and table asks for them."""
        first = next((b for b in self.measurements if b.config.alone and b.status == "ok"), None)
        return {id(m): GreedyCheck(None) if first is None or m.status != "ok" or m is first
                else compare_greedy(first.samples, m.samples) for m in self.measurements}

    def greedy(self, m: Measurement) -> GreedyCheck:
        """``m``'s generated tokens against the first measurement of the target alone."""
        return self._greedy.get(id(m), GreedyCheck(None))

    def greedy_of_kind(self, m: Measurement, kind: PromptKind) -> GreedyCheck:
        """``greedy``, over the prompts of one kind only (the text prompts, or the image prompt)."""
        first = next((b for b in self.measurements if b.config.alone and b.status == "ok"), None)
        if first is None or m.status != "ok" or m is first:
            return GreedyCheck(None)
        return compare_greedy(first.of_kind(kind).samples, m.of_kind(kind).samples)

    @property
    def has_images(self) -> bool:
        """An image prompt was measured (the projector was served)."""
        return any(s.kind == "image" for m in self.measurements for s in m.samples)

    @property
    def image_note(self) -> str:
        """How the image prompt fared against the text prompts for the fastest drafting configuration ("" without
        images): drafters see the text tokens only, so their acceptance there can differ."""
        m = self.best_drafting
        if not self.has_images or m is None:
            return ""
        text, image = m.of_kind("text"), m.of_kind("image")
        greedy = self.greedy_of_kind(m, "image").text
        return (f"Image prompt (projector {self.projector.name if self.projector else 'served'}): {m.config.label} "
                f"accepted {_pct(image.acceptance)} of its drafts there against {_pct(text.acceptance)} on the text "
                f"prompts, at {_tps(image.gen_tps)} against {_tps(text.gen_tps)} tokens/s; greedy text {greedy}. "
                "A drafter sees the prompt's text tokens only, not the image's embeddings.")

    @property
    def parallel(self) -> int:
        """Clients measured at once (-np)."""
        return self.measurements[0].parallel if self.measurements else 1

    @property
    def exact_text_check(self) -> bool:
        """Speculation must give the target alone's exact tokens: greedy, one client. When sampling, a drafter
        changes which random draws are made (rejection sampling keeps the distribution, not the draws); with several
        clients, which requests share a batch changes the floating-point sums. Then a difference is reported, not
        ruled out."""
        return self.workload.sampling.greedy and self.parallel == 1

    def servable(self, m: Measurement) -> bool:
        """Measured, and (unless the user allows it, or the check is not exact) generating the target alone's
        greedy text."""
        return m.status == "ok" and bool(m.gen_tps) and (self.serve_changed_output or not self.exact_text_check
                                                            or self.greedy(m).same is not False)

    @property
    def drafting(self) -> tuple[Measurement, ...]:
        """Every measured configuration that speculates (any method)."""
        return tuple(m for m in self.measurements if m.status == "ok" and m.gen_tps and not m.config.alone)

    @property
    def changed_output(self) -> tuple[Measurement, ...]:
        """Configurations whose greedy text is not the target alone's (none unless the check is exact: see
        ``text_apart``)."""
        return tuple(m for m in self.drafting if self.exact_text_check and self.greedy(m).same is False)

    @property
    def text_apart(self) -> tuple[Measurement, ...]:
        """When the check is not exact (sampling, several clients): configurations whose text is not the target
        alone's under the same seeds and prompts."""
        return () if self.exact_text_check else tuple(m for m in self.drafting if self.greedy(m).same is False)

    @property
    def best(self) -> Measurement | None:
        """The fastest servable configuration measured (the pooled baseline included)."""
        ok = [m for m in self.drafting if self.servable(m)]
        if self.baseline is not None:
            ok.append(self.baseline)
        return max(ok, key=lambda m: m.gen_tps or 0.0) if ok else None

    @property
    def best_drafting(self) -> Measurement | None:
        """The fastest servable configuration that speculates."""
        ok = [m for m in self.drafting if self.servable(m)]
        return max(ok, key=lambda m: m.gen_tps or 0.0) if ok else None

    def best_for(self, drafter: Drafter, *, servable: bool = True) -> Measurement | None:
        """The drafter's fastest configuration on its own (not behind n-gram drafting); with ``servable``, among
        those that keep the greedy text (unless the user allows otherwise)."""
        ok = [m for m in self.drafting if m.config.drafter == drafter and m.config.ngram is None
              and (self.servable(m) or not servable)]
        return max(ok, key=lambda m: m.gen_tps or 0.0) if ok else None

    @property
    def collapsed(self) -> tuple[Drafter, ...]:
        """Drafters whose every measured configuration drafted almost nothing the target kept."""
        out = []
        for d in self.drafters:
            ms = [m for m in self.measurements if m.config.drafter == d and m.config.ngram is None
                  and m.status == "ok" and m.drafted]
            if ms and all(m.collapsed for m in ms):
                out.append(d)
        return tuple(out)

    @property
    def own_mtp_collapsed(self) -> bool:
        """The target's own MTP head was measured and every configuration of it collapsed."""
        ms = [m for m in self.measurements if m.config.own_mtp and m.status == "ok" and m.drafted]
        return bool(ms) and all(m.collapsed for m in ms)

    @property
    def collapse_found(self) -> bool:
        """A drafter file, or the target's own MTP head, drafted almost nothing the target kept (exit code 15)."""
        return bool(self.collapsed) or self.own_mtp_collapsed

    @property
    def ranking(self) -> tuple[Measurement, ...]:
        """The target alone and each method's (each drafter file's) fastest configuration, fastest first."""
        best: dict[tuple[str, str | None], Measurement] = {}
        for m in self.drafting:
            key = (m.config.method, m.config.drafter.path.name if m.config.drafter else None)
            if key not in best or (m.gen_tps or 0.0) > (best[key].gen_tps or 0.0):
                best[key] = m
        entries = list(best.values())
        if self.baseline is not None:
            entries.append(self.baseline)
        return tuple(sorted(entries, key=lambda m: m.gen_tps or 0.0, reverse=True))

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Each measured drafting configuration (own head or a drafter file, not behind n-gram drafting) placed on its
        curve: the accepted length it reached, its break-even length, and the length it would need to beat the
        fastest configuration of its sweep (same method and file)."""
        base = self.baseline.gen_tps if self.baseline else None
        if not base or self.parallel > 1:  # the step-time model is one client's
            return ()
        sweeps: dict[tuple[str, str | None], list[Measurement]] = {}
        for m in self.drafting:
            if m.config.ngram is None and m.config.synth_len is None and self.servable(m):
                key = (m.config.method, m.config.drafter.path.name if m.config.drafter else None)
                sweeps.setdefault(key, []).append(m)
        out = []
        for ms in sweeps.values():
            top = max(ms, key=lambda m: m.gen_tps or 0.0)
            out += [Placement.of(m.config.label, m.config.n_max, 1.0 + per_step, m.gen_tps, base,
                                 None if m is top else (top.config.label, top.gen_tps or 0.0))
                    for m in ms if (per_step := m.mean_accepted_per_step) is not None and m.gen_tps]
        return tuple(out)

    def speedup(self, m: Measurement) -> float | None:
        b = self.baseline
        return m.gen_tps / b.gen_tps if b and b.gen_tps and m.gen_tps else None

    @property
    def verdict(self) -> str:
        """One paragraph: what won, by how much, and what to look at when drafting does not pay."""
        best, base = self.best, self.baseline
        if best is None or base is None:
            return "Nothing was measured."
        lines = []
        for d in self.collapsed:
            m = self.best_for(d, servable=False)
            assert m is not None
            lines.append(
                f"Acceptance collapsed for {d.path.name}: {m.accepted} of {m.drafted} drafted tokens accepted "
                f"({(m.acceptance or 0) * 100:.2f}%). The drafter and the target do not belong together: it was "
                "most likely trained on another model (a QAT, re-trained, merged or renamed variant of its target), "
                "or its drafts are spoiled by a quantized drafter KV cache or too low a drafter precision. "
                "Serve it with the exact model it was trained on." + "".join(
                    f" The files show a lineage mismatch: {why}" for name, why in self.lineage
                    if name == d.path.name))
        if self.own_mtp_collapsed:
            lines.append("Acceptance collapsed for the target's own MTP head: its nextn layer does not predict this "
                         "target (a head left from another version of the weights, or damaged by quantization).")
        for m in self.changed_output:
            g = self.greedy(m)
            lines.append(f"{m.config.label} changed the greedy text (token {g.position} of {g.prompt!r}: "
                         f"{g.got} where the target alone gives {g.expected}); speculation must not do that, so the "
                         "drafter file or the runtime is broken" + (" (served anyway, as asked)." if
                                                                    self.serve_changed_output else
                                                                    " and it is not served."))
        if apart := self.text_apart:
            why = [f"sampled ({self.workload.sampling.text}): a drafter changes which random draws are made"
                   if not self.workload.sampling.greedy else "",
                   f"{self.parallel} clients at once: which requests share a batch changes the floating-point sums"
                   if self.parallel > 1 else ""]
            lines.append(f"Under the same seeds and prompts {len(apart)} configuration(s) generated other text than "
                         f"the target alone ({'; '.join(m.config.label for m in apart)}). "
                         f"{'; '.join(w for w in why if w).capitalize()}, so this is reported, not ruled out; one "
                         "greedy client is the exact check.")
        if not best.config.alone:
            s = self.speedup(best) or 0.0
            method = f" ({best.config.method})" if best.config.method != best.config.label else ""
            lines.append(f"Fastest here: {best.config.label}{method}, {best.gen_tps:.1f} tokens/s, "
                         f"{s:.2f}x the target alone ({base.gen_tps:.1f} tokens/s), acceptance "
                         f"{(best.acceptance or 0) * 100:.1f}%." + self._spread_note(best, base))
            return " ".join(lines)
        drafting = self.best_drafting
        if drafting is None or drafting.config.drafter in self.collapsed and drafting.config.ngram is None:
            reason = "no drafting configuration could be measured" if drafting is None else "no drafter worked"
            lines.append(f"The target alone is fastest here ({base.gen_tps:.1f} tokens/s): {reason}.")
            return " ".join(lines)
        causes = self._likely_causes(drafting)
        lines.append(f"The target alone is fastest here ({base.gen_tps:.1f} tokens/s). The best drafting "
                     f"configuration, {drafting.config.label}, reached {drafting.gen_tps:.1f} tokens/s "
                     f"({self.speedup(drafting) or 0:.2f}x) at acceptance {(drafting.acceptance or 0) * 100:.1f}%."
                     + self._spread_note(base, drafting) + f" Likely causes: {causes}")
        return " ".join(lines)

    @staticmethod
    def _spread_note(winner: Measurement, other: Measurement) -> str:
        """Whether the win is larger than the run-to-run spread: every repeat of one beat every repeat of the other."""
        a, b = winner.gen_tps_range, other.gen_tps_range
        if winner.repeats < 2 or other.repeats < 2 or a is None or b is None:
            return " One repeat each: the spread was not measured (run without --quick to see it)."
        if a[0] > b[1]:
            return " Every repeat of it was faster than every repeat of the other."
        return (f" The repeats overlap ({a[0]:.1f}-{a[1]:.1f} against {b[0]:.1f}-{b[1]:.1f} tokens/s): the margin is "
                "within this machine's run-to-run noise.")

    def _likely_causes(self, m: Measurement) -> str:
        causes = []
        a = m.acceptance or 0.0
        if a < 0.3:
            causes.append("low acceptance, which points at a derived or QAT target or a drafter trained on another "
                          "version of it")
        flags = " ".join(self.user_flags)
        if any(f in flags for f in ("-ctkd", "-ctvd", "--spec-draft-type-k", "--spec-draft-type-v",
                                    "--cache-type-k-draft", "--cache-type-v-draft")):
            causes.append("the quantized drafter KV cache set in the flags")
        if m.config.drafter is not None and m.config.drafter.type_name.upper().startswith(("Q4", "Q3", "Q2", "IQ")):
            causes.append(f"the drafter's {m.config.drafter.type_name} precision (try its Q8_0 or BF16 file)")
        if self.thinking == "on":
            causes.append("the thinking template (drafters such as z-lab's Qwen3 ones were trained without it: "
                          "try --thinking off)")
        causes.append("the hardware: each step verifies n-max + 1 tokens, which a CPU pays for almost in full, and "
                      "a large vocabulary makes every sampled position costly")
        return "; ".join(causes) + "."

    def to_dict(self) -> dict[str, Any]:
        base = self.baseline.gen_tps if self.baseline else None
        best = self.best
        changed = set(map(id, self.changed_output))
        # files by name only: the report goes into pair.json, which may be published
        return {"target": self.target.name, "drafters": [{"file": d.path.name, "arch": d.arch,
                                                          "spec_type": d.spec_type, "block_size": d.block_size,
                                                          "type": d.type_name} for d in self.drafters],
                "workload": {**self.workload.to_dict(), "thinking": self.thinking},
                "server": self.server.to_dict(), "user_flags": list(self.user_flags), "budget_seconds": self.budget,
                "seconds": round(self.seconds, 1),
                "projector": self.projector.name if self.projector else None,
                "configurations": [m.to_dict(base) | {"greedy_same_as_target": self.greedy(m).to_dict(),
                                                       "greedy_by_prompt_kind": {
                                                           k: self.greedy_of_kind(m, k).to_dict() for k in m.kinds},
                                                       "servable": self.servable(m) if not m.config.alone else
                                                       m.status == "ok", "changed_output": id(m) in changed}
                                   for m in self.measurements],
                "serve_changed_output": self.serve_changed_output, "parallel": self.parallel, "shape": self.shape,
                "exact_text_check": self.exact_text_check,
                "baseline": {"generation_tokens_per_second": _r(base),
                             "generation_tokens_per_second_range": [_r(x) for x in rng] if (rng := (
                                 self.baseline.gen_tps_range if self.baseline else None)) else None,
                             "runs": sum(1 for m in self.measurements if m.config.alone and m.status == "ok"),
                             "repeats": self.baseline.repeats if self.baseline else 0},
                "best": best.config.to_dict() | {"speedup": _r(self.speedup(best), 3)} if best else None,
                "ranking": [{"configuration": m.config.label, "method": m.config.method,
                             "drafter": m.config.drafter.path.name if m.config.drafter else None,
                             "generation_tokens_per_second": _r(m.gen_tps),
                             "speedup": _r(self.speedup(m), 3)} for m in self.ranking],
                "collapsed": [d.path.name for d in self.collapsed], "own_mtp_collapsed": self.own_mtp_collapsed,
                "lineage": dict(self.lineage),
                "placements": [p.to_dict() for p in self.placements],
                "verdict": self.verdict,
                "image_prompts": self.image_note or None,
                "notes": list(self.notes)}


@dataclass(frozen=True)
class TagSpeed:
    """One quant tag of a folder of several, measured on its own: its target alone, and the fastest way it served
    (with its own drafter, the target's MTP head or n-gram drafting), as pair.json's ``tag_tuning`` records it."""

    tag: str
    target: str  # the target's file name
    drafter: str | None  # the drafter measured with it (the sidecar -hf REPO:TAG serves)
    alone_tps: float | None
    best: str | None  # the fastest configuration's label
    best_tps: float | None
    speedup: float | None
    acceptance: float | None  # the drafter's, at its fastest configuration

    @classmethod
    def of(cls, tag: str, report: TuneReport) -> TagSpeed:
        best, drafting = report.best, report.best_drafting
        return cls(tag, report.target.name, report.drafters[0].path.name if report.drafters else None,
                   _r(report.baseline.gen_tps if report.baseline else None), best.config.label if best else None,
                   _r(best.gen_tps if best else None), _r(report.speedup(best), 3) if best else None,
                   _r(drafting.acceptance, 4) if drafting is not None else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> TagSpeed | None:
        """None for a record this version cannot read."""
        try:
            return cls(**{f: d.get(f) for f in cls.__dataclass_fields__})
        except (AttributeError, TypeError):
            return None


def fastest_tag(speeds: Sequence[TagSpeed]) -> TagSpeed | None:
    """The tag that served fastest (its best configuration's tokens/s), among those measured."""
    measured = [s for s in speeds if s.best_tps is not None]
    return max(measured, key=lambda s: s.best_tps or 0.0) if measured else None
