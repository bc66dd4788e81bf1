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
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..atomic import atomic_output
from ..drafters import DEFAULT_FAMILY
from ..drafters.findings import Report
from ..errors import InputError
from ..jsonfile import load_json
from ..relpath import inside, name_problem
from ..verify import read_gguf, verify_files
from ..verify.projector import check_projector

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


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class FileRecord:
    """A file a stage wrote: its name relative to pair.json, size and sha256."""

    file: str
    size: int | None = None
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileRecord:
        """Raises KeyError/TypeError when ``d`` names no file."""
        if not isinstance(d.get("file"), str):
            raise TypeError("no file name")
        return cls(d["file"], _opt_int(d.get("size")), _opt_str(d.get("sha256")))


def file_record(path: Path, sha256: str | None = None, name: str | None = None) -> FileRecord:
    """Name (relative to the manifest: ``name``, else the file's own), size and sha256 of an output; ``sha256``
    when the writer hashed it while writing (the built-in converter and quantizer do), else the file is read."""
    return FileRecord(name or path.name, path.stat().st_size, sha256 or sha256_file(path))


@dataclass(frozen=True)
class StageRecord:
    """What a stage ran with (its ``key``) and wrote; a re-run with the same key and unchanged files skips it."""

    key: dict[str, Any]
    outputs: tuple[FileRecord, ...]
    quantizer: str | None = None  # a quantize stage's quantizer and its version
    quantizer_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _drop_none({"key": self.key, "outputs": [o.to_json() for o in self.outputs],
                           "quantizer": self.quantizer, "quantizer_version": self.quantizer_version})

    @classmethod
    def from_json(cls, d: Any) -> StageRecord | None:
        """None for a record this version cannot read (the stage then runs again)."""
        try:
            return cls(dict(d["key"]), tuple(FileRecord.from_json(o) for o in d.get("outputs", [])),
                       _opt_str(d.get("quantizer")), _opt_str(d.get("quantizer_version")))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclass(frozen=True)
class Made:
    """How an output was made: its type and the tool (and, when kept, the intermediate it was quantized from)."""

    type: str
    made_by: str
    intermediate: FileRecord | None = None


@dataclass(frozen=True)
class DrafterVerdict:
    """verify's verdict on one drafter of a run of several, with the target."""

    servable: bool
    errors: int
    warnings: int


@dataclass(frozen=True)
class OutputRecord:
    """One GGUF the run made, as pair.json records it (a drafter of several also with its kind, source, verdict)."""

    file: str
    size: int | None = None
    sha256: str | None = None
    type: str | None = None
    made_by: str | None = None
    intermediate: FileRecord | None = None
    links_to: str | None = None  # a link: what it links to
    kind: str | None = None  # a drafter's sidecar kind (dflash, dspark, mtp, eagle3)
    source: str | None = None  # a drafter's source (repo@commit or folder)
    verdict: DrafterVerdict | None = None
    shards: tuple[FileRecord, ...] | None = None  # a split output: the shards after ``file`` (its first)

    @classmethod
    def of(cls, rec: FileRecord, made: Made | None = None, **extra: Any) -> OutputRecord:
        return cls(rec.file, rec.size, rec.sha256, made.type if made else None, made.made_by if made else None,
                   made.intermediate if made else None, **extra)

    def to_json(self) -> dict[str, Any]:
        return _drop_none({"file": self.file, "size": self.size, "sha256": self.sha256, "type": self.type,
                           "made_by": self.made_by, "links_to": self.links_to,
                           "intermediate": self.intermediate.to_json() if self.intermediate else None,
                           "kind": self.kind, "source": self.source,
                           "verify": asdict(self.verdict) if self.verdict else None,
                           "shards": [x.to_json() for x in self.shards] if self.shards else None})

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OutputRecord:
        """Raises KeyError/TypeError when ``d`` names no file."""
        verdict, shards = d.get("verify"), d.get("shards")
        return cls(FileRecord.from_json(d).file, _opt_int(d.get("size")), _opt_str(d.get("sha256")),
                   _opt_str(d.get("type")), _opt_str(d.get("made_by")),
                   FileRecord.from_json(d["intermediate"]) if isinstance(d.get("intermediate"), dict) else None,
                   _opt_str(d.get("links_to")), _opt_str(d.get("kind")), _opt_str(d.get("source")),
                   DrafterVerdict(bool(verdict.get("servable")), int(verdict.get("errors", 0)),
                                  int(verdict.get("warnings", 0))) if isinstance(verdict, dict) else None,
                   tuple(FileRecord.from_json(x) for x in shards) if isinstance(shards, list) else None)

    def served(self) -> OutputRecord:
        """The record of the drafter served, without what only a run of several records of each."""
        return replace(self, kind=None, source=None, verdict=None)


