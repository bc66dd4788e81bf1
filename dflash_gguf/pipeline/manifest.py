"""``pair.json``: what a pipeline run made, from what, with which tools, and how to serve it.

Written atomically after every stage, so it always describes files that exist under their final
names; a re-run skips a stage whose recorded inputs (its ``key``) are unchanged and whose outputs still
have the recorded size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_output
from ..drafters.dflash.rules import SPEC_TYPE as DFLASH_SPEC_TYPE
from ..errors import InputError
from ..jsonfile import load_json
from ..relpath import name_problem
from ..verify.report import Report

log = logging.getLogger(__name__)

MANIFEST_NAME = "pair.json"
FORMAT = "dflash-gguf-pair/1"
_CHUNK = 8 << 20
_ORDER = ("format", "status", "sources", "options", "outputs", "serve", "tuning", "tokenizer", "tools", "verify",
          "precheck", "stages")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path, sha256: str | None = None, name: str | None = None) -> dict[str, Any]:
    """Name (relative to the manifest: ``name``, else the file's own), size and sha256 of an output; ``sha256``
    when the writer hashed it while writing (the built-in converter and quantizer do), else the file is read."""
    return {"file": name or path.name, "size": path.stat().st_size, "sha256": sha256 or sha256_file(path)}


class Manifest:
    """The manifest of one output folder: a JSON document plus the stage records that make resume work."""

    def __init__(self, outdir: Path, data: dict[str, Any] | None = None) -> None:
        self.outdir = Path(outdir)
        self.data: dict[str, Any] = data or {"format": FORMAT, "status": "in-progress", "stages": {}}

    @property
    def path(self) -> Path:
        return self.outdir / MANIFEST_NAME

    def name_of(self, path: Path) -> str:
        """How pair.json names an output: relative to the folder (``drafters/...`` for a run of several)."""
        return os.path.relpath(path, self.outdir)

    @classmethod
    def load(cls, outdir: Path) -> Manifest:
        """The folder's manifest, or a fresh one when there is none (an unreadable one is started over)."""
        path = Path(outdir) / MANIFEST_NAME
        if not path.is_file():
            return cls(outdir)
        try:
            data = load_json(path)
        except (OSError, ValueError) as e:
            log.warning("%s is unreadable (%s); starting over", path, e)
            return cls(outdir)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            log.warning("%s is not a %s manifest; starting over", path, FORMAT)
            return cls(outdir)
        data.setdefault("stages", {})
        return cls(outdir, data)

    def save(self) -> None:
        """Write pair.json atomically, the parts a reader wants first."""
        data = {k: self.data[k] for k in _ORDER if k in self.data} | self.data
        with atomic_output(self.path) as tmp:
            tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")

    def reusable(self, stage: str, key: dict[str, Any], outputs: list[Path]) -> bool:
        """True when ``stage`` ran with this ``key`` and each of ``outputs`` is still the file it wrote."""
        rec = self.data["stages"].get(stage)
        if not rec or rec.get("key") != json.loads(json.dumps(key, default=str)):
            return False
        files = {f["file"]: f for f in rec.get("outputs", [])}
        for out in outputs:
            want = files.get(self.name_of(out))
            if want is None or not out.is_file() or out.stat().st_size != want["size"]:
                return False
            if sha256_file(out) != want["sha256"]:
                log.info("%s changed since it was written; %s runs again", out, stage)
                return False
        log.info("%s: up to date, skipped", stage)
        return True

    def record(self, stage: str, key: dict[str, Any], outputs: list[Path], *,
               hashes: dict[Path, str | None] | None = None, **extra: Any) -> list[dict[str, Any]]:
        """Note that ``stage`` made ``outputs`` from ``key``, and save the manifest. ``hashes``: the sha256 of
        outputs whose writer hashed them while writing; the others are read to hash them."""
        files = [file_record(p, (hashes or {}).get(p), self.name_of(p)) for p in outputs]
        self.data["stages"][stage] = {"key": json.loads(json.dumps(key, default=str)), "outputs": files, **extra}
        self.save()
        return files


@dataclass(frozen=True)
class OutputRecord:
    """One GGUF the run made, as pair.json records it."""

    file: str
    size: int | None = None
    sha256: str | None = None
    type: str | None = None
    made_by: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputRecord:
        return cls(str(d["file"]), d.get("size"), d.get("sha256"), d.get("type"), d.get("made_by"))


@dataclass(frozen=True)
class ServeRecord:
    """How to serve the pair (absent in pair.json files from before the measured serve plan)."""

    command: tuple[str, ...]
    shell: str
    n_max: int | None = None
    measured: bool = False
    note: str = ""
    models_dir: str | None = None
    models_preset: str | None = None
    hub: str | None = None
    method: str = DFLASH_SPEC_TYPE  # what drafts: tune's method name ("target alone", "ngram-mod", ...)
    uses_drafter: bool = True  # False: the drafter file is not part of what is served

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeRecord:
        return cls(tuple(d.get("command") or ()), str(d.get("shell", "")), d.get("n_max"), bool(d.get("measured")),
                   str(d.get("note", "")), d.get("models_dir"), d.get("models_preset"), d.get("hub"),
                   str(d.get("method") or (DFLASH_SPEC_TYPE if d.get("uses_drafter", True) else "target alone")),
                   bool(d.get("uses_drafter", True)))


@dataclass(frozen=True)
class PairRecord:
    """What a reader of pair.json needs, typed: the two outputs, how the target was made, how to serve them."""

    path: Path
    status: str
    target: OutputRecord
    drafter: OutputRecord  # the one served (for a run of several: linked beside the target)
    target_method: str | None = None
    serve: ServeRecord | None = None
    drafters: tuple[OutputRecord, ...] = ()  # every drafter the run made (just ``drafter`` for one)

    @property
    def folder(self) -> Path:
        return self.path.parent

    def file(self, side: str) -> Path:
        return self.folder / (self.target if side == "target" else self.drafter).file

    def drafter_files(self) -> list[Path]:
        """Every drafter GGUF the run made (for a run of several, where they live: ``drafters/``)."""
        return [self.folder / d.file for d in self.drafters]

    @classmethod
    def from_data(cls, path: Path, data: Any) -> PairRecord:
        """The typed view of a manifest document already in memory (``path``: where it lives)."""
        return _pair_record(path, data)


def read_manifest(path: Path) -> PairRecord:
    """A pair.json written by the pipeline (any version of this format), typed.

    Raises:
        InputError: not readable, or not a pair manifest.
    """
    try:
        data = load_json(Path(path))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read it as a pair manifest ({e}). Pass the pair.json dflash-convert "
                         "wrote, or the two GGUF files.") from None
    return PairRecord.from_data(Path(path), data)


