"""How the pair is served: the llama-server command, the ``models.ini`` preset, and the measured n-max.

Untuned, the command uses ``tune.DEFAULT_N_MAX`` (clamped to the drafter's block) and says it was not
measured; after ``tune`` it uses the fastest measured configuration. Either way ``pair.json`` records which.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from ..atomic import atomic_output
from ..sidecar import PRESET_NAME, sidecars_beside
from ..tune import DEFAULT_N_MAX, TuneReport, inspect_drafter, required_p_min
from .manifest import Manifest, read_manifest


def serve_plan(target: Path, drafter: Path, report: TuneReport | None = None) -> dict[str, Any]:
    """The ``serve`` section of pair.json: the command, n-max and p-min, and where they came from."""
    info = inspect_drafter(drafter)
    limit, spec_type = info.max_n_max, info.spec_type or "draft-dflash"  # draft-dspark for a Markov-head drafter
    if report is None or report.best is None:
        n_max, p_min, with_drafter, measured = min(DEFAULT_N_MAX, limit), None, True, False
        note = (f"not measured on this machine: n-max {n_max}, the small draft length users' measurements favour "
                f"over the block's maximum of {limit}; 'dflash-gguf tune' measures it")
    else:
        best, drafting = report.best, report.best_drafting
        chosen = drafting if best.config.drafter is None else best
        n_max = chosen.config.n_max if chosen is not None and chosen.config.n_max else min(DEFAULT_N_MAX, limit)
        p_min = chosen.config.p_min if chosen is not None else None
        with_drafter, measured = best.config.drafter is not None, True
        speed = report.speedup(best)
        note = (f"measured by tune: {best.config.label} was fastest ({speed:.2f}x the target alone)" if with_drafter
                else f"measured by tune: the target alone was fastest; the drafter's best was n-max {n_max}")
    if p_min is None:
        p_min = required_p_min(info)  # a DSpark drafter without a confidence head needs p-min 0
    drafted = ["llama-server", "-m", str(target.absolute()), "--model-draft", str(drafter.absolute()),
               "--spec-type", spec_type, "--spec-draft-n-max", str(n_max)]
    if p_min is not None:
        drafted += ["--spec-draft-p-min", f"{p_min:g}"]
    cmd = drafted if with_drafter else ["llama-server", "-m", str(target.absolute())]
    folder = target.absolute().parent
    models_dir = ["llama-server", "--models-dir", str(folder.parent), "--models-preset", str(folder / PRESET_NAME)]
    # The folder uploaded to a Hub repo: -hf fetches the dflash- sidecar only when the spec type is given, and
    # reads no preset, so n-max goes on the command line (common/arg.cpp download_dflash / download_dspark).
    hub = ["llama-server", "-hf", "USER/REPO", "--spec-type", spec_type, "--spec-draft-n-max", str(n_max)]
    if (needed := required_p_min(info)) is not None:
        hub += ["--spec-draft-p-min", f"{needed:g}"]
    if spec_type == "draft-eagle3":  # common/preset.cpp attaches no eagle3- sidecar (-hf does, given the spec type)
        note += ("; the --models-dir router does not attach an eagle3- drafter in llama.cpp b11434: serve the pair "
                 "with the command above, or from a Hub repo with -hf and --spec-type draft-eagle3")
    return {"command": cmd, "shell": shlex.join(cmd), "n_max": n_max, "p_min": p_min, "measured": measured,
            "uses_drafter": with_drafter, "note": note, "with_drafter": shlex.join(drafted),
            "models_dir": shlex.join(models_dir), "models_preset": PRESET_NAME, "model": folder.name,
            "hub": " ".join(hub)}


def write_models_preset(outdir: Path, serve: dict[str, Any]) -> Path:
    """``models.ini`` for ``llama-server --models-dir <parent> --models-preset models.ini``: this folder's
    model, the drafter llama-server attaches from the folder, and the n-max chosen (atomically written)."""
    lines = [f"; written by dflash-gguf: {serve['note']}",
             f"; serve: {serve['models_dir']}",
             f"; uploaded to a Hub repo: {serve['hub']}",
             f"[{serve['model']}]",
             f"spec-draft-n-max = {serve['n_max']}"]
    if serve.get("p_min") is not None:
        lines.append(f"spec-draft-p-min = {serve['p_min']:g}")
    path = Path(outdir) / PRESET_NAME
    with atomic_output(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def record_serving(manifest: Manifest, target: Path, drafter: Path, report: TuneReport | None) -> None:
    """Write ``serve`` (and, after a measurement, ``tuning``) into pair.json and ``models.ini`` beside it."""
    serve = serve_plan(target, drafter, report)
    manifest.data["serve"] = serve
    if report is not None:
        manifest.data["tuning"] = {"status": "measured", **report.to_dict()}
    write_models_preset(manifest.outdir, serve)
    manifest.save()


def measured_winner(report: TuneReport) -> Path | None:
    """The drafter of the fastest configuration tune measured; None when the target alone was fastest."""
    best = report.best
    return best.config.drafter.path if best is not None and best.config.drafter is not None else None


def serve_drafter(manifest: Manifest, target: Path, chosen: Path | None, report: TuneReport | None) -> None:
    """A run of several drafters: ``chosen`` (one of ``drafters/``) linked beside the target, or none when the
    target alone is to be served, then the serve plan recorded. llama.cpp's folder layout holds one target and one
    sidecar (``load_from_models_dir`` attaches the first it lists), so the others stay in ``drafters/``."""
    outdir = manifest.outdir
    by_name = {Path(r["file"]).name: r for r in manifest.data["outputs"]["drafters"]}  # a name is one kind's
    for stale in sidecars_beside(target):
        if stale.name in by_name:  # the link an earlier choice made
            stale.unlink()
    # an eagle3- file beside the target would be listed as a second model, not attached (common/preset.cpp knows
    # only the mtp-, dspark- and dflash- prefixes): it is served from drafters/ by the command
    if chosen is not None and by_name[chosen.name].get("kind") != "eagle3":
        rec = {k: v for k, v in by_name[chosen.name].items() if k not in ("kind", "source", "verify")}
        served = outdir / chosen.name
        _link(outdir / rec["file"], served)
        manifest.data["outputs"]["drafter"] = {**rec, "file": served.name, "links_to": rec["file"]}
        plan_for = served
    elif chosen is not None:
        rec = {k: v for k, v in by_name[chosen.name].items() if k not in ("kind", "source", "verify")}
        manifest.data["outputs"]["drafter"] = rec
        plan_for = outdir / rec["file"]
    else:  # pair.json's drafter: the fastest drafter measured (or the first), where it is, in drafters/
        fastest = report.best_drafting if report is not None else None
        name = fastest.config.drafter.path.name if fastest is not None and fastest.config.drafter else \
            next(iter(by_name))
        rec = {k: v for k, v in by_name[name].items() if k not in ("kind", "source", "verify")}
        manifest.data["outputs"]["drafter"] = rec
        plan_for = outdir / rec["file"]
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


def record_tuning(manifest_path: Path, report: TuneReport) -> dict[str, Any]:
    """``dflash-gguf tune pair.json``: the measurement into that manifest, the serve command and preset updated.

    Raises:
        InputError: the manifest cannot be read, or no longer names the files that were measured.
    """
    record = read_manifest(manifest_path)
    manifest = Manifest.load(record.folder)
    if len(record.drafters) > 1:
        serve_drafter(manifest, record.file("target"), measured_winner(report), report)
    else:
        record_serving(manifest, record.file("target"), record.file("drafter"), report)
    return manifest.data