@dataclass(frozen=True)
class TagRecord:
    """One quant tag of a run of several (``--quant Q4_K_M,Q6_K,Q8_0``): its target and the drafter served with it
    (the sidecar ``-hf REPO:TAG`` pairs with it), and verify's verdict on the two."""

    tag: str  # the target's type, as --quant names it (lower case)
    target: OutputRecord
    drafter: OutputRecord
    verdict: DrafterVerdict

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "target": self.target.to_json(), "drafter": self.drafter.to_json(),
                "verify": asdict(self.verdict)}

    @classmethod
    def from_json(cls, d: Any) -> TagRecord:
        """Raises KeyError/TypeError when ``d`` does not name a tag, a target and a drafter file."""
        verdict = d["verify"]
        return cls(str(d["tag"]), OutputRecord.from_json(d["target"]), OutputRecord.from_json(d["drafter"]),
                   DrafterVerdict(bool(verdict.get("servable")), int(verdict.get("errors", 0)),
                                  int(verdict.get("warnings", 0))))


@dataclass(frozen=True)
class Outputs:
    """The outputs of a finished run: the target, the drafter served, every drafter of a run of several, the
    target's projector (mmproj) when it has vision or audio towers, and every quant tag of a run of several."""

    target: OutputRecord
    drafter: OutputRecord
    several: tuple[OutputRecord, ...] | None = None  # None: a run of one drafter
    projector: OutputRecord | None = None
    imatrix: OutputRecord | None = None  # the importance matrix the target was quantized with (--imatrix)
    tags: tuple[TagRecord, ...] | None = None  # None: a run of one tag; else every tag, the first ``target``'s

    @property
    def drafters(self) -> tuple[OutputRecord, ...]:
        return self.several if self.several is not None else (self.drafter,)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target.to_json(), "drafter": self.drafter.to_json()}
        if self.several is not None:
            out["drafters"] = [d.to_json() for d in self.several]
        if self.projector is not None:
            out["projector"] = self.projector.to_json()
        if self.imatrix is not None:
            out["imatrix"] = self.imatrix.to_json()
        if self.tags is not None:
            out["tags"] = [t.to_json() for t in self.tags]
        return out

    @classmethod
    def from_json(cls, d: Any) -> Outputs:
        """Raises KeyError/TypeError when ``d`` does not name a target and a drafter file."""
        several, projector, imatrix, tags = d.get("drafters"), d.get("projector"), d.get("imatrix"), d.get("tags")
        return cls(OutputRecord.from_json(d["target"]), OutputRecord.from_json(d["drafter"]),
                   tuple(OutputRecord.from_json(x) for x in several) if isinstance(several, list) else None,
                   OutputRecord.from_json(projector) if isinstance(projector, dict) else None,
                   OutputRecord.from_json(imatrix) if isinstance(imatrix, dict) else None,
                   tuple(TagRecord.from_json(x) for x in tags) if isinstance(tags, list) else None)


