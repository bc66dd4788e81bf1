"""``dflash-gguf publish``: parse options, plan and publish an output folder, print what went up."""

from __future__ import annotations

from pathlib import Path

import click

from ..ggufio.split import parse_size
from ..publish import plan_publish, publish
from ._common import echo_json, handle_errors, json_option, setup_logging, verbose_option


@click.command("publish")
@click.argument("folder", type=click.Path(path_type=Path, exists=True))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", default="main", show_default=True, help="The branch to commit to (created if missing).")
@click.option("--all-drafters", is_flag=True,
              help="Also upload the drafters a run of several kept in drafters/ (and a drafter tune set aside).")
@click.option("--license", "license_", default=None, metavar="ID",
              help="The card's license (a Hub license id); needed when the sources' cards state none or differ.")
@click.option("--allow-unverified", is_flag=True,
              help="Publish a pair dflash-verify refuses; the card then says so and lists the refusals.")
@click.option("--drafter-only/--with-target", "drafter_only", default=None,
              help="Upload the drafter without the target, with a card serving it beside the target's own repo "
                   "(llama-server -hf TARGET -hfd REPO). Default: drafter only when the target was given as "
                   "--target-gguf REPO:FILE (someone else's repo), else both.")
@click.option("--max-file-size", default="50G", show_default=True, metavar="SIZE",
              help="Refuse a file above SIZE (K, M, G = 1000s): the Hub recommends under 50 GB a file and takes "
                   "200 GB at most; dflash-convert --split-max-size writes the target in shards under it.")
@click.option("--dry-run", is_flag=True, help="Print the card and the upload plan; touch nothing on the Hub.")
@json_option
@verbose_option
@handle_errors
def publish_cmd(folder: Path, repo_id: str, private: bool, revision: str, all_drafters: bool, license_: str | None,
                allow_unverified: bool, drafter_only: bool | None, max_file_size: str, dry_run: bool, json_: bool,
                verbose: bool) -> None:
    """Put the output FOLDER of dflash-convert on the Hub as REPO_ID, in the layout llama-server -hf reads, with a
    model card written from its pair.json (files and sha256, how to run it, how it was made, the verify verdict,
    the measured speed and what it was measured with).

    The token comes from HF_TOKEN or `hf auth login`; it is never printed or written. A re-publish uploads only
    files whose content changed. Nothing is uploaded when a file carries a path, the user name or the host name of
    this machine (exit 22).

    \b
    Example:
      dflash-gguf publish gemma4-12B-it-DFlash-pair me/gemma-4-12B-it-DFlash-GGUF --license gemma
    """
    setup_logging(verbose)
    plan = plan_publish(folder, repo_id, revision=revision, private=private, all_drafters=all_drafters,
                        license=license_, allow_unverified=allow_unverified, drafter_only=drafter_only,
                        max_file_size=parse_size(max_file_size, "--max-file-size"))
    if dry_run:
        if json_:
            echo_json({"dry_run": True, **plan.to_dict()})
            return
        click.echo(plan.card)
        click.echo(f"would publish {plan.folder} as {plan.repo_id} (revision {plan.revision}"
                   f"{', private' if plan.private else ''}):")
        for f in plan.files:
            click.echo(f"  {f.path_in_repo}  {f.size / 1e6:,.1f} MB  sha256 {f.sha256[:16]}...  {f.role}")
        click.echo("dry run: nothing uploaded.")
        return
    result = publish(plan)
    if json_:
        echo_json({"dry_run": False, **result.to_dict()})
        return
    if result.commit is None:
        click.echo(f"{plan.repo_id} already holds all {len(result.unchanged)} files unchanged: nothing uploaded.")
        return
    click.echo(f"published {plan.folder} as {plan.repo_id} (revision {plan.revision}), commit {result.commit}:")
    for name in result.uploaded:
        click.echo(f"  uploaded  {name}")
    for name in result.unchanged:
        click.echo(f"  unchanged {name}")
