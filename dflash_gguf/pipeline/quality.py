"""``dflash-gguf quality``: each tag of an output folder against its 16-bit original, by llama-perplexity's KL
divergence, once per tag and text, cached in pair.json's ``quality`` and shown beside tune's speed per tag."""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import folder_lock, made_cache
from ..errors import InputError, PlotUnavailable
from ..ggufio.reader import read_gguf, tensor_nbytes
from ..hub import TOKENIZER_PATTERNS, WEIGHT_PATTERNS
from ..llama_bin import FoundBinary
from ..provenance import Provenance
from ..tune.plot import QUALITY_PLOT_NAME, write_quality_plot
from ..tune.quality import Kld, KldSettings, find_llama_perplexity, measure_kld, save_base_logits
from . import stages
from .manifest import Manifest, PairRecord, read_manifest, sha256_file
from .naming import encoding_tag, gguf_name, model_name
from .sources import fetch_source, resolve_source

log = logging.getLogger(__name__)

UNQUANTIZED = ("bf16", "f16", "f32")  # the types a base may be
DEFAULT_SETTINGS = KldSettings()
LOGITS_KIND = "base-logits"  # made_cache's folder for --kl-divergence-base files


@dataclass(frozen=True)
class FileSize:
    """A GGUF's size as quant tables give it: bytes on disk (every shard) and bits per weight (its tensors' bytes
    times 8 over their elements, as llama.cpp's loader prints BPW)."""

    size_bytes: int
    bits_per_weight: float

    @classmethod
    def of(cls, path: Path) -> FileSize:
        meta = read_gguf(path)
        data = sum(tensor_nbytes(t, path) for t in meta.tensors.values())
        elements = sum(math.prod(t.ne) for t in meta.tensors.values())
        return cls(sum(f.stat().st_size for f in meta.files), round(data * 8 / max(elements, 1), 4))


@dataclass(frozen=True)
class TagQuality:
    """One tag's drift from the base (the base itself included: KLD 0), its size, and its speed when tune --tags
    measured it."""

    tag: str
    file: str
    sha256: str
    size: FileSize
    kld: Kld
    gen_tps: float | None = None  # tune --tags: the tag's fastest configuration
    acceptance: float | None = None  # ... and its drafter's acceptance

    def to_dict(self) -> dict[str, Any]:
        return {"tag": self.tag, "file": self.file, "sha256": self.sha256, **asdict(self.size), **self.kld.to_dict(),
                "generation_tokens_per_second": self.gen_tps, "acceptance": self.acceptance}