@dataclass(frozen=True)
class ServePlan:
    """How to serve the pair: the command for the method measured fastest (or the untuned default), the
    ``models.ini`` options, the ``--models-dir`` and ``-hf`` forms, and why (pair.json's ``serve``)."""

    command: tuple[str, ...]
    shell: str
    method: str = DEFAULT_FAMILY.spec_type  # what drafts: tune's method name ("target alone", "ngram-mod", ...)
    n_max: int | None = None
    p_min: float | None = None
    spec_type: str | None = None
    measured: bool = False
    uses_drafter: bool = True  # False: the drafter file is not part of what is served
    note: str = ""
    with_drafter: str | None = None  # the drafter's own best command, when another method is served
    preset: dict[str, str] = field(default_factory=dict)  # models.ini keys
    models_dir: str | None = None
    models_preset: str | None = None
    model: str | None = None  # the model name --models-dir serves the folder as
    hub: str | None = None

    # The options whose value is a file or folder: named relative to the pair's folder (the commands run there).
    FILE_OPTIONS = ("-m", "--model-draft", "--mmproj", "--models-dir", "--models-preset")

    def command_in(self, folder: Path) -> list[str]:
        """The command with the folder's files as absolute paths: runnable from anywhere on this machine."""
        return _absolute_files(list(self.command), folder)

    def models_dir_in(self, folder: Path) -> str:
        """The ``--models-dir`` form with absolute paths (what to run from anywhere on this machine)."""
        return shlex.join(_absolute_files(shlex.split(self.models_dir or ""), folder))

    def to_json(self) -> dict[str, Any]:
        return {"command": list(self.command), "shell": self.shell, "method": self.method, "n_max": self.n_max,
                "p_min": self.p_min, "spec_type": self.spec_type, "measured": self.measured,
                "uses_drafter": self.uses_drafter, "note": self.note, "with_drafter": self.with_drafter,
                "preset": dict(self.preset), "models_dir": self.models_dir, "models_preset": self.models_preset,
                "model": self.model, "hub": self.hub}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServePlan:
        """Any version's ``serve`` (files from before the measured serve plan lack the later keys)."""
        uses = bool(d.get("uses_drafter", True))
        p_min = d.get("p_min")
        preset = d.get("preset")
        return cls(tuple(str(a) for a in d.get("command") or ()), str(d.get("shell", "")),
                   str(d.get("method") or (DEFAULT_FAMILY.spec_type if uses else "target alone")),
                   _opt_int(d.get("n_max")),
                   float(p_min) if isinstance(p_min, int | float) and not isinstance(p_min, bool) else None,
                   _opt_str(d.get("spec_type")), bool(d.get("measured")), uses, str(d.get("note", "")),
                   _opt_str(d.get("with_drafter")),
                   {str(k): str(v) for k, v in preset.items()} if isinstance(preset, dict) else {},
                   _opt_str(d.get("models_dir")), _opt_str(d.get("models_preset")), _opt_str(d.get("model")),
                   _opt_str(d.get("hub")))


def _absolute_files(args: list[str], folder: Path) -> list[str]:
    """``args`` with the value of each file option (ServePlan.FILE_OPTIONS) made absolute against ``folder``."""
    folder = Path(folder).absolute()
    return [os.path.normpath(folder / a) if i and args[i - 1] in ServePlan.FILE_OPTIONS else a
            for i, a in enumerate(args)]


@dataclass(frozen=True)
class SourceRecord:
    """A pipeline input as pair.json records it: the spec given, and the repo at its commit or the local folder
    (by its name only: pair.json may be published), with the licenses its card states (None: not recorded)."""

    spec: str
    repo: str | None = None
    commit: str | None = None
    path: str | None = None
    license: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": self.spec, "repo": self.repo, "commit": self.commit, "path": self.path}
        return out | ({"license": list(self.license)} if self.license is not None else {})

    @classmethod
    def from_json(cls, d: Any) -> SourceRecord:
        d = d if isinstance(d, dict) else {}
        lic = d.get("license")
        return cls(str(d.get("spec") or ""), _opt_str(d.get("repo")), _opt_str(d.get("commit")),
                   _opt_str(d.get("path")), tuple(str(x) for x in lic) if isinstance(lic, list) else None)


@dataclass(frozen=True)
class Sources:
    """Where the run's inputs came from: the target, the drafter (each drafter of a run of several), and the
    existing target GGUF given with --target-gguf."""

    target: SourceRecord
    drafter: SourceRecord
    several: tuple[SourceRecord, ...] | None = None
    target_gguf: SourceRecord | None = None

    @property
    def drafters(self) -> tuple[SourceRecord, ...]:
        return self.several if self.several is not None else (self.drafter,)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target.to_json(), "drafter": self.drafter.to_json()}
        if self.several is not None:
            out["drafters"] = [d.to_json() for d in self.several]
        if self.target_gguf is not None:
            out["target_gguf"] = self.target_gguf.to_json()
        return out

    @classmethod
    def from_json(cls, d: Any) -> Sources:
        d = d if isinstance(d, dict) else {}
        several = d.get("drafters")
        return cls(SourceRecord.from_json(d.get("target")), SourceRecord.from_json(d.get("drafter")),
                   tuple(SourceRecord.from_json(x) for x in several) if isinstance(several, list) else None,
                   SourceRecord.from_json(d["target_gguf"]) if isinstance(d.get("target_gguf"), dict) else None)


