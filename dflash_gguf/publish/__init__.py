"""``dflash-gguf publish``: an output folder on the Hub, laid out the way llama.cpp's ``-hf`` reads a repo, with a
model card written from its pair.json.

Why checks come first: a repo that aborts at load or drafts nothing costs every person who downloads it, so a
pair verify refuses is not published (unless asked, and then the card says so), and every GGUF must still be the
file pair.json recorded. Why the card is generated: the drafter repos that go wrong on the Hub are the ones whose
card does not say the drafter is no standalone model, which target it belongs to, which llama.cpp build it
matches, or how the speed it claims was measured.

The layout is the folder's own (llama.cpp's): the target and the served sidecar at the root, where ``-hf`` finds
them (``find_best_dflash`` and its siblings match the ``dflash-``/``dspark-``/``mtp-``/``eagle3-`` prefixes), the
other drafters of a run of several in ``drafters/`` when asked for, ``models.ini`` and ``pair.json`` beside them.
Nothing is named ``preset.ini`` (which would switch ``-hf`` to router mode).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__, hub
from ..drafters import family_of_gguf
from ..drafters.findings import Report
from ..errors import FileTooLargeRefused, PrivateDataRefused, PublishRefused
from ..ggufio.reader import read_gguf, split_siblings
from ..model_card import CARD, front_matter, read_card, str_list
from ..pipeline.manifest import (
    MANIFEST_NAME,
    PairRecord,
    SourceRecord,
    Sources,
    ToolVersions,
    read_manifest,
    sha256_file,
    verify_manifest,
)
from ..pipeline.naming import encoding_tag
from ..sidecar import PRESET_NAME
from ..tune import TagSpeed
from ..tune.plot import PLOT_NAME, QUALITY_PLOT_NAME, TAGS_PLOT_NAME
from . import privacy

log = logging.getLogger(__name__)


# The Hub's per-file size: it recommends under 50 GB a file (and refuses above 200 GB); publish keeps to the former
# unless --max-file-size says otherwise.
HUB_FILE_LIMIT = 50 * 1000 ** 3


@dataclass(frozen=True)
class UploadFile:
    """One file of the repo: where it comes from, its size and sha256, and what it is (for the card)."""

    path_in_repo: str
    local: Path | None  # None: generated (the card)
    size: int
    sha256: str
    role: str
    kind: str | None = None  # a drafter's sidecar kind (its family's), the card's tag for it

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path_in_repo, "local": str(self.local) if self.local else None, "size": self.size,
                "sha256": self.sha256, "role": self.role, "kind": self.kind}


@dataclass(frozen=True)
class PublishPlan:
    """What ``publish`` would put where, and the card; nothing has touched the Hub yet."""

    folder: Path
    repo_id: str
    revision: str
    private: bool
    files: tuple[UploadFile, ...]
    card: str
    license: str
    report: Report
    verified: bool
    drafter_only: bool = False  # the target is not uploaded: the repo is served beside another's with -hfd

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "repo": self.repo_id, "revision": self.revision, "private": self.private,
                "license": self.license, "verified": self.verified, "drafter_only": self.drafter_only,
                "files": [f.to_dict() for f in self.files], "card": self.card}


@dataclass(frozen=True)
class PublishResult:
    """What went up: the files sent, the files the repo already held unchanged, and the commit made (None: none
    was needed)."""

    plan: PublishPlan
    uploaded: tuple[str, ...]
    unchanged: tuple[str, ...]
    commit: str | None

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), "uploaded": list(self.uploaded), "unchanged": list(self.unchanged),
                "commit": self.commit}


def plan_publish(folder: Path, repo_id: str, *, revision: str = "main", private: bool = False,
                 all_drafters: bool = False, license: str | None = None,
                 allow_unverified: bool = False, drafter_only: bool | None = None,
                 max_file_size: int = HUB_FILE_LIMIT) -> PublishPlan:
    """The files, the card and the checks of publishing ``folder`` (an output folder, or its pair.json) as
    ``repo_id``. ``drafter_only`` (None: when the target is a Hub GGUF someone else publishes, given with
    --target-gguf REPO:FILE) leaves the target out: the repo holds the drafter, served beside that target with -hfd.

    Raises:
        InputError: the folder has no readable pair.json, or a file it names is missing.
        PublishRefused: verify refuses the pair (without ``allow_unverified``), a GGUF is not the file pair.json
            recorded, the repo id is malformed, or the sources' licenses are absent or differ (without ``license``).
        PrivateDataRefused: a file to upload carries a path, the user name or the host name of this machine.
        FileTooLargeRefused: a file is above ``max_file_size`` (names --split-max-size).
    """
    if not hub.is_repo_id(repo_id) or "@" in repo_id:
        raise PublishRefused(f"{repo_id!r} is not a repo id: publish takes USER/NAME (or ORG/NAME), and the branch "
                             "as --revision.")
    manifest = Path(folder) / MANIFEST_NAME if Path(folder).is_dir() else Path(folder)
    record = read_manifest(manifest)
    report = verify_manifest(manifest)
    changed = [r for r in report.errors if r.id.startswith("manifest.")]
    if changed:
        raise PublishRefused(f"{manifest}: " + " ".join(r.message for r in changed) + " Publishing would put up "
                             "files nobody verified; re-run dflash-convert with the same options, then publish.")
    if report.errors and not allow_unverified:
        listed = "; ".join(f"[{r.id}] {r.message}" for r in report.errors[:3])
        raise PublishRefused(f"verify refuses the pair in {record.folder}: {listed}. A pair that cannot be served is "
                             "not published; fix it (the messages say how), or pass --allow-unverified to publish it "
                             "anyway with the refusal stated on the card.")
    chosen_license = license or _license_of_sources(record)
    hub_target = _hub_target(record)
    only_drafter = hub_target is not None if drafter_only is None else drafter_only
    files = _files(record, all_drafters, only_drafter)
    card = render_card(record, repo_id, chosen_license, files, report, drafter_only=only_drafter)
    card_bytes = card.encode("utf-8")
    files.append(UploadFile(CARD, None, len(card_bytes), hashlib.sha256(card_bytes).hexdigest(), "model card"))
    _refuse_private(files, card_bytes)
    _refuse_oversized(files, max_file_size)
    return PublishPlan(record.folder, repo_id, revision, private, tuple(files), card, chosen_license, report,
                       not report.errors, only_drafter)


def _refuse_private(files: list[UploadFile], card: bytes) -> None:
    """Refused, before anything is uploaded, when a file carries a path, user or host name of this machine."""
    found = privacy.traces((f.path_in_repo, f.local if f.local is not None else card) for f in files)
    if found:
        listed = "; ".join(map(str, found[:3])) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise PrivateDataRefused(
            f"Nothing was uploaded: {len(found)} string(s) of this machine would go public: {listed}. Files this "
            "version writes name local sources by their folder name and outputs by their names; re-run dflash-convert "
            "with the same options to rewrite pair.json and models.ini (GGUFs whose provenance names a path are made "
            "again). A GGUF from llama.cpp's tools carries what it was given: re-make it passing files by name from "
            "their folder (llama-quantize records --imatrix, llama-imatrix the text file, as given).")


def _hub_target(record: PairRecord) -> SourceRecord | None:
    """The target GGUF given as REPO:FILE from the Hub (someone else's repo), or None."""
    given = record.sources.target_gguf if record.sources is not None else None
    return given if given is not None and given.repo else None


def publish(plan: PublishPlan) -> PublishResult:
    """Create the repo when missing, then commit the files whose content the repo does not hold yet (none: no
    commit). Large files go up through LFS, which the Hub resumes and deduplicates.

    Raises:
        RepoAccessError, RepoNotFoundError, UploadError: the Hub refused or could not be reached.
    """
    hub.create_repo(plan.repo_id, private=plan.private, revision=plan.revision)
    remote = hub.remote_files(plan.repo_id, plan.revision, [f.path_in_repo for f in plan.files])
    to_send = [f for f in plan.files if not _same(f, remote.get(f.path_in_repo), plan.card)]
    unchanged = tuple(f.path_in_repo for f in plan.files if f not in to_send)
    if not to_send:
        log.info("%s already holds every file unchanged: nothing uploaded", plan.repo_id)
        return PublishResult(plan, (), unchanged, None)
    contents = [(f.path_in_repo, f.local if f.local is not None else plan.card.encode("utf-8")) for f in to_send]
    commit = hub.commit_files(plan.repo_id, plan.revision, contents,
                              f"dflash-gguf {__version__}: {len(to_send)} file(s) from {plan.folder.name}")
    return PublishResult(plan, tuple(f.path_in_repo for f in to_send), unchanged, commit)


def _same(f: UploadFile, there: hub.RemoteFile | None, card: str) -> bool:
    """Whether the repo holds this content already (by sha256 for an LFS file, else by git blob id)."""
    if there is None or there.size != f.size:
        return False
    if there.sha256 is not None:
        return there.sha256 == f.sha256
    data = f.local.read_bytes() if f.local is not None else card.encode("utf-8")
    return there.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _files(record: PairRecord, all_drafters: bool, drafter_only: bool = False) -> list[UploadFile]:
    """The folder's files in llama.cpp's layout; GGUF hashes as pair.json recorded (verify checked them). A
    drafter-only repo holds the drafters, pair.json and the measurement: not the target, its projector, its
    importance matrix, or models.ini (whose model is the target)."""
    out = [] if drafter_only else [
        UploadFile(record.target.file, record.file("target"), record.target.size or 0, record.target.sha256 or "",
                   "target")]
    if not drafter_only:  # a split target: every shard (-hf fetches them by the first's name, get_split_files)
        out += _later_shards(record)
    if (projector := record.projector) is not None and not drafter_only:  # -hf fetches it by the mmproj in its name
        out.append(UploadFile(projector.file, record.folder / projector.file, projector.size or 0,
                              projector.sha256 or "", "vision/audio projector (mmproj), loaded by -hf"))
    if (imatrix := record.imatrix) is not None and not drafter_only:  # -hf skips names containing "imatrix"
        out.append(UploadFile(imatrix.file, record.folder / imatrix.file, imatrix.size or 0, imatrix.sha256 or "",
                              f"importance matrix the target was quantized with: {imatrix.made_by}"))
    served = record.drafter
    names = {record.target.file}
    if "/" not in served.file and (record.serve is None or record.serve.uses_drafter):
        role, kind = _drafter_role(record.file("drafter"))
        with_tag = f", served with the {encoding_tag(record.target.file)} target" if record.tags else ", served"
        out.append(UploadFile(served.file, record.file("drafter"), served.size or 0, served.sha256 or "",
                              f"drafter: {role}{with_tag}", kind))
        names.add(served.file)
    for tag in record.tags:  # a run of several tags: each tag's target and the drafter -hf REPO:TAG pairs with it
        name = encoding_tag(tag.target.file)
        if tag.target.file not in names and not drafter_only:
            out.append(UploadFile(tag.target.file, record.folder / tag.target.file, tag.target.size or 0,
                                  tag.target.sha256 or "", f"target, tag {name}"))
            n = len(tag.target.shards or ()) + 1
            out += [UploadFile(s.file, record.folder / s.file, s.size or 0, s.sha256 or "",
                               f"target, tag {name}, shard {k} of {n}")
                    for k, s in enumerate(tag.target.shards or (), start=2)]
            names.add(tag.target.file)
        if tag.drafter.file not in names and (record.serve is None or record.serve.uses_drafter):
            role, kind = _drafter_role(record.folder / tag.drafter.file)
            out.append(UploadFile(tag.drafter.file, record.folder / tag.drafter.file, tag.drafter.size or 0,
                                  tag.drafter.sha256 or "", f"drafter: {role}, served with the {name} target", kind))
            names.add(tag.drafter.file)
    if all_drafters:
        for d, path in zip(record.drafters, record.drafter_files(), strict=True):
            if d.file not in names:
                role, kind = _drafter_role(path)
                out.append(UploadFile(d.file, path, d.size or 0, d.sha256 or "", f"drafter: {role}", kind))
                names.add(d.file)
    for name, role in ((PRESET_NAME, "llama.cpp --models-dir preset"), (MANIFEST_NAME, "dflash-gguf pair manifest"),
                       (PLOT_NAME, "tune's measurement, drawn"),
                       (TAGS_PLOT_NAME, "each tag's speed against its drift, drawn"),
                       (QUALITY_PLOT_NAME, "each tag's drift against its size, drawn")):
        if drafter_only and name == PRESET_NAME:
            continue
        path = record.folder / name
        if path.is_file():
            out.append(UploadFile(name, path, path.stat().st_size, sha256_file(path), role))
    return out


def _later_shards(record: PairRecord) -> list[UploadFile]:
    """The target's shards after its first: as pair.json recorded them (verify checked them), or, for a split
    target linked in with --target-gguf, found beside it by llama.cpp's names and hashed."""
    if record.target.shards:
        n = len(record.target.shards) + 1
        return [UploadFile(s.file, record.folder / s.file, s.size or 0, s.sha256 or "", f"target, shard {k} of {n}")
                for k, s in enumerate(record.target.shards, start=2)]
    shards = split_siblings(record.file("target")) or []
    return [UploadFile(p.name, p, p.stat().st_size, sha256_file(p), f"target, shard {k} of {len(shards)}")
            for k, p in enumerate(shards[1:], start=2)]


def _refuse_oversized(files: list[UploadFile], max_file_size: int) -> None:
    """Refused before anything is uploaded when a file is above the Hub's per-file limit (``max_file_size``)."""
    over = [f for f in files if f.size > max_file_size]
    if over:
        listed = ", ".join(f"{f.path_in_repo} ({f.size / 1e9:,.1f} GB)" for f in over[:3])
        raise FileTooLargeRefused(
            f"Nothing was uploaded: {listed} {'is' if len(over) == 1 else 'are'} above {max_file_size / 1e9:,.1f} GB "
            "a file (--max-file-size; the Hub recommends under 50 GB and takes 200 GB at most). Re-run dflash-convert "
            "with the same options and --split-max-size 48G: the target is then written in shards "
            "(-00001-of-0000N.gguf) that llama.cpp and -hf read together, and only the split is redone.")


def _drafter_role(path: Path) -> tuple[str, str | None]:
    """What a drafter file is, for the card, and its family's sidecar kind (the card's tag)."""
    family = family_of_gguf(read_gguf(path))
    return (f"{family.title} ({family.spec_type})", family.sidecar_kind) if family else ("a drafter", None)


def _license_of_sources(record: PairRecord) -> str:
    """The license every source's card states; refused when one states none or they differ."""
    found: dict[str, list[str]] = {}
    for side, src in _sources(record):
        found[f"{side} {src.repo or src.path}"] = list(src.license) if src.license is not None else \
            str_list(front_matter(_source_card(src)).get("license"))  # a pair.json from before licenses were recorded
    licenses = {tuple(v) for v in found.values()}
    if len(licenses) == 1 and (only := next(iter(licenses))) and len(only) == 1:
        return only[0]
    stated = "; ".join(f"{k}: {', '.join(v) or 'none stated'}" for k, v in found.items())
    raise PublishRefused(f"The card needs one license and the sources' cards do not agree on one ({stated}). "
                         "Read their licenses and pass the one that covers the files as --license ID (e.g. "
                         "--license gemma, --license apache-2.0, --license other).")


def _sources(record: PairRecord) -> Iterable[tuple[str, SourceRecord]]:
    sources = record.sources or Sources.from_json(None)
    yield "target", sources.target
    for d in sources.drafters:
        yield "drafter", d


def _source_card(src: SourceRecord) -> str | None:
    """A source's README.md: the local folder's, or the repo's at the recorded commit (fetched like its config)."""
    if src.repo:
        spec = f"{src.repo}@{src.commit}" if src.commit else src.repo
        return read_card(hub.resolve(spec, (CARD,), progress=False).path)
    return read_card(Path(src.path)) if src.path else None


# ------------------------------------------------------------------------------------------------------ the card


def _hub_command(record: PairRecord, repo_id: str, drafter_only: bool) -> str:
    """The card's ``llama-server`` command: ``-hf`` this repo, or for a drafter-only repo, the target's repo (or
    file) with ``-hfd`` this repo at the drafter's tag."""
    serve = record.serve
    assert serve is not None
    command = serve.hub or ""
    if not drafter_only:
        return command.replace("USER/REPO", repo_id)
    drafter = f"-hfd {repo_id}:{encoding_tag(record.drafter.file)}"
    target = _hub_target(record)
    where = f"-hf {target.repo}:{encoding_tag(str(target.path))}" if target is not None else f"-m {record.target.file}"
    return command.replace("-hf USER/REPO", f"{where} {drafter}")


def render_card(record: PairRecord, repo_id: str, license: str, files: list[UploadFile], report: Report, *,
                drafter_only: bool = False) -> str:
    """README.md for the repo, from pair.json: what is in it, how to run it, how it was made, how it was checked,
    and what was measured (with the hardware, flags and workload), or that nothing was."""
    sources = list(_sources(record))
    bases = [s.repo for _, s in sources if s.repo]
    hub_target = _hub_target(record)
    if hub_target is not None and hub_target.repo not in bases:
        bases.append(str(hub_target.repo))
    kinds = sorted({f.kind for f in files if f.kind})
    tags = ["gguf", "llama.cpp", "speculative-decoding", *kinds]
    head: dict[str, Any] = {"license": license, "library_name": "gguf", "tags": tags}
    if bases:
        head |= {"base_model": bases, "base_model_relation": "quantized"}
    model = record.target.file.removesuffix(".gguf")
    serve = record.serve
    if drafter_only:
        at = (f"[{hub_target.repo}](https://huggingface.co/{hub_target.repo}), file `{hub_target.path}` at commit "
              f"`{hub_target.commit}`" if hub_target is not None else f"`{record.target.file}`")
        lines = ["---", *_yaml(head), "---", "", f"# {record.drafter.file.removesuffix('.gguf')}: a "
                 f"speculative-decoding drafter for {model}", ""]
        lines += [f"A drafter for the target {at}, converted for llama.cpp (b11434 or later) by "
                  f"[dflash-gguf](https://pypi.org/project/dflash-gguf/) {__version__}. This repo holds the drafter "
                  "only: the target is the one named, served from where it is published. The drafter is not a "
                  "standalone model: it only proposes tokens that the target checks, so it is served together with "
                  "that target and no other.", ""]
    else:
        lines = ["---", *_yaml(head), "---", "", f"# {model}: GGUF with its speculative-decoding drafter", ""]
        lines += ["The target model and a drafter for it, converted for llama.cpp (b11434 or later) by "
                  f"[dflash-gguf](https://pypi.org/project/dflash-gguf/) {__version__}. The drafter is not a "
                  "standalone model: it only proposes tokens that the target checks, so it is served together with "
                  "this target and no other.", ""]
    if not report.errors:
        lines += [f"**Verified:** `dflash-verify pair.json` passes ({len(report.results)} checks, "
                  f"{len(report.warnings)} warnings): file format, the pair (vocabulary, hidden size, taps), lineage.",
                  ""]
    else:
        lines += ["**Not verified:** published with `--allow-unverified`; `dflash-verify pair.json` refuses the "
                  "pair:", *(f"- `{r.id}`: {r.message}" for r in report.errors), ""]
    lines += ["## Files", "", "| file | what | type | size | sha256 |", "|---|---|---|---|---|"]
    types = {record.target.file: record.target.type, **{d.file: d.type for d in record.drafters},
             record.drafter.file: record.drafter.type,
             **({record.projector.file: record.projector.type} if record.projector else {}),
             **{rec.file: rec.type for tag in record.tags for rec in (tag.target, tag.drafter)}}
    for f in files:
        lines.append(f"| `{f.path_in_repo}` | {f.role} | {types.get(f.path_in_repo) or ''} | "
                     f"{f.size / 1e6:,.1f} MB | `{f.sha256}` |")
    lines += ["", "## Run it", ""]
    if serve is not None and drafter_only:
        lines += ["```", _hub_command(record, repo_id, True), "```", "",
                  "`-hfd` (`--spec-draft-hf`) fetches the drafter from this repo; the tag picks its file.", "",
                  f"{serve.note}.", ""]
    elif serve is not None:
        text_only = (["", "The projector (`mmproj-`) lets the model take images (and, for Gemma-4, audio); `-hf` "
                      "loads it by itself. For text only, add `--no-mmproj`."] if record.projector else [])
        lines += ["```", _hub_command(record, repo_id, False), "```", *text_only, "", f"{serve.note}.", ""]
        lines += _tags_table(record, repo_id) if record.tags else [
            "Or download the repo into a folder `MODELS/<name>/` and serve llama.cpp's folder layout with the "
            "preset beside it:", "", "```",
            f"llama-server --models-dir MODELS --models-preset MODELS/<name>/{PRESET_NAME}", "```", ""]
    lines += ["## How it was made", ""]
    for side, s in sources:
        where = f"[{s.repo}](https://huggingface.co/{s.repo}) at commit `{s.commit}`" if s.repo \
            else f"a local folder ({Path(str(s.path)).name})"
        lines.append(f"- {side}: {where}")
    tools = record.tools or ToolVersions.from_json({"dflash_gguf": __version__, "llama_cpp_build": "b11434"})
    lines += [f"- made by dflash-gguf {tools.dflash_gguf} (gguf {tools.gguf}), byte for byte what llama.cpp "
              f"{tools.llama_cpp_build}'s convert_hf_to_gguf.py and llama-quantize write; quantizer: {tools.quantizer}",
              f"- target: {', '.join(t.tag for t in record.tags) if record.tags else record.target.type}, "
              f"{record.target.made_by}",
              *([f"- the target's llama-quantize flags, in the order they apply: `{shlex.join(record.quantize_flags)}`"]
                if record.quantize_flags else []),
              *(f"- tag {r.name}: {r.type.upper()} with the rules of `{r.file}`, in the order they apply: "
                f"`{shlex.join(arg for rule in r.rules for arg in ('--tensor-type', rule))}`" for r in record.recipes),
              f"- drafter: {record.drafter.type}, {record.drafter.made_by}"]
    if record.imatrix is not None and not drafter_only:
        lines.append(f"- the target's importance matrix: `{record.imatrix.file}` (sha256 `{record.imatrix.sha256}`), "
                     f"made by {record.imatrix.made_by}")
    lines.append("")
    lines += _measured(record.tuning, serve is not None and serve.measured)
    lines += _tags_measured(record.tag_tuning)
    lines += _quality(record.quality)
    return "\n".join(lines).rstrip() + "\n"


def _tags_table(record: PairRecord, repo_id: str) -> list[str]:
    """The card's tags: each target with the drafter ``-hf REPO:TAG`` serves beside it (``find_best_sibling`` picks
    the sidecar whose name carries ``-TAG.``), and verify's verdict on the two."""
    lines = ["Every tag is a target with its own drafter: `-hf` picks the target by the tag and the drafter whose name "
             "carries the same tag.", "", "| tag | target | drafter | verify | run |", "|---|---|---|---|---|"]
    for tag in record.tags:
        name = encoding_tag(tag.target.file)
        verdict = "passes" if tag.verdict.servable else f"refuses ({tag.verdict.errors} errors)"
        words = (record.serve.hub or "").split(" ") if record.serve else []
        run = " ".join([*words[:2], f"{repo_id}:{name}", *words[3:]]) if len(words) > 2 else ""
        lines.append(f"| {name} | `{tag.target.file}` ({(tag.target.size or 0) / 1e6:,.1f} MB) | `{tag.drafter.file}` "
                     f"({tag.drafter.type}) | {verdict} | `{run}` |")
    lines += ["", "Or download the repo into a folder and serve every tag from it, as the preset beside them names "
              "them:", "", "```", f"llama-server --models-preset {PRESET_NAME}", "```", ""]
    return lines


def _tags_measured(tag_tuning: Any) -> list[str]:
    """``tune --tags``: each tag's speed with its own drafter, side by side, and what it was measured on."""
    speeds = [s for d in (tag_tuning or {}).get("tags") or () if (s := TagSpeed.from_dict(d)) is not None]
    if not speeds:
        return []
    server, workload = tag_tuning.get("server") or {}, tag_tuning.get("workload") or {}
    lines = ["", "### Each tag with its drafter", "",
             "| tag | target alone (tok/s) | fastest | tok/s | speed-up | drafter acceptance |",
             "|---|---|---|---|---|---|"]
    for s in speeds:
        lines.append(f"| {s.tag} | {s.alone_tps or '-'} | {s.best or '-'} | {s.best_tps or '-'} | "
                     f"{f'{s.speedup:.2f}x' if s.speedup else '-'} | "
                     f"{f'{s.acceptance * 100:.1f}%' if s.acceptance is not None else '-'} |")
    fastest = tag_tuning.get("fastest")
    flags = " ".join(tag_tuning.get("user_flags") or ()) or "none"
    lines += ["", (f"Fastest on the machine measured: **{fastest}**. " if fastest else "")
              + f"Measured by `dflash-gguf tune --tags` with llama-server build {server.get('build') or 'unknown'}, "
              f"{server.get('threads') or 'default'} threads, {workload.get('n_predict', '?')} tokens per prompt, "
              f"{workload.get('repeats', '?')} repeat(s); flags: {flags}. Speed depends on the hardware: measure on "
              "yours.", ""]
    return lines


def _quality(quality: Any) -> list[str]:
    """``dflash-gguf quality``: each tag's KL divergence from the 16-bit target, and what it was measured with."""
    rows = [t for t in (quality or {}).get("tags") or () if isinstance(t, dict)]
    if not rows:
        return []
    s, text = quality.get("settings") or {}, quality.get("text") or {}
    lines = ["", "## Quality", "", f"Each tag against the logits of `{quality.get('base')}` (llama-perplexity "
             "`--kl-divergence`):", "",
             "| tag | size (bytes) | bits per weight | mean KLD | 99% KLD | 99.9% KLD | same top token | PPL ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t.get('tag')} | {t.get('size_bytes')} | {t.get('bits_per_weight')} | {t.get('kld_mean')} | "
              f"{t.get('kld_p99')} | {t.get('kld_p999')} | {t.get('same_top_p')}% | {t.get('ppl_ratio')} |"
              for t in rows]
    lines += ["", f"On `{text.get('name')}` (sha256 `{text.get('sha256')}`), context {s.get('ctx')}, batch "
              f"{s.get('batch')}, {s.get('chunks') or 'all'} chunk(s), {s.get('threads')} threads; "
              f"{quality.get('tool')}; hardware: {quality.get('hardware') or 'not recorded'}."]
    front = [str(t) for t in quality.get("pareto_front") or ()]
    if front:
        lines += ["", f"Least drift for its size (no tag is both smaller and closer): {', '.join(front)}."]
    if quality.get("plot"):
        lines += ["", f"![quality]({QUALITY_PLOT_NAME})"]
    return lines + [""]


def _yaml(data: dict[str, Any]) -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, list):
            out += [f"{key}:", *(f"- {json.dumps(v)}" for v in value)]
        else:
            out.append(f"{key}: {json.dumps(value)}")
    return out


