"""``dflash-gguf quality``: how far each tag of a folder drifts from its 16-bit original (llama-perplexity's KLD)."""

from __future__ import annotations

from pathlib import Path

import click

from ..cores import machine_cores
from ..pipeline import MANIFEST_NAME
from ..pipeline.quality import QualityReport, measure_quality
from ..tune.quality import DEFAULT_CTX, KldSettings
from ._common import Progress, echo_json, handle_errors, json_option, setup_logging, verbose_option


def render_quality(report: QualityReport) -> str:
    """The tags side by side as the best quant cards show them: size and bits per weight, mean, 99th and 99.9th
    percentile KLD, same top token and the perplexity ratio to the base; and tune's speed per tag."""
    rows = [("tag", "file", "size", "BPW", "mean KLD", "99% KLD", "99.9% KLD", "same top", "PPL ratio",
             "tok/s (tune --tags)", "accept")]
    for t in report.tags:
        k = t.kld
        rows.append((t.tag, t.file, f"{t.size.size_bytes / 2**20:.1f} MiB", f"{t.size.bits_per_weight:.2f}",
                     f"{k.kld_mean:.6f}", f"{k.kld_p99:.6f}", f"{k.kld_p999:.6f}", f"{k.same_top_p:.2f}%",
                     f"{k.ppl_ratio:.4f}", f"{t.gen_tps:.1f}" if t.gen_tps else "-",
                     f"{t.acceptance * 100:.1f}%" if t.acceptance is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = report.settings.to_dict()
    lines += ["", f"against {report.base}'s logits on {report.text} (sha256 {report.text_sha256[:16]}...): context "
                  f"{s['ctx']}, batch {s['batch']}, {s['chunks'] or 'all'} chunk(s), {s['threads']} threads; "
                  f"{report.tool}", f"hardware: {report.hardware or 'as recorded earlier'}",
              "tok/s and acceptance: the tag's fastest configuration with its drafter, from 'dflash-gguf tune "
              "--tags' (- when not measured).",
              f"least drift for its size (Pareto front), smallest first: {', '.join(report.pareto_front) or '-'}"]
    return "\n".join(lines)


@click.command("quality")
@click.argument("pair", type=click.Path(path_type=Path, exists=True))
@click.option("--text", "text", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The text to measure on (plain text; at least two contexts of tokens).")
@click.option("--base", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The 16-bit target to measure against (default: the folder's 16-bit tag, or its kept "
                   "intermediate; else it is made from the checkpoint, used and removed).")
@click.option("--checkpoint", default=None, metavar="DIR|REPO[@REV]",
              help="The checkpoint the folder was made from, to make the 16-bit target when the folder holds none "
                   "(default: the Hub repo at the commit pair.json records; a local folder must be given).")
@click.option("--ctx", type=click.IntRange(min=16), default=DEFAULT_CTX, show_default=True,
              help="llama-perplexity's context (-c): each chunk scores its second half.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="llama-perplexity's batch (-b; default the context). The mean KLD moves with it: it is recorded.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="At most N chunks of the text (default all).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads (default: the machine's, up to 8).")
@click.option("--plot", is_flag=True, help="Draw quality.png into the folder: each tag's mean KLD against its size, "
                                           "the Pareto front marked (needs matplotlib).")
@json_option
@verbose_option
@handle_errors
def quality_cmd(pair: Path, text: Path, base: Path | None, checkpoint: str | None, ctx: int, batch: int | None,
                chunks: int | None, threads: int | None, plot: bool, json_: bool, verbose: bool) -> None:
    """Measure how far each tag's output drifts from the 16-bit target: llama-perplexity's KL divergence (mean,
    99th and 99.9th percentiles), same-top-token % and perplexity ratio, with each tag's size and bits per weight,
    once per tag and text (cached in pair.json), beside the speed 'dflash-gguf tune --tags' measured per tag. PAIR is
    pair.json or its folder. A folder made in one pass (no 16-bit file) is measured against the 16-bit target made
    again from its checkpoint; the base's logits are kept by content, so no later run makes them again.

    \b
    Example:
      dflash-gguf quality qwen3-8b-pair --text wiki.test.raw --chunks 20
    """
    setup_logging(verbose)
    manifest = pair / MANIFEST_NAME if pair.is_dir() else pair
    settings = KldSettings(ctx, batch, chunks, threads or min(machine_cores(), 8))
    with Progress("quality", unit="tag", label_width=30) as progress:
        report = measure_quality(manifest, text, base=base, checkpoint=checkpoint, settings=settings, plot=plot,
                                 progress=progress)
    if json_:
        echo_json(report.to_dict() | {"recorded_in": str(manifest)})
        return
    click.echo(render_quality(report))
    for note in report.notes:
        click.echo(f"note: {note}")
    if report.plot:
        click.echo(f"drawn: {manifest.parent / report.plot}")
    click.echo(f"recorded in {manifest} (quality)")
