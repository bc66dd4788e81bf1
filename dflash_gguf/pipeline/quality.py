"""``dflash-gguf quality``: each tag of an output folder against its 16-bit original, by llama-perplexity's KL
divergence, once per tag and text, cached in pair.json's ``quality`` and shown beside tune's speed per tag."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import folder_lock
from ..errors import InputError
from ..tune.quality import Kld, KldSettings, find_llama_perplexity, measure_kld, save_base_logits
from .manifest import Manifest, PairRecord, read_manifest, sha256_file
from .naming import encoding_tag

log = logging.getLogger(__name__)

UNQUANTIZED = ("bf16", "f16", "f32")  # the types a base may be
DEFAULT_SETTINGS = KldSettings()


@dataclass(frozen=True)
class TagQuality:
    """One tag's drift from the base (the base itself included: KLD 0), with its speed when tune --tags measured it."""

    tag: str
    file: str
    sha256: str
    kld: Kld
    gen_tps: float | None = None  # tune --tags: the tag's fastest configuration
    acceptance: float | None = None  # ... and its drafter's acceptance

    def to_dict(self) -> dict[str, Any]:
        return {"tag": self.tag, "file": self.file, "sha256": self.sha256, **self.kld.to_dict(),
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

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "text": {"name": self.text, "sha256": self.text_sha256},
                "settings": self.settings.to_dict(), "tool": self.tool, "hardware": self.hardware,
                "tags": [t.to_dict() for t in self.tags]}


def base_of(record: PairRecord, given: Path | None) -> Path:
    """The 16-bit original the tags are measured against: ``given``, else the folder's 16-bit tag, else the kept
    16-bit conversion (--keep-intermediate).

    Raises:
        InputError: none of them is there.
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
    raise InputError(f"{record.path}: the folder holds no 16-bit target to measure its quants against. Pass --base "
                     "BF16.gguf (the target converted without quantizing), or make the folder with a 16-bit tag "
                     "(dflash-convert --quant BF16,Q4_K_M,...) or --keep-intermediate.")


def _tags(record: PairRecord) -> list[tuple[str, str, str]]:
    """(tag, file, sha256) of every target the folder holds, as pair.json recorded them."""
    if record.tags:
        return [(encoding_tag(t.target.file), t.target.file, t.target.sha256 or "") for t in record.tags]
    return [(encoding_tag(record.target.file), record.target.file, record.target.sha256 or "")]


def measure_quality(manifest_path: Path, text: Path, *, base: Path | None = None,
                    settings: KldSettings = DEFAULT_SETTINGS,
                    progress: Callable[[int, int, str], None] | None = None) -> QualityReport:
    """Each tag of the folder against the base's logits over ``text``; a tag measured before with the same base,
    text, settings and tool is taken from pair.json. The result is recorded there (``quality``).

    Raises:
        InputError: no pair.json, no base, or no text.
        TuneError: llama-perplexity is not found, or failed.
        FolderBusyError: a pipeline run is writing the folder.
    """
    record = read_manifest(manifest_path)
    if not Path(text).is_file():
        raise InputError(f"--text {text}: no such file. Pass the text to measure on (plain text, a few thousand "
                         "tokens or more).")
    base_path = base_of(record, base)
    binary = find_llama_perplexity()
    tool = binary.described("llama-perplexity")
    text_sha = sha256_file(Path(text))
    base_sha = sha256_file(base_path)
    same = {"base_sha256": base_sha, "text_sha256": text_sha, "settings": settings.to_dict(), "tool": tool}
    earlier = dict(record.quality or {})
    cached = {t["sha256"]: t for t in earlier.get("tags") or () if isinstance(t, dict)} \
        if {k: earlier.get(k) for k in same} == same else {}
    rows: list[tuple[str, str, str]] = [(f"{encoding_tag(base_path.name)} (base)", base_path.name, base_sha),
                                        *_tags(record)]
    speeds = _speeds(record)
    measured: list[TagQuality] = []
    hardware = str(earlier.get("hardware") or "") if cached else ""
    with folder_lock.writing(record.folder, f"dflash-gguf quality {manifest_path}"):
        logits = record.folder / folder_lock.WORK_DIR / "quality" / (
            hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16] + ".kld")
        for i, (tag, name, sha) in enumerate(rows):
            if progress is not None:
                progress(i, len(rows), tag)
            if sha in cached:
                kld = Kld(**{k: cached[sha][k] for k in Kld.__dataclass_fields__})
            else:
                if not logits.is_file():
                    logits.parent.mkdir(parents=True, exist_ok=True)
                    log.info("quality: the base's logits (%s over %s)", base_path.name, Path(text).name)
                    hardware = save_base_logits(binary, base_path, Path(text), logits, settings)
                log.info("quality: %s against the base", name)
                kld = measure_kld(binary, base_path if tag.endswith("(base)") else record.folder / name, Path(text),
                                  logits, settings)
            cached[sha] = kld.to_dict()  # the base is also a tag when the folder holds a 16-bit one
            speed = speeds.get(name, (None, None))
            measured.append(TagQuality(tag, name, sha, kld, *speed))
        report = QualityReport(base_path.name, Path(text).name, text_sha, settings, tool, hardware, tuple(measured))
        manifest = Manifest.load(record.folder)
        manifest.data["quality"] = {**same, **report.to_dict()}
        manifest.save()
    if progress is not None:
        progress(len(rows), len(rows), "done")
    if logits.is_file():
        os.unlink(logits)  # 2 bytes per vocabulary entry per scored token: large, and the results are kept
    return report


def _speeds(record: PairRecord) -> dict[str, tuple[float | None, float | None]]:
    """tune --tags' fastest tokens/s and the drafter's acceptance per target file, when it measured the tags."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for t in (record.tag_tuning or {}).get("tags") or ():
        if isinstance(t, dict) and isinstance(t.get("target"), str):
            out[t["target"]] = (t.get("best_tps"), t.get("acceptance"))
    return out