def _measured(tuning: Any, measured: bool) -> list[str]:
    """The tune table with what it was measured with, or the statement that the n-max was not measured."""
    lines = ["## Speed", ""]
    if not measured or not isinstance(tuning, dict) or tuning.get("status") != "measured":
        return lines + ["Not measured: the command above uses the untuned default draft length "
                        "(`--spec-draft-n-max`). `dflash-gguf tune` measures the fastest on your machine; speed-ups "
                        "depend on the hardware.", ""]
    server, workload = tuning.get("server") or {}, tuning.get("workload") or {}
    shape = tuning.get("shape") or {}
    exact = tuning.get("exact_text_check", True)
    check = ("every configuration's text checked against the target alone's" if exact else "text differences from the "
             "target alone's reported: with sampling or several clients the check is not exact")
    lines += [f"Measured by `dflash-gguf tune` with llama-server ({check}):", "",
              f"- served as: {shape.get('sampling') or 'greedy (temperature 0, top_k 1)'}; "
              f"{shape.get('parallel') or 1} client(s) at once"
              + (f"; context {shape['context_per_client']} per client" if shape.get("context_per_client") else ""),
              f"- llama.cpp build: {server.get('build') or '?'}; threads: {server.get('threads') or '?'}; devices: "
              f"{', '.join(server.get('devices') or []) or 'CPU'}",
              f"- system: {server.get('system_info') or '?'}",
              f"- llama-server flags: `{' '.join(tuning.get('user_flags') or []) or '(defaults)'}`",
              f"- workload: {len(workload.get('prompts') or [])} prompts ({', '.join(workload.get('prompts') or [])}), "
              f"{workload.get('n_predict')} tokens each, {workload.get('repeats')} repeats", "",
              "| configuration | tokens/s | speed-up | acceptance |", "|---|---|---|---|"]
    for c in tuning.get("configurations") or []:
        if c.get("status") != "ok":
            continue
        acc = f"{c['acceptance']:.1%}" if isinstance(c.get("acceptance"), float) else ""
        lines.append(f"| {c.get('label')} | {c.get('generation_tokens_per_second')} | "
                     f"{c.get('speedup') or ''} | {acc} |")
    if tuning.get("plot"):
        lines += ["", f"![tune]({PLOT_NAME})"]
    return lines + ["", f"Verdict: {tuning.get('verdict', '')}", ""]