def _pair_record(path: Path, data: Any) -> PairRecord:
    """PairRecord.from_data: the typed view of a manifest document (read from ``path``).

    Raises:
        InputError: not a pair manifest, or one whose run did not finish.
    """
    outputs = data.get("outputs") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(outputs, dict):
        raise InputError(f"{path} is not a pair manifest written by dflash-convert (format {FORMAT}). Pass the "
                         "two GGUF files instead.")
    several = outputs.get("drafters")
    try:
        sides = {side: OutputRecord.from_dict(outputs[side]) for side in ("target", "drafter")}
        drafters = tuple(OutputRecord.from_dict(d) for d in several) if isinstance(several, list) else \
            (sides["drafter"],)
    except (KeyError, TypeError):
        raise InputError(f"{path}: its 'outputs' do not name a target and a drafter file (the run did not finish). "
                         "Re-run dflash-convert with the same options to complete it.") from None
    serve = data.get("serve")
    named = [(f"outputs.{side}.file", rec) for side, rec in sides.items()]
    if isinstance(several, list):
        named += [(f"outputs.drafters[{i}].file", rec) for i, rec in enumerate(drafters)]
    for field_name, rec in named:
        if (problem := name_problem(rec.file)) is not None:
            raise InputError(f"{path}: {field_name} is {problem}. Every file pair.json names lies in its own folder "
                             "(or drafters/ inside it); re-run dflash-convert to write a new pair.json rather than "
                             "editing it.")
    return PairRecord(Path(path), str(data.get("status", "")), sides["target"], sides["drafter"],
                      (data.get("options") or {}).get("target_method"),
                      ServeRecord.from_dict(serve) if isinstance(serve, dict) else None, drafters)


def verify_manifest(path: Path, *, allow_derived_target: bool = False) -> Report:
    """``dflash-verify pair.json``: the files it names, unchanged since they were written, judged as a pair (and,
    for a run of several drafters, every other drafter judged with the target too).

    Raises:
        InputError: the manifest or a GGUF cannot be read.
    """
    from ..verify import verify_files

    record = read_manifest(path)
    folder = record.folder
    files = {side: record.file(side) for side in ("drafter", "target")}
    others = {f: d for d in record.drafters if (f := folder / d.file).name != files["drafter"].name}
    for side, f in [*files.items(), *(("drafter", f) for f in others)]:
        if not f.is_file():
            raise InputError(f"{path} names the {side} {f.name}, which is not in {f.parent}. Keep pair.json beside "
                             "the GGUF files it names, or re-run dflash-convert to make them again.")
    report = verify_files(files["drafter"], files["target"], allow_derived_target=allow_derived_target)
    checked = [(f"manifest.{side}", f, record.target if side == "target" else record.drafter)
               for side, f in files.items()]
    for f, rec in others.items():
        other = verify_files(f, files["target"], allow_derived_target=allow_derived_target)
        if other.errors:
            report.fail(f"pair.drafters.{f.name}", "error", f"{rec.file}, another drafter of this run, cannot be "
                        f"served with the target: " + " ".join(f"[{r.id}] {r.message}" for r in other.errors),
                        f"'dflash-verify {f} {files['target']}' prints its full report.")
        else:
            report.ok(f"pair.drafters.{f.name}", f"{rec.file}, another drafter of this run, can be served with the "
                      f"target ({len(other.results)} checks, {len(other.warnings)} warnings)")
        checked.append((f"manifest.drafters.{f.name}", f, rec))
    for check_id, f, want in checked:
        if f.stat().st_size == want.size and sha256_file(f) == want.sha256:
            report.ok(check_id, f"{f.name}: size and sha256 as recorded in {Path(path).name}")
        else:
            report.fail(check_id, "error", f"{f.name} is not the file {Path(path).name} recorded (size or "
                        "sha256 differ): it was changed or replaced after the pair was made.",
                        "Re-run dflash-convert with the same options to make it again.")
    return report
