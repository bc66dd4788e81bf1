"""``dflash-convert``: one drafter checkpoint folder to a GGUF, mirroring llama.cpp's converter."""

from __future__ import annotations

from pathlib import Path

import click

from ..provenance import Sources
from ._common import Progress, echo_json, handle_errors, json_option, setup_logging, verbose_option


@click.command("convert")
@click.option("--drafter", "drafter", required=True, type=click.Path(path_type=Path),
              help="DFlash drafter checkpoint folder (config.json + model*.safetensors).")
@click.option("--target", "--target-model-dir", "target", required=True, type=click.Path(path_type=Path),
              help="Target model folder: its config.json and tokenizer files are embedded in the drafter GGUF.")
@click.option("--outfile", required=True, type=click.Path(path_type=Path), help="GGUF file to write.")
@click.option("--outtype", type=click.Choice(["auto", "bf16", "f16", "f32", "q8_0"]), default="auto",
              show_default=True, help="Tensor type of the matrices (auto: the checkpoint's own BF16/F16).")
@click.option("--tokenizer-dir", type=click.Path(path_type=Path), default=None,
              help="Read the target's tokenizer files here instead (e.g. an overlay from 'dflash-gguf fix-tokenizer').")
@click.option("--pair-with", "pair_with", default=None, metavar="TARGET.gguf",
              help="File name of the target GGUF this drafter will be served with, recorded so that "
                   "'dflash-verify DRAFTER.gguf' finds it beside the drafter.")
@click.option("--drafter-repo", default=None, metavar="ORG/NAME[@REV]",
              help="Hub repo id the drafter folder came from; recorded for dflash-verify's lineage checks.")
@click.option("--target-repo", default=None, metavar="ORG/NAME[@REV]",
              help="Hub repo id the target folder came from; recorded for dflash-verify's lineage checks.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the plan; write nothing.")
@json_option
@verbose_option
@handle_errors
def convert_cmd(drafter: Path, target: Path, outfile: Path, outtype: str, tokenizer_dir: Path | None,
                pair_with: str | None, drafter_repo: str | None, target_repo: str | None, dry_run: bool, json_: bool,
                verbose: bool) -> None:
    """Convert a DFlash drafter into a GGUF that llama.cpp b11434 loads.

    \b
    Example:
      dflash-convert --drafter ./gemma4-12B-it-DFlash --target ./gemma-4-12B-it \\
          --outfile gemma4-12B-it-DFlash-BF16.gguf
    """
    from ..convert.drafter import convert_drafter

    setup_logging(verbose)
    progress = Progress("convert")
    try:
        tokenizer = {}
        if tokenizer_dir is not None:
            from ..tokenizer_fixups import overlay_provenance

            tokenizer = overlay_provenance(tokenizer_dir)
        provenance = Sources(drafter_repo, target_repo, pair_with, tokenizer).keys()
        result = convert_drafter(drafter, target, outfile, outtype, dry_run=dry_run, on_progress=progress,
                                 tokenizer_dir=tokenizer_dir, provenance=provenance)
    finally:
        progress.close()
    if json_:
        echo_json(result.to_dict())
        return
    verb = "would write" if result.dry_run else "wrote"
    click.echo(f"{verb} {result.outfile}: {result.n_tensors} tensors, {result.n_bytes / 1e6:.1f} MB, "
               f"{result.outtype}, vocab {result.vocab.model} ({result.vocab.n_tokens} tokens) "
               f"in {result.seconds:.2f} s")
    for note in result.notes:
        click.echo(f"note: {note}")