@dataclass(frozen=True)
class RecipeRecord:
    """A named recipe tag (``--recipe NAME=BASE_TYPE:FILE``): its tag, base type, the file's name and its rules in the
    order they apply (``PATTERN=TYPE``, as llama-quantize's --tensor-type takes them)."""

    name: str
    type: str
    file: str
    rules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "file": self.file, "rules": list(self.rules)}

    @classmethod
    def from_json(cls, d: Any) -> RecipeRecord:
        d = d if isinstance(d, dict) else {}
        rules = d.get("rules")
        return cls(str(d.get("name") or ""), str(d.get("type") or ""), str(d.get("file") or ""),
                   tuple(map(str, rules)) if isinstance(rules, list) else ())


@dataclass(frozen=True)
class RunOptions:
    """The options a run was made with, and how it made the two GGUFs (pair.json's ``options``)."""

    quant: str
    draft_quant: str
    target_method: str  # TargetMethod.kind: builtin, llama-cpp, gguf
    drafter_method: str  # builtin or llama-cpp
    target_gguf: str | None = None
    llama_cpp: str | None = None
    keep_intermediate: bool = False
    allow_derived_target: bool = False
    drop_mtp: bool = False
    tags: tuple[str, ...] | None = None  # a run of several quant tags: every tag (``quant`` is the first)
    draft_quants: tuple[str, ...] | None = None  # ... and the drafter's type served with each
    # the target's llama-quantize flags beside its type (--pure, --token-embedding-type, each --tensor-type rule in
    # the order it applies), every tag's; empty: the file type's own rules
    quantize_flags: tuple[str, ...] = ()
    recipes: tuple[RecipeRecord, ...] = ()  # the named recipe tags among ``tags``, each with its own rules

    def to_json(self) -> dict[str, Any]:
        several: dict[str, Any] = {"tags": list(self.tags), "draft_quants": list(self.draft_quants or ())} \
            if self.tags else {}
        several |= {"quantize_flags": list(self.quantize_flags)} if self.quantize_flags else {}
        several |= {"recipes": [r.to_json() for r in self.recipes]} if self.recipes else {}
        return {"quant": self.quant, "draft_quant": self.draft_quant, "target_method": self.target_method,
                "drafter_method": self.drafter_method, "target_gguf": self.target_gguf, "llama_cpp": self.llama_cpp,
                "keep_intermediate": self.keep_intermediate, "allow_derived_target": self.allow_derived_target,
                "drop_mtp": self.drop_mtp, **several}

    @classmethod
    def from_json(cls, d: Any) -> RunOptions:
        """Any version's options (keys added later default as the runs before them behaved)."""
        d = d if isinstance(d, dict) else {}
        return cls(str(d.get("quant") or "q4_0"), str(d.get("draft_quant") or "q8_0"),
                   str(d.get("target_method") or "builtin"), str(d.get("drafter_method") or "builtin"),
                   _opt_str(d.get("target_gguf")), _opt_str(d.get("llama_cpp")), bool(d.get("keep_intermediate")),
                   bool(d.get("allow_derived_target")), bool(d.get("drop_mtp")),
                   tuple(map(str, d["tags"])) if isinstance(d.get("tags"), list) else None,
                   tuple(map(str, d["draft_quants"])) if isinstance(d.get("draft_quants"), list) else None,
                   tuple(map(str, d["quantize_flags"])) if isinstance(d.get("quantize_flags"), list) else (),
                   tuple(map(RecipeRecord.from_json, d["recipes"])) if isinstance(d.get("recipes"), list) else ())


