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
    """The tags side by side: mean and 99th-percentile KLD, same top token, perplexity, and tune's speed per tag."""
    rows = [("tag", "file", "mean KLD", "99% KLD", "same top", "PPL", "tok/s (tune --tags)", "accept")]
    for t in report.tags:
        rows.append((t.tag, t.file, f"{t.kld.mean_kld:.6f}", f"{t.kld.kld_99:.6f}", f"{t.kld.same_top_pct:.2f}%",
                     f"{t.kld.ppl:.4f}", f"{t.gen_tps:.1f}" if t.gen_tps else "-",
                     f"{t.acceptance * 100:.1f}%" if t.acceptance is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = report.settings.to_dict()
    lines += ["", f"against {report.base}'s logits on {report.text} (sha256 {report.text_sha256[:16]}...): context "
                  f"{s['ctx']}, batch {s['batch']}, {s['chunks'] or 'all'} chunk(s), {s['threads']} threads; "
                  f"{report.tool}", f"hardware: {report.hardware or 'as recorded earlier'}",
              "tok/s and acceptance: the tag's fastest configuration with its drafter, from 'dflash-gguf tune "
              "--tags' (- when not measured)."]
    return "\n".join(lines)


@click.command("quality")
@click.argument("pair", type=click.Path(path_type=Path, exists=True))
@click.option("--text", "text", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The text to measure on (plain text; at least two contexts of tokens).")
@click.option("--base", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The 16-bit target to measure against (default: the folder's 16-bit tag, or its kept "
                   "intermediate).")
@click.option("--ctx", type=click.IntRange(min=16), default=DEFAULT_CTX, show_default=True,
              help="llama-perplexity's context (-c): each chunk scores its second half.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="llama-perplexity's batch (-b; default the context). The mean KLD moves with it: it is recorded.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="At most N chunks of the text (default all).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads (default: the machine's, up to 8).")
@json_option
@verbose_option
@handle_errors
def quality_cmd(pair: Path, text: Path, base: Path | None, ctx: int, batch: int | None, chunks: int | None,
                threads: int | None, json_: bool, verbose: bool) -> None:
    """Measure how far each tag's output drifts from the 16-bit target: llama-perplexity's KL divergence (mean,
    99th percentile), same-top-token % and perplexity, once per tag and text (cached in pair.json), beside the speed
    'dflash-gguf tune --tags' measured per tag. PAIR is pair.json or its folder.

    \b
    Example:
      dflash-gguf quality qwen3-8b-pair --text wiki.test.raw --chunks 20
    """
    setup_logging(verbose)
    manifest = pair / MANIFEST_NAME if pair.is_dir() else pair
    settings = KldSettings(ctx, batch, chunks, threads or min(machine_cores(), 8))
    with Progress("quality", unit="tag", label_width=30) as progress:
        report = measure_quality(manifest, text, base=base, settings=settings, progress=progress)
    if json_:
        echo_json(report.to_dict() | {"recorded_in": str(manifest)})
        return
    click.echo(render_quality(report))
    click.echo(f"recorded in {manifest} (quality)")