@dataclass(frozen=True)
class QualityReport:
    """Every tag measured against one base, on one text, with one tool and settings."""

    base: str  # the base file's name
    text: str  # the text's name
    text_sha256: str
    settings: KldSettings
    tool: str
    hardware: str
    tags: tuple[TagQuality, ...]
    plot: str | None = None  # quality.png, when drawn
    notes: tuple[str, ...] = ()  # e.g. why the picture was not drawn

    @property
    def pareto_front(self) -> tuple[str, ...]:
        """The tags no other tag beats on both size and mean KLD (smaller or equal in both, smaller in one), smallest
        first: for any memory budget, the least drift is one of these. The base's own row is not a candidate."""
        rows = [t for t in self.tags if not t.tag.endswith("(base)")]
        front = [t for t in rows if not any(
            o.size.size_bytes <= t.size.size_bytes and o.kld.kld_mean <= t.kld.kld_mean
            and (o.size.size_bytes, o.kld.kld_mean) != (t.size.size_bytes, t.kld.kld_mean) for o in rows)]
        return tuple(t.tag for t in sorted(front, key=lambda t: t.size.size_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "text": {"name": self.text, "sha256": self.text_sha256},
                "settings": self.settings.to_dict(), "tool": self.tool, "hardware": self.hardware,
                "tags": [t.to_dict() for t in self.tags], "pareto_front": list(self.pareto_front),
                "plot": self.plot, "notes": list(self.notes)}


def base_of(record: PairRecord, given: Path | None) -> Path | None:
    """The 16-bit original the tags are measured against: ``given``, else the folder's 16-bit tag, else the kept
    16-bit conversion (--keep-intermediate); None when the folder holds none (then it is made: :func:`made_base`).

    Raises:
        InputError: ``given`` is not a file.
    """
    if given is not None:
        if not Path(given).is_file():
            raise InputError(f"--base {given}: no such file.")
        return Path(given)
    for tag in record.tags:
        if tag.tag in UNQUANTIZED and (record.folder / tag.target.file).is_file():
            return record.folder / tag.target.file
    kept = record.target.intermediate
    if kept is not None and (record.folder / kept.file).is_file():
        return record.folder / kept.file
    if (record.target.type or "") in UNQUANTIZED:
        return record.file("target")
    return None


_QUANT_FIELDS = ("quant", "one_pass", "overrides", "imatrix")  # what a tag's stage key adds to the conversion's


def conversion_key(manifest: Manifest) -> dict[str, Any]:
    """The target's conversion key as the run recorded it (a tag's stage key less what its quantization adds): what
    the 16-bit target depends on, so what its logits over a text depend on.

    Raises:
        InputError: pair.json records no conversion of a target (the target came as a GGUF, --target-gguf).
    """
    for stage in manifest.stages.values():
        key = stage.key.get("input", stage.key)  # a stage quantizing the 16-bit file names its conversion "input"
        if isinstance(key, dict) and "method" in key and "outtype" in key and key.get("method") != "gguf":
            return {k: v for k, v in key.items() if k not in _QUANT_FIELDS}
    raise InputError(f"{manifest.path}: records no conversion of the target from a checkpoint (it came as a GGUF), "
                     "so no 16-bit target can be made to measure its quants against. Pass --base BF16.gguf.")


def made_base(manifest: Manifest, record: PairRecord, checkpoint: str | None, out: Path) -> Path:
    """The 16-bit target made again from its checkpoint by the built-in converter, as the run made its tags (the same
    tokenizer repair, dropped MTP head and type), into ``out``: ``checkpoint`` (a folder or Hub spec), else the
    repo at the commit pair.json records; it must be the checkpoint the folder was made from.

    Raises:
        InputError: the checkpoint was a local folder and none is given, or the one given is another checkpoint.
        ResolveError: the repo cannot be fetched.
    """
    key = conversion_key(manifest)
    src = record.sources.target if record.sources is not None else None
    spec = checkpoint or (f"{src.repo}@{src.commit}" if src is not None and src.repo and src.commit else None)
    if spec is None:
        raise InputError(f"{record.path}: the folder holds no 16-bit target and its checkpoint was the local folder "
                         f"{src.path if src is not None else '(not recorded)'}, which pair.json names but does not "
                         "locate. Pass --checkpoint DIR (that folder) to make the 16-bit target from it, or --base "
                         "BF16.gguf.")
    source = fetch_source(resolve_source(spec), TOKENIZER_PATTERNS + WEIGHT_PATTERNS)
    if source.identity() != key.get("source"):
        raise InputError(f"--checkpoint {spec}: is {source.identity()}, and the folder's target was made from "
                         f"{key.get('source')} (pair.json, its conversion's key): its quants would be measured "
                         "against another model. Pass the checkpoint the folder was made from, or --base BF16.gguf.")
    tok = stages.prepare_tokenizer(source.path, out.parent / "tokenizer")
    log.info("quality: making the 16-bit target from %s (the folder holds none)", source.label)
    stages.convert_target_builtin(source.path, out, str(key["outtype"]), tok,
                                  Provenance(None, source.repo_spec, None, tok.provenance()),
                                  drop_mtp=bool(key.get("drop_mtp")))
    return out


def _tags(record: PairRecord) -> list[tuple[str, str, str]]:
    """(tag, file, sha256) of every target the folder holds, as pair.json recorded them."""
    if record.tags:
        return [(encoding_tag(t.target.file), t.target.file, t.target.sha256 or "") for t in record.tags]
    return [(encoding_tag(record.target.file), record.target.file, record.target.sha256 or "")]


def measure_quality(manifest_path: Path, text: Path, *, base: Path | None = None, checkpoint: str | None = None,
                    settings: KldSettings = DEFAULT_SETTINGS, plot: bool = False,
                    progress: Callable[[int, int, str], None] | None = None) -> QualityReport:
    """Each tag of the folder against the base's logits over ``text``; a tag measured before with the same base,
    text, settings and tool is taken from pair.json. The result is recorded there (``quality``).

    The base: ``base``, else the folder's 16-bit file, else made from the checkpoint (``checkpoint``, or the repo
    pair.json records) into the folder's work space and removed afterwards. Its logits are kept by content
    (:mod:`made_cache`): another folder of the same target, measured on the same text, makes neither again. With
    ``plot``, ``quality.png`` (KLD against size, the Pareto front marked) is drawn into the folder.

    Raises:
        InputError: no pair.json, no text, or no base and no way to make it.
        TuneError: llama-perplexity is not found, or failed.
        FolderBusyError: a pipeline run is writing the folder.
    """
    record = read_manifest(manifest_path)
    if not Path(text).is_file():
        raise InputError(f"--text {text}: no such file. Pass the text to measure on (plain text, a few thousand "
                         "tokens or more).")
    found = base_of(record, base)
    binary = find_llama_perplexity()
    tool = binary.described("llama-perplexity")
    text_sha = sha256_file(Path(text))
    manifest = Manifest.load(record.folder)
    identity: dict[str, Any]
    rows = _tags(record)
    if found is not None:
        base_name, base_sha = found.name, sha256_file(found)
        identity = {"base_sha256": base_sha}
        rows.insert(0, (f"{encoding_tag(found.name)} (base)", found.name, base_sha))
    else:  # made from the checkpoint: named as the run would name its 16-bit tag, known by its conversion's key
        key = conversion_key(manifest)
        src = record.sources.target if record.sources is not None else None
        base_name = gguf_name(model_name(src.repo, Path(src.path or src.spec)) if src else "target",
                              str(key["outtype"]))
        identity = {"base_conversion": key}
    same = {**identity, "text_sha256": text_sha, "settings": settings.to_dict(), "tool": tool}
    earlier = dict(record.quality or {})
    cached = {t["sha256"]: t for t in earlier.get("tags") or () if isinstance(t, dict)} \
        if {k: earlier.get(k) for k in same} == same else {}
    speeds = _speeds(record)
    measured: list[TagQuality] = []
    hardware = str(earlier.get("hardware") or "") if cached else ""
    work = record.folder / folder_lock.WORK_DIR / "quality"
    with folder_lock.writing(record.folder, f"dflash-gguf quality {manifest_path}"):
        logits: Path | None = None
        try:
            for i, (tag, name, sha) in enumerate(rows):
                if progress is not None:
                    progress(i, len(rows), tag)
                path = found if found is not None and tag.endswith("(base)") else record.folder / name
                kld = Kld.from_dict(cached.get(sha))
                if kld is None:
                    if logits is None:
                        logits, hardware = _base_logits(binary, lambda: found or made_base(
                            manifest, record, checkpoint, work / base_name), Path(text), same, settings, work)
                    log.info("quality: %s against the base", name)
                    kld = measure_kld(binary, path, Path(text), logits, settings)
                cached[sha] = kld.to_dict()  # the base is also a tag when the folder holds a 16-bit one
                speed = speeds.get(name, (None, None))
                measured.append(TagQuality(tag, name, sha, FileSize.of(path), kld, *speed))
        finally:  # a made base and logits the cache could not take: large, and the results are kept
            shutil.rmtree(work, ignore_errors=True)
        report = QualityReport(base_name, Path(text).name, text_sha, settings, tool, hardware, tuple(measured))
        if plot:
            report = _drawn(report, record.folder)
        manifest = Manifest.load(record.folder)
        manifest.data["quality"] = {**same, **report.to_dict()}
        manifest.save()
    if progress is not None:
        progress(len(rows), len(rows), "done")
    return report


def _drawn(report: QualityReport, folder: Path) -> QualityReport:
    """The report with ``quality.png`` drawn into ``folder`` (or, without matplotlib, a note saying why not)."""
    points = [(t.tag, t.size.size_bytes, t.kld.kld_mean) for t in report.tags if not t.tag.endswith("(base)")]
    try:
        write_quality_plot(points, report.pareto_front, folder / QUALITY_PLOT_NAME,
                           f"{folder.name}: drift from {report.base} against size, on {report.text}")
    except PlotUnavailable as e:
        return replace(report, plot=None, notes=(*report.notes, str(e)))
    return replace(report, plot=QUALITY_PLOT_NAME)


def _base_logits(binary: FoundBinary, base: Callable[[], Path], text: Path, key: dict[str, Any],
                 settings: KldSettings, work: Path) -> tuple[Path, str]:
    """The base's logits over the text (``--kl-divergence-base``), taken from :mod:`made_cache` when any earlier run
    made them from the same base, text, settings and tool, else made from ``base()`` and kept there (in ``work``
    when the cache cannot be written); and the hardware they were made on (the tool's system_info line)."""
    kept = made_cache.lookup(LOGITS_KIND, key, ".kld")
    if kept is not None:
        log.info("quality: the base's logits, made earlier from the same base and text, from %s", kept.path)
        return kept.path, str(kept.about.get("hardware") or "")
    work.mkdir(parents=True, exist_ok=True)
    model = base()
    log.info("quality: the base's logits (%s over %s)", model.name, text.name)
    made = work / (made_cache.key_digest(key)[:16] + ".kld")
    hardware = save_base_logits(binary, model, text, made, settings)
    entry = made_cache.keep(LOGITS_KIND, key, made, ".kld", move=True, about={"hardware": hardware})
    return (entry.path if entry is not None else made), hardware


def _speeds(record: PairRecord) -> dict[str, tuple[float | None, float | None]]:
    """tune --tags' fastest tokens/s and the drafter's acceptance per target file, when it measured the tags."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for t in (record.tag_tuning or {}).get("tags") or ():
        if isinstance(t, dict) and isinstance(t.get("target"), str):
            out[t["target"]] = (t.get("best_tps"), t.get("acceptance"))
    return out