@dataclass(frozen=True)
class ToolVersions:
    """What made the files: pair.json's ``tools`` (``llama_cpp_converter`` only when llama.cpp's converter ran)."""

    dflash_gguf: str
    gguf: str
    huggingface_hub: str
    llama_cpp_build: str
    python: str
    quantizer: str
    llama_cpp_converter: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _drop_none(asdict(self))

    @classmethod
    def from_json(cls, d: Any) -> ToolVersions:
        """Any version's record (a field it lacks reads as "?")."""
        d = d if isinstance(d, dict) else {}
        def text(key: str) -> str:
            return str(d.get(key, "?"))

        return cls(text("dflash_gguf"), text("gguf"), text("huggingface_hub"), text("llama_cpp_build"),
                   text("python"), text("quantizer"), _opt_str(d.get("llama_cpp_converter")))


class Manifest:
    """The manifest of one output folder: typed outputs, serve plan and stage records (what resume reads), and
    the run's other sections (sources, options, precheck, tokenizer, tools, verify, tuning) as written."""

    def __init__(self, outdir: Path, data: dict[str, Any] | None = None) -> None:
        self.outdir = Path(outdir)
        data = dict(data or {"format": FORMAT, "status": "in-progress"})
        stages = data.pop("stages", None)
        outputs = data.pop("outputs", None)
        serve = data.pop("serve", None)
        sources, options = data.pop("sources", None), data.pop("options", None)
        self.data: dict[str, Any] = data
        self.sources: Sources | None = Sources.from_json(sources) if isinstance(sources, dict) else None
        self.options: RunOptions | None = RunOptions.from_json(options) if isinstance(options, dict) else None
        self.stages: dict[str, StageRecord] = {
            name: rec for name, raw in (stages.items() if isinstance(stages, dict) else ())
            if (rec := StageRecord.from_json(raw)) is not None}
        try:
            self.outputs: Outputs | None = Outputs.from_json(outputs) if isinstance(outputs, dict) else None
        except (KeyError, TypeError, ValueError, AttributeError):
            self.outputs = None  # an unfinished or unreadable record: the run makes them again
        self.serve: ServePlan | None = ServePlan.from_json(serve) if isinstance(serve, dict) else None

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
        return cls(outdir, data)

    def to_json(self) -> dict[str, Any]:
        """The document pair.json holds, the parts a reader wants first."""
        typed = {"sources": self.sources.to_json() if self.sources else None,
                 "options": self.options.to_json() if self.options else None,
                 "outputs": self.outputs.to_json() if self.outputs else None,
                 "serve": self.serve.to_json() if self.serve else None,
                 "stages": {name: rec.to_json() for name, rec in self.stages.items()}}
        doc = self.data | {k: v for k, v in typed.items() if v is not None}
        return {k: doc[k] for k in _ORDER if k in doc} | doc

    def save(self) -> None:
        """Write pair.json atomically."""
        with atomic_output(self.path) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n", encoding="utf-8")

    def reusable(self, stage: str, key: dict[str, Any], outputs: list[Path]) -> bool:
        """True when ``stage`` ran with this ``key`` and each of ``outputs`` is still the file it wrote."""
        rec = self.stages.get(stage)
        if rec is None or rec.key != json.loads(json.dumps(key, default=str)):
            return False
        files = {f.file: f for f in rec.outputs}
        for out in outputs:
            want = files.get(self.name_of(out))
            if want is None or not out.is_file() or out.stat().st_size != want.size:
                return False
            if sha256_file(out) != want.sha256:
                log.info("%s changed since it was written; %s runs again", out, stage)
                return False
        log.info("%s: up to date, skipped", stage)
        return True

    def record(self, stage: str, key: dict[str, Any], outputs: list[Path], *,
               hashes: dict[Path, str | None] | None = None, quantizer: str | None = None,
               quantizer_version: str | None = None) -> StageRecord:
        """Note that ``stage`` made ``outputs`` from ``key``, and save the manifest. ``hashes``: the sha256 of
        outputs whose writer hashed them while writing; the others are read to hash them."""
        files = tuple(file_record(p, (hashes or {}).get(p), self.name_of(p)) for p in outputs)
        rec = StageRecord(json.loads(json.dumps(key, default=str)), files, quantizer, quantizer_version)
        self.stages[stage] = rec
        self.save()
        return rec

    def record_of(self) -> PairRecord:
        """The typed view of this manifest as it stands (its run finished: outputs recorded)."""
        return _pair_record(self.path, self.to_json())


