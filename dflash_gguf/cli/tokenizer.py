"""``dflash-gguf fix-tokenizer``: check a target's tokenizer.model and repair it in an overlay dir."""

from __future__ import annotations

from pathlib import Path

import click

from ..tokenizer_fixups import fix_tokenizer
from ._common import echo_json, handle_errors, json_option, setup_logging, verbose_option


@click.command("fix-tokenizer")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--donor", metavar="PATH_OR_REPO",
              help="A tokenizer.model to use instead of synthesizing one: a file, a folder, or a Hub repo "
                   "(owner/name[@revision]). Refused unless it matches tokenizer.json id by id.")
@click.option("--force-donor", is_flag=True, help="Use the --donor file even when ids differ (not recommended).")
@click.option("--repair", is_flag=True,
              help="Replace a tokenizer.model in TARGET that does not match tokenizer.json (in the overlay only).")
@click.option("--out", "out", type=click.Path(path_type=Path),
              help="Overlay dir to write: TARGET's files plus the repaired tokenizer.model. Without it, "
                   "only check and report.")
@json_option
@verbose_option
@handle_errors
def fix_tokenizer_cmd(target: Path, donor: str | None, force_donor: bool, repair: bool, out: Path | None,
                      json_: bool, verbose: bool) -> None:
    """Check TARGET's tokenizer.model against its tokenizer.json; write a correct one into an overlay dir.

    TARGET is never modified: the overlay mirrors it (small files copied, weights symlinked) and holds
    a tokenizer.model synthesized from tokenizer.json, or the --donor file if it matches id by id.

    \b
    Example:
      dflash-gguf fix-tokenizer ./gemma-4-12B-it --out ./gemma-4-12B-it-tokfix
    """
    if force_donor and donor is None:
        raise click.UsageError("--force-donor needs --donor.")
    setup_logging(verbose)
    result = fix_tokenizer(target, donor=donor, force_donor=force_donor, repair=repair, out=out)
    if json_:
        echo_json(result.to_dict())
        return
    size = f", config vocab_size {result.config_vocab_size}" if result.config_vocab_size else ""
    click.echo(f"target: {result.target} (tokenizer.json: {result.n_tokens} tokens{size})")
    line = f"tokenizer.model in target: {result.existing}"
    if result.existing_diff is not None:
        line += f" ({result.existing_diff.summary('existing')})"
    click.echo(line)
    if result.donor_diff is not None:
        click.echo(f"donor {result.donor}: {result.donor_diff.summary('donor')}")
    click.echo(f"tokenizer origin: {result.origin}")
    if result.overlay is not None:
        click.echo(f"wrote overlay {result.overlay} (tokenizer.model sha256 {result.model_sha256}); "
                   f"convert with tokenizer_dir={result.overlay}")
    for note in result.notes:
        click.echo(f"note: {note}")
