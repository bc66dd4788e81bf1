"""How the pair is served: the llama-server command, the ``models.ini`` preset, and the measured method.

Untuned, the command uses the drafter at ``tune.DEFAULT_N_MAX`` (clamped to its block) and says it was not
measured; after ``tune`` it serves the fastest configuration measured, whatever drafts: the target alone, its
own MTP head, n-gram drafting, the drafter, or n-gram drafting before it. ``pair.json`` records which.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .. import folder_lock
from ..atomic import atomic_output
from ..drafters import family_of_kind, family_of_spec_type
from ..relpath import inside
from ..sidecar import PRESET_NAME, sidecars_beside
from ..tune import DEFAULT_N_MAX, Configuration, Drafter, TagSpeed, TuneReport, fastest_tag, inspect_drafter
from ..tune.engine import CONTEXT_PER_CLIENT
from .manifest import Manifest, Outputs, PairRecord, ServePlan, TagRecord, read_manifest
from .naming import DRAFTERS_DIR, encoding_tag


def _served_configuration(drafter: Drafter, report: TuneReport | None) -> tuple[Configuration, Configuration, str]:
    """(what to serve, the drafter's own best configuration, why), from the measurement or the untuned default."""
    default = Configuration(drafter, min(DEFAULT_N_MAX, drafter.max_n_max), drafter.required_p_min)
    if report is None or report.best is None:
        return default, default, (f"not measured on this machine: n-max {default.n_max}, the small draft length "
                                  f"users' measurements favour over the block's maximum of {drafter.max_n_max}; "
                                  "'dflash-gguf tune' measures it")
    best = report.best
    mine = [m for m in report.drafting if m.config.drafter is not None and m.config.ngram is None
            and m.config.drafter.path.name == drafter.path.name and report.servable(m)]  # by name: it may move
    own = max(mine, key=lambda m: m.gen_tps or 0.0).config if mine else default
    own = replace(own, drafter=drafter)  # the file as it is named now (it may have moved since it was measured)
    if best.config.alone:
        return best.config, own, (f"measured by tune: the target alone was fastest; the drafter's best was n-max "
                                  f"{own.n_max}")
    served = replace(best.config, drafter=drafter) if best.config.drafter is not None else best.config
    method = f" ({best.config.method})" if best.config.method != best.config.label else ""
    return served, own, (f"measured by tune: {best.config.label}{method} was fastest "
                         f"({report.speedup(best) or 0:.2f}x the target alone)")


def serve_plan(target: Path, drafter: Path, report: TuneReport | None = None,
               projector: Path | None = None, several_tags: bool = False) -> ServePlan:
    """The ``serve`` section of pair.json: the command for the fastest method measured (the target alone, its own
    MTP head, n-gram drafting, the drafter, or n-gram drafting before it), and where it came from. With the
    target's ``projector``, the command loads it (``--mmproj``): llama-server b11434 speculates with one loaded."""
    info = inspect_drafter(drafter)
    served, own, note = _served_configuration(info, report)
    folder = target.absolute().parent
    target_args = ["llama-server", "-m", target.name]
    if projector is not None:
        target_args += ["--mmproj", _in_folder(projector, folder)]
        note += ("; the projector is loaded for image and audio input (-hf and the --models-dir router load the "
                 "mmproj- file by themselves; --no-mmproj serves text only)")
    shape = _shape_flags(report) if report is not None else []  # as measured, said explicitly
    drafted = target_args + _files_in_folder(own.server_args(), folder) + shape
    cmd = target_args + _files_in_folder(served.server_args(), folder) + shape
    # Run in the folder, like the commands above: names, not paths, so pair.json and models.ini can be published.
    # Several tags: the preset names each tag's files (one folder of --models-dir is one model, load_from_models_dir).
    models_dir = ["llama-server", "--models-preset", PRESET_NAME] if several_tags else \
        ["llama-server", "--models-dir", "..", "--models-preset", PRESET_NAME]
    # The folder uploaded to a Hub repo: -hf fetches the dflash- sidecar only when the spec type is given, and
    # reads no preset, so n-max goes on the command line (common/arg.cpp download_dflash / download_dspark). With
    # several tags, the tag picks the target, and the sidecar named -TAG. with it (find_best_model, find_best_sibling).
    repo = f"USER/REPO:{encoding_tag(target.name)}" if several_tags else "USER/REPO"
    hub = ["llama-server", "-hf", repo, *_without_files(served.server_args()), *shape]
    family = family_of_spec_type(info.spec_type)
    if served.drafter is not None and family is not None and not family.models_dir_attaches:
        note += (f"; the --models-dir router does not attach {family.title} ({family.sidecar_prefix} file) in "
                 "llama.cpp b11434: serve the pair with the command above, or from a Hub repo with -hf and "
                 f"--spec-type {family.spec_type}")
    return ServePlan(tuple(cmd), shlex.join(cmd), served.method, served.n_max or own.n_max,
                     served.p_min if served.n_max is not None else own.p_min, ",".join(served.spec_types) or None,
                     report is not None and report.best is not None, served.drafter is not None, note,
                     shlex.join(drafted), _preset_options(served) | ({"parallel": shape[1]} if shape else {}),
                     shlex.join(models_dir), PRESET_NAME, folder.name,
                     " ".join(hub))


# llama-server b11434 flags (common/arg.cpp) that place the models or size their caches: what a measurement used with
# them is what the served command must say, or the drafter lands on another device or the context changes
_SERVING_FLAGS = frozenset({
    "-ngl", "--gpu-layers", "--n-gpu-layers", "-ngld", "--spec-draft-ngl", "--gpu-layers-draft",
    "--n-gpu-layers-draft", "-dev", "--device", "-devd", "--spec-draft-device", "--device-draft", "-ctk",
    "--cache-type-k", "-ctv", "--cache-type-v", "-ctkd", "--spec-draft-type-k", "--cache-type-k-draft", "-ctvd",
    "--spec-draft-type-v", "--cache-type-v-draft", "-fa", "--flash-attn", "-c", "--ctx-size", "-ts",
    "--tensor-split", "-sm", "--split-mode"})


def _shape_flags(report: TuneReport) -> list[str]:
    """What the served command adds for the shape measured: ``-np`` for several clients, the placement, KV-cache and
    context flags the user gave, and ``-c`` for a context chosen with ``--ctx``."""
    flags = ["-np", str(report.parallel)] if report.parallel > 1 else []
    flags += _measured_flags(report.user_flags)
    chosen = report.context is not None and report.context != CONTEXT_PER_CLIENT * report.parallel
    if chosen and not any(f.split("=")[0] in ("-c", "--ctx-size") for f in report.user_flags):
        flags += ["-c", str(report.context)]
    return flags


def _measured_flags(user_flags: Sequence[str]) -> list[str]:
    """The placement, KV-cache type and context flags among the user's, each with its value, in their order."""
    out = []
    for i, f in enumerate(user_flags):
        name = f.split("=", 1)[0]
        if name in _SERVING_FLAGS:
            out += [f] if "=" in f else [f, *user_flags[i + 1:i + 2]]
    return out


def _in_folder(path: Path, folder: Path) -> str:
    """A file as the folder's commands name it: relative inside the folder (they run there), else as it is."""
    path = Path(path).absolute()
    return os.path.relpath(path, folder) if path.is_relative_to(folder) else str(path)


def _files_in_folder(args: list[str], folder: Path) -> list[str]:
    """Server arguments with the files inside ``folder`` named relative to it."""
    return [_in_folder(Path(a), folder) if Path(a).is_absolute() else a for a in args]


def _without_files(args: list[str]) -> list[str]:
    """Server arguments minus ``--model-draft FILE`` (a Hub repo's sidecar is found by -hf)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--model-draft":
            skip = True
        else:
            out.append(a)
    return out


def _preset_options(config: Configuration) -> dict[str, str]:
    """The configuration as ``models.ini`` keys (common/preset.cpp: an option's long name without dashes). The
    drafter file is not one: the router attaches the sidecar beside the target and, for a drafter alone, infers
    its spec type from the file's metadata (common_speculative_types_from_gguf), so that is left out too."""
    args = _without_files(config.server_args())
    options = {args[i].lstrip("-"): args[i + 1] for i in range(0, len(args) - 1, 2)}
    if config.drafter is not None and config.ngram is None:
        options.pop("spec-type", None)
    return options


def write_models_preset(outdir: Path, serve: ServePlan, tags: Sequence[TagRecord] = (),
                        projector: str | None = None) -> Path:
    """``models.ini`` for ``llama-server --models-dir <parent> --models-preset models.ini``: this folder's
    model and the speculation measured fastest (the drafter sidecar beside the target is attached by the router
    itself; it is there only when the drafter is what is served). For several tags, one section per tag, named
    after its target, with its target, drafter and projector as files (``--models-preset models.ini``, run in the
    folder). Atomically written."""
    lines = [f"; written by dflash-gguf: {serve.note}",
             f"; serve, from this folder: {serve.models_dir}",
             f"; uploaded to a Hub repo: {serve.hub}"]
    if not tags:
        lines.append(f"[{serve.model}]")
        lines += [f"{key} = {value}" for key, value in serve.preset.items()]
    for tag in tags:
        lines += ["", f"[{Path(tag.target.file).name.removesuffix('.gguf')}]", f"model = {tag.target.file}"]
        if serve.uses_drafter:
            lines.append(f"model-draft = {tag.drafter.file}")
        if projector is not None:
            lines.append(f"mmproj = {projector}")
        lines += [f"{key} = {value}" for key, value in serve.preset.items()]
    path = Path(outdir) / PRESET_NAME
    with atomic_output(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def record_serving(manifest: Manifest, target: Path, drafter: Path, report: TuneReport | None) -> None:
    """Write ``serve`` (and, after a measurement, ``tuning``) into pair.json and ``models.ini`` beside it.

    A run of one drafter keeps it beside the target (where the --models-dir router attaches it) only while it is
    what is served; otherwise it waits in ``drafters/``, recorded in pair.json as before."""
    outputs = _outputs(manifest)
    if outputs.several is None and outputs.tags is None:  # several tags: each tag's drafter stays beside its target
        drafter = _place_single_drafter(manifest, target, drafter, report)
    projector = outputs.projector
    manifest.serve = serve_plan(target, drafter, report,
                                manifest.outdir / projector.file if projector is not None else None,
                                outputs.tags is not None)
    if report is not None:
        manifest.data["tuning"] = {"status": "measured", **report.to_dict()}
    write_models_preset(manifest.outdir, manifest.serve, outputs.tags or (),
                        projector.file if projector is not None else None)
    manifest.save()


def _move_single_drafter(manifest: Manifest, here: Path, there: Path) -> Path:
    """The run's one drafter moved from ``here`` to ``there`` (beside the target, or into ``drafters/``), pair.json's
    record following, and an emptied ``drafters/`` removed. Returns where the file is."""
    if here.absolute() == there.absolute() or not here.is_file() or there.exists():
        return there if there.is_file() else here
    there.parent.mkdir(exist_ok=True)
    os.replace(here, there)
    outputs = _outputs(manifest)
    manifest.outputs = replace(outputs, drafter=replace(outputs.drafter, file=os.path.relpath(there, manifest.outdir)))
    if here.parent.name == DRAFTERS_DIR:
        with contextlib.suppress(OSError):  # only when it is now empty
            here.parent.rmdir()
    return there


def _place_single_drafter(manifest: Manifest, target: Path, drafter: Path, report: TuneReport | None) -> Path:
    """The one drafter of a run beside the target when the served method uses it, in ``drafters/`` when it does not
    (the router would attach it). Returns where it is now."""
    best = report.best if report is not None else None
    beside = best is None or best.config.drafter is not None
    here = Path(drafter)
    return _move_single_drafter(manifest, here, target.parent / here.name if beside else
                                target.parent / DRAFTERS_DIR / here.name)


def unpark_single_drafter(manifest: Manifest) -> None:
    """A run of one drafter whose earlier tune moved it into ``drafters/`` (another method won): moved back beside
    the target, where the drafter stage recorded it, so a re-run reuses it instead of converting it again."""
    outputs = manifest.outputs
    rec = outputs.drafter if outputs is not None and outputs.several is None else None
    parked = inside(manifest.outdir, rec.file) if rec is not None else None
    if parked is not None and parked.parent.name == DRAFTERS_DIR:
        _move_single_drafter(manifest, parked, manifest.outdir / parked.name)
        manifest.save()


def measured_winner(report: TuneReport) -> Path | None:
    """The drafter of the fastest configuration tune measured; None when the target alone was fastest."""
    best = report.best
    return best.config.drafter.path if best is not None and best.config.drafter is not None else None


def _outputs(manifest: Manifest) -> Outputs:
    """The outputs of the run being served (recorded before anything is served)."""
    assert manifest.outputs is not None, "serving is decided after the outputs are recorded"
    return manifest.outputs


def _attached(kind: str) -> bool:
    """Whether llama-server --models-dir attaches a sidecar of this kind (pair.json's ``kind``) to the target."""
    family = family_of_kind(kind)
    return family is None or family.models_dir_attaches


def serve_drafter(manifest: Manifest, target: Path, chosen: Path | None, report: TuneReport | None) -> None:
    """A run of several drafters: ``chosen`` (one of ``drafters/``) linked beside the target, or none when the
    target alone is to be served, then the serve plan recorded. llama.cpp's folder layout holds one target and one
    sidecar (``load_from_models_dir`` attaches the first it lists), so the others stay in ``drafters/``."""
    outdir = manifest.outdir
    outputs = _outputs(manifest)
    by_name = {Path(r.file).name: r for r in outputs.drafters}  # a name is one kind's
    for stale in sidecars_beside(target):
        if stale.name in by_name:  # the link an earlier choice made
            stale.unlink()
    # a file the router does not attach (an eagle3- head: common/preset.cpp knows only the mtp-, dspark- and dflash-
    # prefixes) would be listed beside the target as a second model: it is served from drafters/ by the command
    if chosen is not None and _attached(str(by_name[chosen.name].kind)):
        rec = by_name[chosen.name].served()
        served = outdir / chosen.name
        _link(outdir / rec.file, served)
        manifest.outputs = replace(outputs, drafter=replace(rec, file=served.name, links_to=rec.file))
        plan_for = served
    elif chosen is not None:
        rec = by_name[chosen.name].served()
        manifest.outputs = replace(outputs, drafter=rec)
        plan_for = outdir / rec.file
    else:  # pair.json's drafter: the fastest drafter measured (or the first), where it is, in drafters/
        with_files = [m for m in report.drafting if m.config.drafter is not None] if report is not None else []
        fastest = max(with_files, key=lambda m: m.gen_tps or 0.0) if with_files else None
        name = fastest.config.drafter.path.name if fastest is not None and fastest.config.drafter else \
            next(iter(by_name))
        rec = by_name[name].served()
        manifest.outputs = replace(outputs, drafter=rec)
        plan_for = outdir / rec.file
    record_serving(manifest, target, plan_for, report)


def _link(src: Path, dest: Path) -> None:
    """``dest`` as a hard link to ``src`` (the same bytes, no copy), or a copy where links are not possible."""
    tmp = dest.with_name(dest.name + ".partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dest)


def record_tag_tuning(manifest_path: Path, speeds: Sequence[TagSpeed], report: TuneReport) -> PairRecord:
    """``dflash-gguf tune pair.json --tags ...``: each tag's speed with its own drafter into pair.json's
    ``tag_tuning``, with the fastest tag and what it was measured with (``report``: one tag's, for the server, the
    workload and the flags, the same for every tag).

    Raises:
        InputError: the manifest cannot be read.
        FolderBusyError: a pipeline run is writing the folder.
    """
    record = read_manifest(manifest_path)
    with folder_lock.writing(record.folder, f"dflash-gguf tune {manifest_path} --tags"):
        manifest = Manifest.load(record.folder)
        fastest = fastest_tag(speeds)
        measured = report.to_dict()
        manifest.data["tag_tuning"] = {"tags": [s.to_dict() for s in speeds],
                                       "fastest": fastest.tag if fastest is not None else None,
                                       **{k: measured[k] for k in ("workload", "server", "user_flags")}}
        manifest.save()
    return manifest.record_of()


def record_tuning(manifest_path: Path, report: TuneReport) -> PairRecord:
    """``dflash-gguf tune pair.json``: the measurement into that manifest, the serve command and preset updated.

    Raises:
        InputError: the manifest cannot be read, or no longer names the files that were measured.
        FolderBusyError: a pipeline run is writing the folder.
    """
    record = read_manifest(manifest_path)
    with folder_lock.writing(record.folder, f"dflash-gguf tune {manifest_path}"):
        manifest = Manifest.load(record.folder)
        if len(record.drafters) > 1:
            serve_drafter(manifest, record.file("target"), measured_winner(report), report)
        else:
            record_serving(manifest, record.file("target"), record.file("drafter"), report)
    return manifest.record_of()
