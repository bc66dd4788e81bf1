"""``dflash-gguf convert-target``: a target checkpoint folder to the GGUF llama.cpp b11434's converter writes."""

from __future__ import annotations

from pathlib import Path

import click

from ..convert.targets import convert_projector, convert_target
from ..provenance import Provenance
from ..quantize.rules import ONE_PASS_TYPES
from ..tokenizer_fixups import overlay_provenance
from ._common import Progress, echo_conversion, handle_errors, json_option, setup_logging, verbose_option


@click.command("convert-target")
@click.argument("target_dir", type=click.Path(path_type=Path))
@click.option("--outfile", required=True, type=click.Path(path_type=Path), help="GGUF file to write.")
@click.option("--outtype", type=click.Choice(["auto", "bf16", "f16", "f32", "q8_0"]), default="auto",
              show_default=True, help="Tensor type of the matrices (auto: the checkpoint's own BF16/F16).")
@click.option("--quant", type=click.Choice(ONE_PASS_TYPES, case_sensitive=False), default=None,
              help="Quantize in the same pass: the bytes of converting and then running llama-quantize (its "
                   "mixture rules included), with no BF16 file on disk.")
@click.option("--tokenizer-dir", type=click.Path(path_type=Path), default=None,
              help="Read the tokenizer files here instead (e.g. an overlay from 'dflash-gguf fix-tokenizer').")
@click.option("--target-repo", default=None, metavar="ORG/NAME[@REV]",
              help="Hub repo id the folder came from; recorded for dflash-verify's lineage checks.")
@click.option("--mmproj", is_flag=True,
              help="Write the target's vision/audio projector instead of its language model, as llama.cpp's "
                   "converter's --mmproj does (Gemma-4, Gemma-4 Unified, Qwen3.5/3.6); llama-server loads it with "
                   "--mmproj, and -hf finds it by the mmproj in its name.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the plan; write nothing.")
@json_option
@verbose_option
@handle_errors
def convert_target_cmd(target_dir: Path, outfile: Path, outtype: str, quant: str | None, tokenizer_dir: Path | None,
                       target_repo: str | None, mmproj: bool, dry_run: bool, json_: bool, verbose: bool) -> None:
    """Convert a target model (Gemma-4, Qwen3, ...) into the GGUF llama.cpp b11434 writes, without torch.

    \b
    Example:
      dflash-gguf convert-target ./gemma-4-12B-it --outfile gemma-4-12B-it-BF16.gguf
      dflash-gguf convert-target ./gemma-4-12B-it --mmproj --outtype f16 --outfile mmproj-gemma-4-12B-it-F16.gguf
    """
    setup_logging(verbose)
    if mmproj and (quant is not None or tokenizer_dir is not None):
        raise click.UsageError("--quant and --tokenizer-dir apply to the language model; a projector (--mmproj) "
                               "takes --outtype (f16, bf16, f32, q8_0 or auto).")
    tokenizer = {}
    if tokenizer_dir is not None:
        tokenizer = overlay_provenance(tokenizer_dir)
    progress = Progress("convert-target")
    try:
        if mmproj:
            result = convert_projector(target_dir, outfile, outtype, dry_run=dry_run, on_progress=progress,
                                       provenance=Provenance(target_repo=target_repo).keys())
        else:
            result = convert_target(target_dir, outfile, outtype, tokenizer_dir=tokenizer_dir, quant=quant,
                                    dry_run=dry_run,
                                    provenance=Provenance(target_repo=target_repo, tokenizer=tokenizer).keys(),
                                    on_progress=progress)
    finally:
        progress.close()
    echo_conversion(result, json_)