@dataclass(frozen=True)
class PairRecord:
    """What a reader of pair.json needs, typed: the outputs, how the target was made, how to serve them."""

    path: Path
    status: str
    outputs: Outputs
    target_method: str | None = None
    serve: ServePlan | None = None
    sources: Sources | None = None
    tools: ToolVersions | None = None
    tuning: Mapping[str, Any] | None = None  # tune's report as written (``status``: measured, skipped, ...)
    tag_tuning: Mapping[str, Any] | None = None  # tune --tags: each tag's speed with its drafter, the fastest
    quality: Mapping[str, Any] | None = None  # dflash-gguf quality: each tag's KL divergence from the 16-bit target
    quantize_flags: tuple[str, ...] = ()  # the target's llama-quantize flags (RunOptions.quantize_flags)
    recipes: tuple[RecipeRecord, ...] = ()  # the named recipe tags (RunOptions.recipes)

    @property
    def target(self) -> OutputRecord:
        return self.outputs.target

    @property
    def drafter(self) -> OutputRecord:
        """The drafter served (for a run of several: linked beside the target)."""
        return self.outputs.drafter

    @property
    def drafters(self) -> tuple[OutputRecord, ...]:
        """Every drafter the run made (just ``drafter`` for one)."""
        return self.outputs.drafters

    @property
    def folder(self) -> Path:
        return self.path.parent

    def file(self, side: str) -> Path:
        return self.folder / (self.target if side == "target" else self.drafter).file

    @property
    def projector(self) -> OutputRecord | None:
        """The target's projector (mmproj), when the run made one."""
        return self.outputs.projector

    @property
    def imatrix(self) -> OutputRecord | None:
        """The importance matrix the target was quantized with, when one was given."""
        return self.outputs.imatrix

    @property
    def tags(self) -> tuple[TagRecord, ...]:
        """Every quant tag of a run of several (the first is ``target``'s); empty for a run of one."""
        return self.outputs.tags or ()

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
    try:
        typed = Outputs.from_json(outputs)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InputError(f"{path}: its 'outputs' do not name a target and a drafter file (the run did not finish). "
                         "Re-run dflash-convert with the same options to complete it.") from None
    named: list[tuple[str, OutputRecord | FileRecord]] = [("outputs.target.file", typed.target),
                                                          ("outputs.drafter.file", typed.drafter)]
    named += [(f"outputs.drafters[{i}].file", rec) for i, rec in enumerate(typed.several or ())]
    named += [("outputs.projector.file", typed.projector)] if typed.projector is not None else []
    named += [("outputs.imatrix.file", typed.imatrix)] if typed.imatrix is not None else []
    named += [(f"outputs.target.shards[{i}].file", shard) for i, shard in enumerate(typed.target.shards or ())]
    for i, tag in enumerate(typed.tags or ()):
        named += [(f"outputs.tags[{i}].target.file", tag.target), (f"outputs.tags[{i}].drafter.file", tag.drafter)]
        named += [(f"outputs.tags[{i}].target.shards[{k}].file", shard)
                  for k, shard in enumerate(tag.target.shards or ())]
    for field_name, rec in named:
        if (problem := name_problem(rec.file)) is not None:
            raise InputError(f"{path}: {field_name} is {problem}. Every file pair.json names lies in its own folder "
                             "(or drafters/ inside it); re-run dflash-convert to write a new pair.json rather than "
                             "editing it.")
    serve, options, sources, tools, tuning, tag_tuning, quality = (
        data.get(k) for k in ("serve", "options", "sources", "tools", "tuning", "tag_tuning", "quality"))
    run_options = RunOptions.from_json(options) if isinstance(options, dict) else None
    return PairRecord(Path(path), str(data.get("status", "")), typed,
                      run_options.target_method if run_options is not None else None,
                      ServePlan.from_json(serve) if isinstance(serve, dict) else None,
                      Sources.from_json(sources) if isinstance(sources, dict) else None,
                      ToolVersions.from_json(tools) if isinstance(tools, dict) else None,
                      tuning if isinstance(tuning, dict) else None,
                      tag_tuning if isinstance(tag_tuning, dict) else None,
                      quality if isinstance(quality, dict) else None,
                      run_options.quantize_flags if run_options is not None else (),
                      run_options.recipes if run_options is not None else ())


