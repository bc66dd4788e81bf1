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
import logging
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
    read_manifest,
    sha256_file,
    verify_manifest,
)
from ..pipeline.naming import encoding_tag
from ..sidecar import PRESET_NAME
from ..tune.plot import PLOT_NAME, QUALITY_PLOT_NAME, TAGS_PLOT_NAME
from . import privacy
from .card import render_card, sources_of, target_on_hub
from .files import UploadFile

log = logging.getLogger(__name__)


# The Hub's per-file size: it recommends under 50 GB a file (and refuses above 200 GB); publish keeps to the former
# unless --max-file-size says otherwise.
HUB_FILE_LIMIT = 50 * 1000 ** 3


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
    hub_target = target_on_hub(record)
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
    for side, src in sources_of(record):
        found[f"{side} {src.repo or src.path}"] = list(src.license) if src.license is not None else \
            str_list(front_matter(_source_card(src)).get("license"))  # a pair.json from before licenses were recorded
    licenses = {tuple(v) for v in found.values()}
    if len(licenses) == 1 and (only := next(iter(licenses))) and len(only) == 1:
        return only[0]
    stated = "; ".join(f"{k}: {', '.join(v) or 'none stated'}" for k, v in found.items())
    raise PublishRefused(f"The card needs one license and the sources' cards do not agree on one ({stated}). "
                         "Read their licenses and pass the one that covers the files as --license ID (e.g. "
                         "--license gemma, --license apache-2.0, --license other).")


def _source_card(src: SourceRecord) -> str | None:
    """A source's README.md: the local folder's, or the repo's at the recorded commit (fetched like its config)."""
    if src.repo:
        spec = f"{src.repo}@{src.commit}" if src.commit else src.repo
        return read_card(hub.resolve(spec, (CARD,), progress=False).path)
    return read_card(Path(src.path)) if src.path else None
