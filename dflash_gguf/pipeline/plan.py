"""The plan of a run (``plan_run``): files to download (with sizes), outputs (with estimated sizes), and the disk it
needs.

Computed from configs, the Hub's file listing at the pinned commit and the local cache, before any
weight is fetched: ``--dry-run`` prints it, and every run refuses up front when a filesystem cannot
hold its share (downloads on the Hugging Face cache's, outputs on the output folder's).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hf_constants

from .. import folder_lock
from ..errors import OutputError
from ..ggufio.split import SplitRule, shard_path
from ..hub import DRAFTER_PATTERNS, TARGET_PATTERNS, WEIGHT_PATTERNS
from ..jsonfile import read_json
from ..sidecar import drafter_kind_of_checkpoint, sidecar_name
from . import stages, stream
from .naming import DRAFTERS_DIR, gguf_name, model_name, projector_name, size_ratio
from .options import PipelineOptions, makes_in_one_pass
from .sources import Source, cached_size, list_source_files


@dataclass(frozen=True)
class Download:
    source: str
    path: str
    size: int | None
    cached: int  # bytes of it already in the local cache (or, not kept, complete in the run's work folder)
    kept: bool = True  # into the Hub cache; False: a streamed shard in the work folder, removed once consumed


@dataclass(frozen=True)
class Output:
    file: str
    estimated: int
    kind: str  # "final" | "intermediate" (deleted after quantization unless --keep-intermediate) | "link"
    split: str | None = None  # how the final is split into shards (--split-max-size/--split-max-tensors)


@dataclass(frozen=True)
class Plan:
    outdir: Path
    downloads: tuple[Download, ...]
    outputs: tuple[Output, ...]
    needed: dict[str, int] = field(default_factory=dict)  # filesystem (a folder on it) -> bytes needed
    free: dict[str, int] = field(default_factory=dict)  # filesystem (a folder on it) -> bytes free
    # with the source kept, the bytes the run would need with --no-keep-source instead (offered when short)
    without_source: int | None = None

    @property
    def short(self) -> dict[str, tuple[int, int]]:
        """Filesystems that cannot hold their share: folder -> (needed, free)."""
        return {k: (v, self.free[k]) for k, v in self.needed.items() if v > self.free[k]}

    def to_dict(self) -> dict[str, Any]:
        return {"outdir": str(self.outdir),
                "downloads": [{"source": d.source, "file": d.path, "size": d.size, "cached": d.cached,
                               "kept": d.kept} for d in self.downloads],
                "outputs": [{"file": o.file, "estimated_size": o.estimated, "kind": o.kind}
                            | ({"split": o.split} if o.split else {}) for o in self.outputs],
                "disk": [{"filesystem": k, "needed": v, "free": self.free[k], "enough": v <= self.free[k]}
                         for k, v in self.needed.items()]}

    def require_space(self) -> None:
        """Raises OutputError when a filesystem cannot hold the run."""
        if not self.short:
            return
        what = "; ".join(f"about {n / 1e6:.1f} MB is needed on the filesystem of {k} and {f / 1e6:.1f} MB is free"
                         for k, (n, f) in self.short.items())
        offer = "" if self.without_source is None else (
            f" With --no-keep-source the target's shards are converted as they arrive and each is removed once "
            f"consumed, never kept in the Hugging Face cache: about {self.without_source / 1e6:.1f} MB in all"
            + (", which fits." if all(self.without_source <= f for f in self.free.values()) else "."))
        raise OutputError(f"Not enough disk space for the pair in {self.outdir}: {what}.{offer} Free some space, "
                          "choose another --outdir, or point HF_HOME at a larger disk for the downloads. Nothing was "
                          "downloaded or written.")


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


@dataclass(frozen=True)
class SideFiles:
    """One side's files for the plan: the intermediate at the checkpoint's type and the final file."""

    intermediate: str
    final: str
    weights: int  # bytes of 16-bit safetensors
    src: str
    quant: str
    one_pass: bool = False  # converted and quantized in one pass, no intermediate
    link: str | None = None  # the final is a link to an existing GGUF (--target-gguf)


def projector_params(config: dict[str, Any]) -> int:
    """About how many weights a checkpoint's vision and audio towers hold, from config.json alone (the plan is made
    before any weight is fetched): each layer's attention (4 h^2) and gated MLP (3 h ff), and the projection into
    the text model's width."""
    text = config.get("text_config") or config
    n_embd = int(text.get("hidden_size") or 0)
    total = 0
    for tower in (config.get("vision_config"), config.get("audio_config")):
        if not isinstance(tower, dict):
            continue
        h = int(tower.get("hidden_size") or tower.get("width") or 0)
        ff = int(tower.get("intermediate_size") or 4 * h)
        layers = int(tower.get("num_hidden_layers") or tower.get("depth") or tower.get("num_layers") or 0)
        total += layers * (4 * h * h + 3 * h * ff) + h * n_embd
    return total


