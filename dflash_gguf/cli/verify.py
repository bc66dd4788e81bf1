"""``dflash-verify``: judge a drafter/target GGUF pair before it is served."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import click

from ..errors import InputError
from ..hub import resolve
from ..pipeline import MANIFEST_NAME
from ..pipeline.manifest import verify_manifest
from ..pipeline.sources import Source
from ..pipeline.stages import precheck_projector
from ..verify import Report, precheck, verify_files
from ._common import echo_json, handle_errors, json_option

_MARK = {("pass", "error"): "ok", ("pass", "warning"): "ok", ("pass", "info"): "info", ("skip", "error"): "skip",
         ("skip", "warning"): "skip", ("skip", "info"): "skip", ("fail", "error"): "ERROR",
         ("fail", "warning"): "warn", ("fail", "info"): "info"}


def render(report: Report, width: int = 100) -> str:
    """A readable table: check, result, message (and the fix under it when there is one)."""
    rows = [(r.id, _MARK[(r.status, r.severity)], r.message, r.fix) for r in report.results]
    w_id = max((len(r[0]) for r in rows), default=5)
    msg_w = max(40, width - w_id - 10)
    lines = [f"{'check':<{w_id}}  {'result':<6}  message / fix", "-" * min(width, w_id + 10 + msg_w)]
    for cid, mark, msg, fix in rows:
        wrapped = textwrap.wrap(msg, msg_w) or [""]
        if fix and mark in ("ERROR", "warn"):
            wrapped += textwrap.wrap("fix: " + fix, msg_w)
        lines.append(f"{cid:<{w_id}}  {mark:<6}  {wrapped[0]}")
        lines += [f"{'':<{w_id}}  {'':<6}  {x}" for x in wrapped[1:]]
    n_err, n_warn = len(report.errors), len(report.warnings)
    verdict = "MUST NOT be served" if n_err else "can be served"
    lines.append(f"\n{verdict}: {n_err} error(s), {n_warn} warning(s).")
    return "\n".join(lines)


@click.command("verify")
@click.argument("drafter", type=click.Path(path_type=Path))
@click.argument("target", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--allow-derived-target", is_flag=True,
              help="Accept a QAT/quantized/abliterated/merged derivative of the drafter's target (a warning).")
@json_option
@click.pass_context
@handle_errors
def verify_cmd(ctx: click.Context, drafter: Path, target: Path | None, allow_derived_target: bool,
               json_: bool) -> None:
    """Check that a DFlash drafter GGUF and its target GGUF belong together.

    DRAFTER may be the pair.json dflash-convert wrote, or its folder (its files are checked, also against
    their recorded sha256; every drafter of a run of several is judged with the target). Without TARGET, the
    target file the drafter records beside itself is used.
    Exit 0: servable; 1: must not be served; 2: an input cannot be read.

    \b
    Example:
      dflash-verify gemma4-12B-it-DFlash-BF16.gguf gemma-4-12B-it-Q4_0.gguf
      dflash-verify pair/pair.json
    """
    if drafter.is_dir() and target is None:
        if not (drafter / MANIFEST_NAME).is_file():
            raise InputError(f"{drafter} is a folder without {MANIFEST_NAME}. Pass the folder dflash-convert wrote, "
                             "its pair.json, or DRAFTER.gguf [TARGET.gguf].")
        drafter = drafter / MANIFEST_NAME
    if drafter.suffix == ".json" and target is None:
        report = verify_manifest(drafter, allow_derived_target=allow_derived_target)
    else:
        report = verify_files(drafter, target, allow_derived_target=allow_derived_target)
    if json_:
        echo_json(report.to_dict())
    else:
        click.echo(render(report, shutil.get_terminal_size((100, 20)).columns))
    ctx.exit(report.exit_code)


@click.command("precheck")
@click.argument("drafter")
@click.argument("target")
@click.option("--allow-derived-target", is_flag=True,
              help="Accept a QAT/quantized/abliterated/merged derivative of the drafter's target (a warning).")
@click.option("--no-mmproj", "no_mmproj", is_flag=True,
              help="Do not judge the target's projector (as dflash-convert --no-mmproj, which leaves it out).")
@json_option
@click.pass_context
@handle_errors
def precheck_cmd(ctx: click.Context, drafter: str, target: str, allow_derived_target: bool, no_mmproj: bool,
                 json_: bool) -> None:
    """Judge a drafter/target pair from config.json and model cards only, before any weights are fetched.

    DRAFTER and TARGET are folders or Hub repo ids (org/name[@revision]); for repo ids only config.json
    and README.md are downloaded (and, for a target with vision or audio towers, its processor config files, so
    the projector is judged as dflash-convert would: the same refusal and exit code). Same check ids and exit
    codes as dflash-verify.

    \b
    Example:
      dflash-gguf precheck z-lab/gemma4-12B-it-DFlash google/gemma-4-12B-it-qat-q4_0-unquantized
    """
    d, t = resolve(drafter), resolve(target)
    card = lambda r: (r.path / "README.md").read_text(encoding="utf-8") if (r.path / "README.md").is_file() \
        else None  # noqa: E731
    report = precheck(d.path / "config.json", t.path / "config.json", drafter_repo=d.repo or d.path.name,
                      target_repo=t.repo or t.path.name, drafter_card=card(d), target_card=card(t),
                      allow_derived_target=allow_derived_target)
    if not no_mmproj and not report.errors:  # the pipeline's next refusal, from the configs: the same code
        precheck_projector(Source(target, t))
    if json_:
        echo_json({**report.to_dict(), "sources": {"drafter": d.label, "target": t.label}})
    else:
        click.echo(f"drafter: {d.label}\ntarget:  {t.label}")
        click.echo(render(report, shutil.get_terminal_size((100, 20)).columns))
    ctx.exit(report.exit_code)

