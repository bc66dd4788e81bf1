"""The plan of a run: files to download (with sizes), outputs (with estimated sizes), and the disk it needs.

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

from ..errors import OutputError
from ..ggufio.split import SplitRule, shard_path
from .naming import size_ratio


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