def _present(manifest: Path, what: str, name: str) -> Path:
    """A file pair.json names beside it (its names were checked when it was read).

    Raises:
        InputError: it is not there.
    """
    found = inside(Path(manifest).parent, name)
    if found is None or not found.is_file():
        raise InputError(f"{manifest} names {what} {name}, which is not in {Path(manifest).parent}. Keep pair.json "
                         "beside the files it names, or re-run dflash-convert to make them again.")
    return found


def judge_tag(report: Report, tag: str, drafter: Path, target: Path, *, allow_derived_target: bool = False
              ) -> DrafterVerdict:
    """verify's verdict on one quant tag of a run of several (its target with the drafter served beside it), added to
    ``report`` as ``pair.tags.TAG``."""
    pair = verify_files(drafter, target, allow_derived_target=allow_derived_target)
    what = f"the {tag} tag ({target.name} with {drafter.name})"
    if pair.errors:
        report.fail(f"pair.tags.{tag}", "error", f"{what} cannot be served: "
                    + " ".join(f"[{r.id}] {r.message}" for r in pair.errors),
                    f"'dflash-verify {drafter} {target}' prints its full report.")
    else:
        report.ok(f"pair.tags.{tag}", f"{what} can be served ({len(pair.results)} checks, {len(pair.warnings)} "
                  "warnings)")
    return DrafterVerdict(not pair.errors, len(pair.errors), len(pair.warnings))


def verify_manifest(path: Path, *, allow_derived_target: bool = False) -> Report:
    """``dflash-verify pair.json``: the files it names, unchanged since they were written, judged as a pair (and,
    for a run of several drafters, every other drafter judged with the target too).

    Raises:
        InputError: the manifest or a GGUF cannot be read.
    """
    record = read_manifest(path)
    folder = record.folder
    files = {side: record.file(side) for side in ("drafter", "target")}
    others = {f: d for d in record.drafters if (f := folder / d.file).name != files["drafter"].name}
    for side, f in [*files.items(), *(("drafter", f) for f in others)]:
        if not f.is_file():
            raise InputError(f"{path} names the {side} {f.name}, which is not in {f.parent}. Keep pair.json beside "
                             "the GGUF files it names, or re-run dflash-convert to make them again.")
    report = verify_files(files["drafter"], files["target"], allow_derived_target=allow_derived_target)
    checked: list[tuple[str, Path, OutputRecord | FileRecord]] = [
        (f"manifest.{side}", f, record.target if side == "target" else record.drafter) for side, f in files.items()]
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
    if record.projector is not None:
        projector = _present(path, "the projector", record.projector.file)
        report.extend(check_projector(read_gguf(projector), read_gguf(files["target"])))
        checked.append(("manifest.projector", projector, record.projector))
    checked += [(f"manifest.target.{shard.file}", _present(path, "the target's shard", shard.file), shard)
                for shard in record.target.shards or ()]  # a split target: every shard as recorded
    if record.imatrix is not None:
        checked.append(("manifest.imatrix", _present(path, "the importance matrix", record.imatrix.file),
                        record.imatrix))
    for tag in record.tags:  # a run of several tags: each tag's target with its drafter, as -hf REPO:TAG serves them
        if tag.target.file == record.target.file:
            continue
        target = _present(path, f"the {tag.tag} target", tag.target.file)
        drafter = _present(path, f"the {tag.tag} drafter", tag.drafter.file)
        judge_tag(report, tag.tag, drafter, target, allow_derived_target=allow_derived_target)
        names = {f.name for _, f, _ in checked}
        recs: list[OutputRecord | FileRecord] = [tag.target, *(tag.target.shards or ()), tag.drafter]
        checked += [(f"manifest.tags.{tag.tag}.{rec.file}", _present(path, f"the {tag.tag} tag's file", rec.file),
                     rec) for rec in recs if Path(rec.file).name not in names]
    for check_id, f, want in checked:
        if f.stat().st_size == want.size and sha256_file(f) == want.sha256:
            report.ok(check_id, f"{f.name}: size and sha256 as recorded in {Path(path).name}")
        else:
            report.fail(check_id, "error", f"{f.name} is not the file {Path(path).name} recorded (size or "
                        "sha256 differ): it was changed or replaced after the pair was made.",
                        "Re-run dflash-convert with the same options to make it again.")
    return report