def estimate_outputs(sides: list[SideFiles], *, keep_intermediate: bool) -> tuple[list[Output], int]:
    """The output files with estimated sizes, and the peak bytes they occupy at once."""
    outputs: list[Output] = []
    peaks: list[int] = []
    finals = 0
    for side in sides:
        if side.link is not None:
            outputs.append(Output(side.link, 0, "link"))
            continue
        inter = int(side.weights * size_ratio(side.src))
        final = int(side.weights * size_ratio(side.quant))
        if side.src == side.quant or side.one_pass:
            size = inter if side.src == side.quant else final
            outputs.append(Output(side.final, size, "final"))
            finals += size
            peaks.append(finals)
            continue
        outputs.append(Output(side.intermediate, inter, "intermediate"))
        outputs.append(Output(side.final, final, "final"))
        peaks.append(finals + inter + final)
        finals += final + (inter if keep_intermediate else 0)
    return outputs, max([finals, *peaks])


def split_outputs(outputs: list[Output], finals: set[str], rule: SplitRule) -> list[Output]:
    """``outputs`` with each of ``finals`` named as the shards ``rule`` makes of it: the first shard's name and how
    many there will be about (shards end at tensor boundaries, so a size rule may take one more); by tensor count,
    the rule alone (the plan does not know the tensors yet)."""
    out = []
    for o in outputs:
        if o.file in finals and o.kind == "final":
            if rule.max_bytes is None:
                o = replace(o, split=f"in shards, {rule.describe()}")
            elif (count := -(-o.estimated // rule.max_bytes)) > 1:
                o = replace(o, file=shard_path(Path(o.file), 1, count).name,
                            split=f"about {count} shards, {rule.describe()}")
        out.append(o)
    return out


def make_plan(outdir: Path, downloads: list[Download], outputs: list[Output], peak: int,
              in_flight: int | None = None) -> Plan:
    """Bytes needed per filesystem (downloads not yet cached on the Hub cache's, outputs not yet written and the
    streamed shards not kept on the output folder's) against what is free there. ``in_flight``: the most bytes of
    streamed shards on disk at once (a few shards, each removed once consumed); None: all of them."""
    # the Hub cache read at call time, as HF_HOME may be set after import
    out_fs, cache_fs = _existing(outdir), _existing(Path(hf_constants.HF_HUB_CACHE))
    present = sum((outdir / o.file).stat().st_size for o in outputs if (outdir / o.file).is_file())
    to_download = sum(max((d.size or 0) - d.cached, 0) for d in downloads if d.kept)
    streamed = sum(max((d.size or 0) - d.cached, 0) for d in downloads if not d.kept)
    out_need = max(peak - present, 0) + (streamed if in_flight is None else min(streamed, in_flight))
    needed: dict[str, int] = {}
    if os.stat(out_fs).st_dev == os.stat(cache_fs).st_dev:
        needed[str(out_fs)] = out_need + to_download
    else:
        needed[str(out_fs)] = out_need
        needed[str(cache_fs)] = to_download
    free = {k: shutil.disk_usage(k).free for k in needed}
    return Plan(Path(outdir), tuple(downloads), tuple(outputs), needed, free)


def _config_type(cfg_path: Path) -> str:
    """The checkpoint's 16-bit type as config.json declares it (for the plan, before any weight is here)."""
    cfg = read_json(cfg_path)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype") \
        or (cfg.get("text_config") or {}).get("torch_dtype")
    return "bf16" if dtype == "bfloat16" else "f16"


def drafter_file(target: Source, drafter: Source, draft_quant: str, several: bool) -> str:
    """Where a drafter's GGUF goes in the output folder: its sidecar name, in ``drafters/`` when the run makes
    several (llama.cpp's folder layout holds one target and one sidecar: the one served is linked beside the
    target; ``load_from_models_dir`` would otherwise attach whichever sidecar it lists first)."""
    name = sidecar_name(model_name(target.repo, target.path), draft_quant, drafter_kind_of_checkpoint(drafter.path))
    return f"{DRAFTERS_DIR}/{name}" if several else name


def plan_run(opts: PipelineOptions, drafters: list[Source], target: Source, method: stages.TargetMethod,
             outdir: Path, drafter_by_llama_cpp: bool = False) -> Plan:
    """Files to download with sizes, outputs with estimated sizes, disk needed and free."""
    name_t = model_name(target.repo, target.path)
    target_patterns = TARGET_PATTERNS + (() if isinstance(method, stages.ExistingGguf) else WEIGHT_PATTERNS)
    downloads: list[Download] = []
    weights: dict[str, int] = {}
    sides_in = [("target", target, target_patterns)] + [(f"drafter{i}", d, DRAFTER_PATTERNS)
                                                         for i, d in enumerate(drafters)]
    streams = (isinstance(method, stages.BuiltinConverter) and not drafter_by_llama_cpp
               and bool(stream.shard_names(target)))
    into = stream.source_dir(outdir / folder_lock.WORK_DIR, target)
    for side, src, patterns in sides_in:
        files = list_source_files(src, patterns)
        weights[side] = sum(f.size or 0 for f in files if f.path.endswith(".safetensors"))
        if src.repo is not None:
            downloads += [Download(src.label, f.path, f.size, stream.complete_bytes(into / f.path, f.size), False)
                          if streams and not opts.keep_source and side == "target" and f.path.endswith(".safetensors")
                          else Download(src.label, f.path, f.size, cached_size(src, f.path)) for f in files]
    link = None
    if isinstance(method, stages.ExistingGguf):
        local = Path(method.spec).expanduser()
        link = local.name if local.is_file() else method.spec.rsplit("/", 1)[-1]
        if not local.is_file():
            downloads.append(Download(method.spec, method.spec.partition(":")[2], None, 0))
    src_t = _config_type(target.path / "config.json")
    builtin = isinstance(method, stages.BuiltinConverter)
    sides = [SideFiles(gguf_name(name_t, src_t), gguf_name(name_t, tag), weights["target"], src_t, opts.type_of(tag),
                       builtin and makes_in_one_pass(opts, tag, target=True), link) for tag in opts.tags]
    for i, drafter in enumerate(drafters):
        src_d, name_d = _config_type(drafter.path / "config.json"), model_name(drafter.repo, drafter.path)
        for draft_quant in dict.fromkeys(opts.drafter_types()):
            sides.append(SideFiles(gguf_name(name_d, src_d), drafter_file(target, drafter, draft_quant,
                                                                            len(drafters) > 1),
                                   weights[f"drafter{i}"], src_d, opts.type_of(draft_quant),
                                   not drafter_by_llama_cpp and makes_in_one_pass(opts, draft_quant)))
    outputs, peak = estimate_outputs(sides, keep_intermediate=opts.keep_intermediate)
    outputs = list({o.file: o for o in outputs}.values())  # several tags share the intermediate
    if opts.split.given:
        outputs = split_outputs(outputs, {gguf_name(name_t, tag) for tag in opts.tags}, opts.split)
    projector = opts.mmproj and link is None and stages.has_projector(target.path)
    if projector:
        size = int(projector_params(read_json(target.path / "config.json")) * 2 * size_ratio(opts.mmproj_type))
        outputs.append(Output(projector_name(name_t, opts.mmproj_type), size, "final"))
        peak += size
    shards = [d for d in downloads if not d.kept]
    in_flight = stream.WINDOW * max((d.size or 0 for d in shards), default=0) \
        if stream.reads_once(opts) else None
    if opts.keep_source:
        plan = make_plan(outdir, downloads, outputs, peak)
        if streams and plan.short:  # what --no-keep-source would need instead, offered in the refusal
            alone = [replace(d, cached=0, kept=False) if d.source == target.label and d.path.endswith(".safetensors")
                     else d for d in downloads]
            plan = replace(plan, without_source=sum(make_plan(outdir, alone, outputs, peak, in_flight).needed.values()))
        return plan
    return make_plan(outdir, downloads, outputs, peak, in_flight)
