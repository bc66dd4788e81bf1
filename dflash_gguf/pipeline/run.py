"""``run_pipeline``: resolve -> precheck -> fetch -> tokenizer -> target GGUF -> drafter GGUF -> quantize ->
verify -> pair.json, each stage skipped when pair.json vouches for its output.

Reads top to bottom like the manual workflow it replaces. Nothing here prints or knows about Click:
progress goes through the ``progress`` factory the caller passes, messages through ``logging``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import LLAMA_CPP_BUILD, __version__, folder_lock, hub, jsonfile, made_cache
from .. import provenance as prov
from ..arrivals import ShardStream
from ..atomic import atomic_output
from ..convert.vocab import forget_built
from ..errors import ACCEPTANCE_COLLAPSED, InputError, LlamaServerNotFound, PlotUnavailable
from ..ggufio.split import shard_path, split_gguf
from ..hub import DRAFTER_PATTERNS, INDEX, TARGET_PATTERNS, WEIGHT_PATTERNS
from ..provenance import Provenance, folder_label
from ..quantize.builtin import NO_OVERRIDES
from ..quantize.imatrix import Importance, imatrix_tool, load_importance, make_imatrix
from ..relpath import inside
from ..sidecar import drafter_kind
from ..tune import TuneOptions, TuneReport, tune
from ..tune.plot import PLOT_NAME, write_plot
from ..verify import Report, read_gguf
from ..verify.projector import check_projector
from . import stages, stream
from .manifest import (
    DrafterVerdict,
    FileRecord,
    Made,
    Manifest,
    OutputRecord,
    Outputs,
    PairRecord,
    RecipeRecord,
    RunOptions,
    SourceRecord,
    Sources,
    TagRecord,
    ToolVersions,
    file_record,
    judge_tag,
    sha256_file,
)
from .naming import (
    IMATRIX_DIR,
    checkpoint_type,
    gguf_name,
    model_name,
    projector_name,
)
from .options import (
    PipelineOptions,
    check_quant_types,
    check_tag_names,
    drafter_side,
    is_target_side,
    makes_in_one_pass,
    tag_side,
    target_quant,
)
from .plan import Plan, drafter_file, plan_run
from .serve import measured_winner, record_serving, serve_drafter, unpark_single_drafter
from .sources import Source, fetch_source, public_spec
from .sources import resolve_source as resolve_spec
from .stream import StreamSummary

log = logging.getLogger(__name__)

WORK_DIR = folder_lock.WORK_DIR  # inside --outdir: the tokenizer overlay, the converters' scratch cwd, the lock
ProgressFactory = Callable[[str], Callable[[int, int], None]]


@dataclass(frozen=True)
class PipelineResult:
    """A run's pair.json, typed (``pair``) and as the JSON document it is (``document``; for a dry run, the header
    the run would start from), the plan of a dry run, and the final verify report."""

    outdir: Path
    document: dict[str, Any]
    pair: PairRecord | None = None  # None for a dry run
    plan: Plan | None = None
    report: Report | None = None
    dry_run: bool = False

    tuning: TuneReport | None = None
    tuning_skipped: str | None = None  # why --tune measured nothing
    plot: Path | None = None  # tune.png, drawn after --tune
    plot_skipped: str | None = None  # why it was not (matplotlib missing)
    streamed: StreamSummary | None = None  # the target's shards converted as they arrived: bytes and time

    @property
    def exit_code(self) -> int:
        code = self.report.exit_code if self.report is not None else 0
        if code == 0 and self.tuning is not None and self.tuning.collapse_found:
            return ACCEPTANCE_COLLAPSED
        return code

    def to_dict(self) -> dict[str, Any]:
        if self.dry_run:
            return {"dry_run": True, **self.document, "plan": self.plan.to_dict() if self.plan else None}
        return {"dry_run": False, "manifest": str(self.outdir / "pair.json"), **self.document,
                **({"streamed": self.streamed.to_dict()} if self.streamed is not None else {})}


def _draw(tuning: TuneReport, outdir: Path) -> tuple[Path | None, str | None]:
    """tune.png beside pair.json, or why it was not drawn (matplotlib is an optional extra)."""
    try:
        return write_plot(tuning, outdir / PLOT_NAME), None
    except PlotUnavailable as e:
        log.info("%s", e)
        return None, str(e)


def default_outdir(drafter: Source) -> Path:
    """``<drafter-name>-pair`` in the current folder."""
    return Path(f"{model_name(drafter.repo, drafter.path)}-pair")


def _no_progress(desc: str) -> Callable[[int, int], None]:
    return lambda done, total: None


@contextlib.contextmanager
def _bar(progress: ProgressFactory, desc: str) -> Iterator[Callable[[int, int], None]]:
    bar = progress(desc)
    try:
        yield bar
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()


def _tool_versions(method: stages.TargetMethod, opts: PipelineOptions) -> ToolVersions:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return ToolVersions(__version__, version("gguf"), version("huggingface_hub"), LLAMA_CPP_BUILD,
                        sys.version.split()[0], stages.quantizer_choice(opts.target_type, opts.quantizer),
                        method.version if isinstance(method, stages.LlamaCppConverter) else None)


# ------------------------------------------------------------------------------------------------ plan


def refuse_same_sidecar(target: Source, drafters: list[Source], draft_quant: str) -> None:
    """Two drafters of one kind would write one sidecar name; llama.cpp's layout tells drafters apart by prefix.

    Raises:
        InputError: two --drafter specs make the same file.
    """
    seen: dict[str, Source] = {}
    for d in drafters:
        name = drafter_file(target, d, draft_quant, True)
        if name in seen:
            raise InputError(f"--drafter {seen[name].spec} and --drafter {d.spec} are drafters of the same kind and "
                             f"would both be written as {name}: llama.cpp's folder layout names a target's drafters by "
                             "their kind (dflash-, dspark-, mtp-, eagle3-). Compare them in two runs with two --outdir "
                             "folders, then 'dflash-gguf tune TARGET.gguf A.gguf B.gguf'.")
        seen[name] = d


# ---------------------------------------------------------------------------------------------- the run


def run_pipeline(opts: PipelineOptions, progress: ProgressFactory = _no_progress) -> PipelineResult:
    """Make, quantize, verify and describe a servable drafter/target GGUF pair.

    Raises:
        IncompatiblePairError: the precheck or the --target-gguf judgment refused the pair.
        UnsupportedModelError: no way to make the target GGUF.
        ResolveError, InputError, ConfigError, TensorError, TokenizerError, QuantizeError, OutputError: from
            the stage that failed; outputs of finished stages stay and the next run resumes after them.
    """
    opts = check_quant_types(opts)
    if opts.imatrix_auto and not opts.calibration:
        raise InputError("--imatrix auto computes the matrix with llama-imatrix over a calibration text: pass "
                         "--calibration FILE (a text file) or --calibration REPO[@REV]:FILE from the Hub.")
    drafters = [resolve_spec(spec) for spec in opts.drafters]
    drafter, target = drafters[0], resolve_spec(opts.target)
    opts = target_quant(opts, target)
    check_tag_names(opts, model_name(target.repo, target.path))
    log.info("drafter %s, target %s", ", ".join(d.label for d in drafters), target.label)
    refuse_same_sidecar(target, drafters, opts.drafter_types()[0])
    drafter_by_llama_cpp = opts.llama_cpp is not None and not stages.drafter_vocab_covered(target)
    prechecks = [stages.precheck_sources(d, target, allow_derived_target=opts.allow_derived_target,
                                         drafter_by_llama_cpp=drafter_by_llama_cpp) for d in drafters]
    precheck = prechecks[0]
    if opts.mmproj and opts.target_gguf is None:  # the projector's refusal from the configs, before any weight
        stages.precheck_projector(target)
    method = stages.choose_target_method(target, opts.target_gguf, opts.llama_cpp)
    advice = stages.qat_advice(target, opts.target_type, opts.target_overrides) if opts.target_gguf is None else None
    if advice:
        log.warning("%s", advice)
    outdir = Path(opts.outdir) if opts.outdir is not None else default_outdir(drafter)
    plan = plan_run(opts, drafters, target, method, outdir, drafter_by_llama_cpp)
    sources = Sources(target.record(), drafter.record(),
                      tuple(d.record() for d in drafters) if len(drafters) > 1 else None)
    options = RunOptions(opts.target_type, opts.drafter_types()[0], method.kind,
                         "llama-cpp" if drafter_by_llama_cpp else "builtin",
                         public_spec(opts.target_gguf), folder_label(opts.llama_cpp) if opts.llama_cpp else None,
                         opts.keep_intermediate,
                         opts.allow_derived_target, opts.drop_mtp, opts.tags if opts.several_tags else None,
                         opts.drafter_types() if opts.several_tags else None,
                         tuple(opts.target_overrides.args()),
                         tuple(RecipeRecord(r.name, r.base, r.file_name, tuple(rule.arg for rule in r.rules))
                               for r in opts.recipes))
    header: dict[str, Any] = {"precheck": precheck.to_dict(), **({"notes": [advice]} if advice else {})}
    if len(drafters) > 1:
        header["prechecks"] = [p.to_dict() for p in prechecks]
    if opts.dry_run:
        plan.require_space()
        return PipelineResult(outdir, {"sources": sources.to_json(), "options": options.to_json(), **header}, None,
                              plan, None, True)
    plan.require_space()
    gguf_path = None
    if isinstance(method, stages.ExistingGguf):  # judged before any weight is fetched or anything is written
        fetched = stages.obtain_target_gguf(method.spec)
        gguf_path = fetched.path
        stages.judge_target_gguf(gguf_path, allow_derived_target=opts.allow_derived_target)
        sources = replace(sources, target_gguf=SourceRecord(fetched.spec, fetched.repo, fetched.commit,
                                                            fetched.name))
    calibration = hub.fetch_file(opts.calibration) if opts.imatrix_auto and opts.calibration else None
    try:
        with folder_lock.writing(outdir, f"dflash-convert --outdir {outdir}"):
            run = _Run(opts, Manifest.load(outdir), progress, method, options)
            run.calibration = calibration
            return run.run(drafters, target, sources, header, gguf_path)
    finally:
        forget_built()  # the target's vocabulary, built once for the drafter check, the target and the drafters


class _Run:
    """One run's state: the manifest, the options, and the stage bookkeeping around the stage functions."""

    def __init__(self, opts: PipelineOptions, manifest: Manifest, progress: ProgressFactory,
                 method: stages.TargetMethod, options: RunOptions) -> None:
        self.opts, self.manifest, self.progress, self.method, self.options = opts, manifest, progress, method, options
        self.outdir = manifest.outdir
        self.work = self.outdir / WORK_DIR
        self.tool = f"dflash-gguf {__version__}"
        self._tune_bar: Callable[[int, int], None] | None = None
        self.imatrix: Path | None = None  # the --imatrix file, copied into the folder by the target stage
        self.imatrix_sha256: str | None = None
        self.imatrix_name = ""  # the target's model name, which the matrix's file name carries
        self.calibration: hub.FetchedFile | None = None  # --imatrix auto's text, resolved by run_pipeline
        self._loaded_importance: Importance | None = None
        self.streamed: Callable[[], StreamSummary] | None = None  # the summary so far of a streamed target
        self.stream: ShardStream | None = None  # ... and its shards, while they stream in
        self.target_fingerprint: str | None = None

    def run(self, drafters: list[Source], target: Source, sources: Sources, header: dict[str, Any],
            gguf_path: Path | None) -> PipelineResult:
        m = self.manifest
        m.sources, m.options = sources, self.options
        m.data.update(header)
        m.data["status"] = "in-progress"
        if len(drafters) == 1:  # a drafter an earlier tune set aside goes back where its stage record has it
            unpark_single_drafter(m)
        earlier = m.outputs
        m.outputs, m.serve = None, None  # until this run vouches for them again
        for done in ("verify", "tuning"):
            m.data.pop(done, None)
        m.save()
        opts = self.opts
        several = len(drafters) > 1

        # The drafters first, checked against the target's config and tokenizer: a drafter that cannot be converted
        # stops the run before the target's weights are fetched, converted or quantized.
        drafters = [fetch_source(d, DRAFTER_PATTERNS) for d in drafters]
        reads_target = any(stages.drafter_reads_target_weights(d) for d in drafters)  # the check needs the weights
        builtin = isinstance(self.method, stages.BuiltinConverter) and self.options.drafter_method == "builtin"
        names = stream.shard_names(target) if not gguf_path and not reads_target and builtin else []
        if not names and not gguf_path and not opts.keep_source:
            why = ("a local folder is read where it is" if target.repo is None else
                   "the drafter's conversion reads its weights first" if reads_target else
                   "llama.cpp's converter reads the whole folder" if not builtin else "one file, no shard index")
            log.warning("--no-keep-source: %s is not streamed (%s), so its weights are fetched and kept as without "
                        "the flag.", target.label, why)
        target = fetch_source(target, TARGET_PATTERNS + (WEIGHT_PATTERNS if reads_target else ()))
        with contextlib.ExitStack() as reading:  # the target's first tensors made while the CPU does the work before
            read_ahead = gguf_path is None and isinstance(self.method, stages.BuiltinConverter)
            if read_ahead and (target.repo is None or reads_target):  # the weights are here already
                reading.enter_context(self.working_ahead(target))
            if self.options.drafter_method == "builtin":
                for d in drafters:
                    stages.check_drafter(d, target)
                    jsonfile.forget()  # each stage parses tokenizer.json (~130 MB at 262k tokens) itself, one at a time
            if names:  # converted as they arrive
                target = fetch_source(target, TARGET_PATTERNS + (INDEX,))
                self.stream, self.streamed = reading.enter_context(self.streaming(target, names, gguf_path))
            elif not gguf_path and not reads_target:
                target = fetch_source(target, TARGET_PATTERNS + WEIGHT_PATTERNS)
                if read_ahead and target.repo is not None:
                    reading.enter_context(self.working_ahead(target))
            m.sources = replace(sources, target=target.record(), drafter=drafters[0].record(),
                                several=tuple(d.record() for d in drafters) if several else None)
            m.save()

            if self.makes_projector(target, gguf_path):  # refused now, before anything is written
                stages.check_projector_source(target.path)
            tok = self.tokenizer(target)
            jsonfile.forget()
            m.data["tokenizer"] = tok.to_dict() | {"overlay": os.path.relpath(tok.overlay, self.outdir)
                                                   if tok.overlay else None}
            m.save()

            if opts.several_tags:
                tagged = [(self._served(f, tag_side(tag, opts.tags)), made_tag)  # a split target: its first shard
                          for tag, (f, made_tag) in zip(opts.tags, self.tag_targets(target, tok), strict=True)]
            else:
                final_t, made_t = self.target(target, tok, gguf_path)
                tagged = [(self._served(final_t), made_t)]
            final_t, made_t = tagged[0]
            jsonfile.forget()
            if self.stream is not None:  # the projector's pass removes the towers' shards it held at their last use
                self.stream.unhold()
            projector = self.projector(target, gguf_path)
            streamed = self.streamed() if self.streamed is not None else None
        if streamed is not None:  # as the target GGUF records it: the drafters read no shard, which may be gone
            self.target_fingerprint = read_gguf(final_t).get(prov.key(prov.TARGET_EMBD_FINGERPRINT))
            log.info("%s", streamed.line())
        made: list[tuple[Path, Made, Report]] = []
        tag_drafters = self.tag_drafters(drafters[0], target, tok, [f for f, _ in tagged]) if opts.several_tags \
            else []
        for i, d in enumerate(drafters if not opts.several_tags else ()):
            with stages.reading_ahead(d.path):  # while its vocabulary is built
                final_d, made_d = self.drafter(d, target, tok, final_t.name,
                                               "drafter" if i == 0 else f"drafter{i + 1}", several)
            jsonfile.forget()
            made.append((final_d, made_d, stages.verify_pair(final_d, final_t,
                                                             allow_derived_target=opts.allow_derived_target)))
        if tag_drafters:  # the first tag's pair is the run's (served by default)
            made.append((*tag_drafters[0], stages.verify_pair(tag_drafters[0][0], final_t,
                                                               allow_derived_target=opts.allow_derived_target)))
        # served untuned: the first drafter verify takes (the user's order)
        served = next((i for i, (_, _, r) in enumerate(made) if not r.errors), 0)
        final_d, made_d, report = made[served]
        if projector is not None:  # the pair's verdict covers the projector served with it
            report.extend(check_projector(read_gguf(projector[0]), read_gguf(final_t)))
        tags = tuple(TagRecord(tag, self._output(f_t, m_t), self._output(f_d, m_d),
                               judge_tag(report, tag, f_d, f_t, allow_derived_target=opts.allow_derived_target)
                               if i else DrafterVerdict(not report.errors, len(report.errors), len(report.warnings)))
                     for i, (tag, (f_t, m_t), (f_d, m_d)) in enumerate(zip(opts.tags, tagged, tag_drafters,
                                                                              strict=True))) if tag_drafters else None
        m.outputs = Outputs(self._output(final_t, made_t), self._output(final_d, made_d), tuple(
            replace(self._output(f, info), kind=drafter_kind(read_gguf(f)), source=d.public,
                    verdict=DrafterVerdict(not r.errors, len(r.errors), len(r.warnings)))
            for d, (f, info, r) in zip(drafters, made, strict=True)) if several else None,
            self._output(*projector) if projector is not None else None,
            OutputRecord.of(file_record(self.imatrix, self.imatrix_sha256, m.name_of(self.imatrix)),
                            stages.imatrix_made(self.imatrix)) if self.imatrix is not None else None, tags)
        m.data["tools"] = _tool_versions(self.method, self.opts).to_json()
        m.data["verify"] = report.to_dict() | {"inputs": {  # by name: pair.json may be published
            side: m.name_of(Path(f)) if f else f for side, f in report.inputs.items()}}
        m.data["status"] = "verify-failed" if report.errors else "complete"
        self._remove_superseded(earlier, {final_t.name, *(os.path.relpath(f, self.outdir) for f, _, _ in made),
                                          *(f.name for f, _ in tagged), *(f.name for f, _ in tag_drafters),
                                          *((projector[0].name,) if projector is not None else ()),
                                          *((m.name_of(self.imatrix),) if self.imatrix is not None else ())})
        candidates = [f for f, _, r in made if not r.errors]
        if several:  # the one served beside the target, the others in drafters/
            serve_drafter(m, final_t, final_d if not report.errors else None, None)
        else:
            record_serving(m, final_t, final_d, None)
        tuning, skipped = None, None
        if opts.tune and candidates:
            try:
                tune_options = replace(opts.tune_options or TuneOptions(),
                                       projector=projector[0] if projector is not None else None)
                tuning = tune(final_t, candidates, tune_options, self.tune_progress)
            except LlamaServerNotFound as e:
                skipped = str(e)
                log.warning("--tune: %s", e)
                m.data["tuning"] = {"status": "skipped", "reason": skipped}
                m.save()
            else:
                if several:
                    serve_drafter(m, final_t, measured_winner(tuning), tuning)
                else:
                    record_serving(m, final_t, final_d, tuning)
                picture, why_not = _draw(tuning, self.outdir)
                m.data["tuning"]["plot"] = picture.name if picture else None
                m.save()
                return PipelineResult(self.outdir, m.to_json(), m.record_of(), None, report, False, tuning, None,
                                      picture, why_not, streamed)
        elif opts.tune:
            skipped = "verify refused the pair; nothing was measured"
        return PipelineResult(self.outdir, m.to_json(), m.record_of(), None, report, False, tuning, skipped,
                              streamed=streamed)

    def tune_progress(self, done: int, total: int, label: str) -> None:
        if self._tune_bar is None:
            self._tune_bar = self.progress("tune")
        self._tune_bar(done, total)

    def streaming(self, target: Source, names: list[str], gguf_path: Path | None
                  ) -> contextlib.AbstractContextManager[tuple[ShardStream, Callable[[], StreamSummary]]]:
        """The target's shards streaming in (``stream.streamed``) while the target and its projector are made. With
        --no-keep-source each is removed once consumed when the tags read the checkpoint once (one pass, or one
        16-bit conversion), the shards of the projector's towers once the projector is made too; else at the end of
        the stage."""
        opts = self.opts
        once = stream.reads_once(opts)
        projector = self.makes_projector(target, gguf_path)
        into = None if opts.keep_source else stream.source_dir(self.work, target)
        name = model_name(target.repo, target.path)
        # fetched from the start, beside the vocabulary's build; but a rerun whose targets are all here (likely
        # vouched for) fetches only what its conversion asks for, if anything
        eager = not all((self.outdir / gguf_name(name, tag)).exists() for tag in opts.tags)

        @contextlib.contextmanager
        def opened() -> Iterator[tuple[ShardStream, Callable[[], StreamSummary]]]:
            with _bar(self.progress, "download target") as bar, \
                    stream.streamed(target, names, into, remove_consumed=once, eager=eager, progress=bar) as opened:
                if projector:  # the towers' shards, from the headers: read again after the target's pass
                    opened[0].hold(stages.projector_reads(target.path))
                yield opened

        return opened()

    def working_ahead(self, target: Source) -> contextlib.AbstractContextManager[object]:
        """The target conversion's work ahead of its vocabulary (``stages.working_ahead_of_target``): a head start
        when its one pass is to make the output afresh (an output already there may be vouched for, and its head
        start wasted), else the weights read ahead."""
        quant = self.opts.target_type
        final = self.outdir / gguf_name(model_name(target.repo, target.path), quant)
        # several tags are written together, never from one tag's head start: their read is warmed instead
        one_pass = (makes_in_one_pass(self.opts, quant, target=True) and not final.exists()
                    and not self.opts.several_tags and not self.opts.uses_imatrix
                    and not self.opts.target_overrides.given)  # by the default rules only
        return stages.working_ahead_of_target(target.path, final, quant if one_pass else None, self.opts.drop_mtp)

    # -------------------------------------------------------------------------------------------- stages

    def tokenizer(self, target: Source) -> stages.TokenizerStage:
        overlay = self.work / "tokenizer" / model_name(target.repo, target.path)
        if not stages.needs_overlay(target.path):
            return stages.prepare_tokenizer(target.path, overlay)
        key = {"target": target.identity(), "tool": self.tool}
        if self.manifest.reusable("tokenizer", key, [overlay / "tokenizer.model"]) \
                and (tok := stages.existing_overlay(overlay)) is not None:
            return tok
        tok = stages.prepare_tokenizer(target.path, overlay)
        self.manifest.record("tokenizer", key, [overlay / "tokenizer.model"])
        return tok

    def target(self, target: Source, tok: stages.TokenizerStage,
               gguf_path: Path | None) -> tuple[Path, Made]:
        name = model_name(target.repo, target.path)
        quant = self.opts.target_type
        if gguf_path is not None:
            kind = stages.gguf_type(gguf_path)
            if kind in ("quantized", quant):
                link = stages.link_into(self.outdir, gguf_path)
                return link, Made(kind, f"--target-gguf {stages.method_detail(self.method)}")
            key = {"method": "gguf", "source": gguf_path.name, "size": gguf_path.stat().st_size,
                   "mtime_ns": gguf_path.stat().st_mtime_ns}
            self.imatrix = self._imatrix_into_folder(name)
            if self.opts.split.given:  # only when given: outputs made before the option existed stay reusable
                key["split"] = self.opts.split.to_json()
            final = self.outdir / gguf_name(name, quant)
            return final, self._quantized_side("target", key, lambda out: None, gguf_path, final, quant,
                                               keep_input=True)

        src = checkpoint_type(target.path)
        key = self._target_key(target, tok, src)
        convert = self._target_converter(target, tok, src)
        self.imatrix = self._imatrix_into_folder(name)
        builtin = isinstance(self.method, stages.BuiltinConverter)
        one_pass = convert if builtin and makes_in_one_pass(self.opts, quant, target=True) else None
        final = self.outdir / gguf_name(name, quant)
        inter = self.outdir / gguf_name(name, src)
        return final, self._side("target", key, convert, inter, final, quant, src, one_pass)

    def _target_key(self, target: Source, tok: stages.TokenizerStage, src: str) -> dict[str, Any]:
        """What the target's conversion depends on (its stage key)."""
        key: dict[str, Any] = {"method": self.method.kind, "detail": stages.method_detail(self.method),
                               "source": target.identity(), "tokenizer": tok.model_sha256, "outtype": src,
                               "tool": self.tool}
        if self.opts.drop_mtp:  # only when set: outputs made before the option existed stay reusable
            key["drop_mtp"] = True
        if self.opts.split.given:
            key["split"] = self.opts.split.to_json()
        return key

    def _target_converter(self, target: Source, tok: stages.TokenizerStage, src: str
                          ) -> Callable[..., str | None]:
        """``convert(out, quant=None)``: the target converted to ``out`` (with ``quant``, quantized in one pass by
        the built-in converter); returns the sha256 hashed while writing, None for llama.cpp's converter."""
        sources = Provenance(None, target.repo_spec, None, tok.provenance())

        def convert_builtin(out: Path, quant: str | None = None) -> str | None:
            with _bar(self.progress, "convert target") as bar:
                return stages.convert_target_builtin(target.path, out, src, tok, sources, bar, quant,
                                                     self.opts.drop_mtp, self._importance() if quant else None,
                                                     self.opts.target_overrides if quant else NO_OVERRIDES)

        def convert_with_llama_cpp(out: Path) -> str | None:
            assert self.opts.llama_cpp is not None
            stages.convert_target_llama_cpp(self.opts.llama_cpp, tok, target.path, out, src, self.work,
                                            self.opts.drop_mtp)
            return None  # an external tool's output: hashed by reading it

        return convert_builtin if isinstance(self.method, stages.BuiltinConverter) else convert_with_llama_cpp

    def tag_targets(self, target: Source, tok: stages.TokenizerStage) -> list[tuple[Path, Made]]:
        """Every --quant tag's target, in the order given, from one read of the checkpoint: the tags the built-in
        converter makes in one pass are written together (each chunk read once, made into each tag's type); the
        others are quantized from the 16-bit conversion, made once for all of them (``target.intermediate``)."""
        name = model_name(target.repo, target.path)
        src = checkpoint_type(target.path)
        key = self._target_key(target, tok, src)
        convert = self._target_converter(target, tok, src)
        self.imatrix = self._imatrix_into_folder(name)
        builtin = isinstance(self.method, stages.BuiltinConverter)
        tags = self.opts.tags
        finals = {tag: self.outdir / gguf_name(name, tag) for tag in tags}
        inter = self.outdir / gguf_name(name, src)
        made: dict[str, Made] = {}
        together = [tag for tag in tags if builtin and self.opts.type_of(tag) != src
                    and makes_in_one_pass(self.opts, tag, target=True)]
        keys = {tag: {**key, "quant": tag, "one_pass": "builtin", **self._one_pass_key(tag)} for tag in together}
        todo = [tag for tag in together if not self.manifest.reusable(
            f"{tag_side(tag, tags)}.convert", keys[tag],
            self._finals(tag_side(tag, tags), f"{tag_side(tag, tags)}.convert", finals[tag]))]
        if todo:
            log.info("target: converting and quantizing in one pass to %s", ", ".join(finals[t].name for t in todo))
            with _bar(self.progress, f"convert target to {len(todo)} tags") as bar:
                shas = stages.convert_target_tags_builtin(
                    target.path, [(finals[t], self.opts.type_of(t), self.opts.overrides_of(t)) for t in todo], src,
                    tok, Provenance(None, target.repo_spec, None, tok.provenance()), bar, self.opts.drop_mtp,
                    self._importance())
            for tag, sha in zip(todo, shas, strict=True):
                self._record_final(tag_side(tag, tags), f"{tag_side(tag, tags)}.convert", keys[tag], finals[tag], sha)
        for tag in together:
            made[tag] = Made(self.opts.type_of(tag), "built-in converter and quantizer in one pass")
        from_16_bit = [tag for tag in tags if tag not in together]
        convert_stage = "target.intermediate"
        if src in from_16_bit:  # the conversion itself is a tag: it is the file the others are quantized from
            made[src] = self._side(tag_side(src, tags), key, convert, inter, finals[src], src, src)
            convert_stage = f"{tag_side(src, tags)}.convert"
            inter = self._served(finals[src], tag_side(src, tags))  # split: its first shard
        quantized = [tag for tag in from_16_bit if tag != src]
        for i, tag in enumerate(quantized):
            made[tag] = self._quantized_side(tag_side(tag, tags), key, convert, inter, finals[tag], tag,
                                             convert_stage=convert_stage,
                                             last_use=i == len(quantized) - 1 and src not in tags)
        if inter.exists() and src not in tags and not self.opts.keep_intermediate:
            inter.unlink()  # left by an earlier run
        return [(finals[tag], made[tag]) for tag in tags]

    def _importance(self) -> Importance | None:
        """The --imatrix file as the built-in quantizer reads it (loaded once), or None without one."""
        if self.imatrix is None:
            return None
        if self._loaded_importance is None:
            self._loaded_importance = load_importance(self.imatrix)
        return self._loaded_importance

    def _one_pass_key(self, tag: str) -> dict[str, Any]:
        """What a one-pass target's stage key records of its quantization settings: the matrix and the tag's
        per-tensor overrides (nothing of either when not given: earlier outputs stay reusable)."""
        key: dict[str, Any] = {}
        if (overrides := self.opts.overrides_of(tag)).given:
            key["overrides"] = overrides.args()
        if self.imatrix is not None:
            key["imatrix"] = {"file": self.imatrix.name, "size": self.imatrix.stat().st_size,
                              "sha256": self.imatrix_sha256}
        return key

    def _imatrix_into_folder(self, name: str) -> Path | None:
        """The --imatrix file copied into ``imatrix/`` of the folder (``imatrix-<name>.gguf``, or ``.dat`` for the
        legacy format): the folder then holds what its target was made with, llama-quantize is given it by name
        (it writes the path into the GGUF as given), and publish uploads it. Not at the folder's root: llama-server's
        --models-dir router would take any other ``.gguf`` there for the model (``load_from_models_dir``)."""
        self.imatrix_name = name
        given = self.opts.imatrix
        if given is None:
            return None
        suffix = ".gguf" if stages.is_gguf(Path(given)) else ".dat"
        dest = self.outdir / IMATRIX_DIR / f"imatrix-{name}{suffix}"
        self.imatrix_sha256 = sha256_file(Path(given))  # read once: the stage key and pair.json take it from here
        if not (dest.is_file() and dest.stat().st_size == Path(given).stat().st_size
                and sha256_file(dest) == self.imatrix_sha256):
            dest.parent.mkdir(exist_ok=True)
            with atomic_output(dest) as tmp:
                shutil.copyfile(given, tmp)
        return dest

    def makes_projector(self, target: Source, gguf_path: Path | None) -> bool:
        """Whether this run makes the target's projector: it has a vision or audio tower, --no-mmproj is not given,
        and its checkpoint is here (with --target-gguf its weights are not fetched)."""
        if not self.opts.mmproj or not stages.has_projector(target.path):
            return False
        if gguf_path is not None:
            log.warning("%s has vision/audio towers, but with --target-gguf its weights are not fetched, so no "
                        "projector is made: serve the mmproj- file published with that GGUF (or leave out "
                        "--target-gguf).", target.label)
            return False
        return True

    def projector(self, target: Source, gguf_path: Path | None) -> tuple[Path, Made] | None:
        """The target's vision/audio projector (``mmproj-<name>-<TYPE>.gguf``), made from its checkpoint by the
        built-in projector converter; None when it has no tower, with --no-mmproj, or when the target came as a
        GGUF (its checkpoint's weights are not fetched: take the projector published beside that GGUF)."""
        if not self.makes_projector(target, gguf_path):
            return None
        kind = self.opts.mmproj_type
        final = self.outdir / projector_name(model_name(target.repo, target.path), kind)
        key = {"source": target.identity(), "outtype": kind, "tool": self.tool}
        if not self.manifest.reusable("projector", key, [final]):
            log.info("projector: converting to %s", final)
            with _bar(self.progress, "convert projector") as bar:
                sha = stages.convert_projector_builtin(target.path, final, kind,
                                                       Provenance(None, target.repo_spec, None, {}), bar)
            self.manifest.record("projector", key, [final], hashes={final: sha})
        return final, Made(kind, "built-in projector converter")

    def tag_drafters(self, drafter: Source, target: Source, tok: stages.TokenizerStage, targets: list[Path]
                     ) -> list[tuple[Path, Made]]:
        """The drafter served with each tag's target (``targets``, in the order of --quant): one sidecar per drafter
        type, each recording the target file of the first tag it serves (``dflash-verify DRAFTER.gguf`` finds it)."""
        types = self.opts.drafter_types()
        made: dict[str, tuple[Path, Made]] = {}
        for draft_quant, target_file in zip(types, targets, strict=True):
            if draft_quant not in made:
                with stages.reading_ahead(drafter.path):  # while its vocabulary is built
                    made[draft_quant] = self.drafter(drafter, target, tok, target_file.name,
                                                     drafter_side(draft_quant, types), quant=draft_quant)
                jsonfile.forget()
        return [made[t] for t in types]

    def drafter(self, drafter: Source, target: Source, tok: stages.TokenizerStage, target_file: str,
                side: str = "drafter", several: bool = False, quant: str | None = None) -> tuple[Path, Made]:
        name = model_name(drafter.repo, drafter.path)
        src = checkpoint_type(drafter.path)
        key = {"source": drafter.identity(), "target": target.identity(), "tokenizer": tok.model_sha256,
               "target_file": target_file, "outtype": src, "tool": self.tool}

        by_llama_cpp = self.options.drafter_method == "llama-cpp"
        if by_llama_cpp:
            key["method"] = "llama-cpp"

        def convert(out: Path, quant: str | None = None) -> str | None:
            if by_llama_cpp:
                assert self.opts.llama_cpp is not None
                stages.convert_drafter_llama_cpp(self.opts.llama_cpp, drafter, tok, target, out, src, self.work)
                return None  # an external tool's output: hashed by reading it
            with _bar(self.progress, "convert drafter") as bar:
                return stages.convert_drafter_stage(drafter, target, tok, out, src, target_file, bar, quant,
                                                    self.target_fingerprint)

        quant = quant or self.opts.drafter_types()[0]
        final = self.outdir / drafter_file(target, drafter, quant, several)
        final.parent.mkdir(exist_ok=True)
        inter = final.parent / gguf_name(name, src)
        one_pass = convert if makes_in_one_pass(self.opts, quant) and not by_llama_cpp else None
        return final, self._side(side, key, convert, inter, final, quant, src, one_pass)

    # ------------------------------------------------------------------------------------- bookkeeping

    def _remove_superseded(self, earlier: Outputs | None, current: set[str]) -> None:
        """Delete an earlier run's outputs this run no longer makes (a drafter under its pre-sidecar name, another
        --quant), when they are still the files pair.json recorded: llama-server --models-dir wants exactly one
        target and one sidecar per folder."""
        tagged = [r for tag in (earlier.tags or ()) for r in (tag.target, tag.drafter)] if earlier is not None else []
        for rec in (earlier.target, earlier.drafter, earlier.projector, earlier.imatrix, *tagged) \
                if earlier is not None else ():
            if rec is None:
                continue
            name = rec.file
            path = inside(self.outdir, name)  # never a file outside the folder, whatever pair.json says
            if path is None or name in current or not path.is_file() or path.is_symlink():
                continue
            if path.stat().st_size == rec.size and sha256_file(path) == rec.sha256:
                path.unlink()
                log.info("removed %s, made by an earlier run and superseded by this one", name)
                for shard in rec.shards or ():  # the rest of a split target
                    if (other := inside(self.outdir, shard.file)) is not None and other.is_file() \
                            and shard.file not in current and other.stat().st_size == shard.size:
                        other.unlink()

    def _side(self, side: str, key: dict[str, Any], convert: Callable[[Path], str | None], inter: Path,
              final: Path, quant: str, src: str,
              one_pass: Callable[[Path, str], str | None] | None = None) -> Made:
        """Convert (unless pair.json vouches for the file), then quantize; returns how the final was made.
        The converters return the sha256 they computed while writing (None for external tools), so recording
        an output does not read it again."""
        tag, quant = quant, self.opts.type_of(quant)  # a named recipe's tag is made as its base type
        if one_pass is not None and src != quant:
            matrix = self._one_pass_key(tag) if is_target_side(side) else {}
            key = {**key, "quant": quant, "one_pass": "builtin", **matrix}
            if not self.manifest.reusable(f"{side}.convert", key, self._finals(side, f"{side}.convert", final)):
                log.info("%s: converting and quantizing in one pass to %s", side, final)
                sha = one_pass(final, quant)
                self._record_final(side, f"{side}.convert", key, final, sha)
            if inter.exists():
                inter.unlink()  # left by an earlier two-step run
            return Made(quant, "built-in converter and quantizer in one pass")
        if src == quant:
            if not self.manifest.reusable(f"{side}.convert", key, self._finals(side, f"{side}.convert", final)):
                log.info("%s: converting to %s", side, final)
                sha = convert(final)
                self._record_final(side, f"{side}.convert", key, final, sha, converter=True)
            return Made(quant, f"{key.get('method', 'builtin')} converter, not quantized")
        return self._quantized_side(side, key, convert, inter, final, tag)

    def _quantized_side(self, side: str, key: dict[str, Any], convert: Callable[[Path], str | None], inter: Path,
                        final: Path, quant: str, *, keep_input: bool = False, convert_stage: str | None = None,
                        last_use: bool = True) -> Made:
        """``final`` quantized from ``inter`` (converted first unless ``keep_input``: it is the user's file), which is
        removed after its ``last_use`` unless --keep-intermediate; ``convert_stage``: the stage recording ``inter``
        (one for several tags). ``quant``: the tag (a named recipe's is made as its base type, with its rules)."""
        tag, quant = quant, self.opts.type_of(quant)
        convert_stage = convert_stage or f"{side}.convert"
        if is_target_side(side) and self.opts.imatrix_auto and self.imatrix is None:
            self.imatrix = self._auto_imatrix(key, convert, inter, convert_stage, keep_input)
        imatrix = self.imatrix if is_target_side(side) else None
        overrides = self.opts.overrides_of(tag) if is_target_side(side) else NO_OVERRIDES
        q_key = {"input": key, "type": quant,
                 "quantizer": stages.quantizer_choice(quant, self.opts.quantizer, imatrix=imatrix is not None,
                                                      overrides=overrides)}
        if overrides.given:  # only when given: outputs made before the option existed stay reusable
            q_key["overrides"] = overrides.args()
        if imatrix is not None:  # only when given: outputs made before the option existed stay reusable
            q_key["imatrix"] = {"file": Path(imatrix).name, "size": Path(imatrix).stat().st_size,
                                "sha256": self.imatrix_sha256}
        if not self.manifest.reusable(f"{side}.quantize", q_key, self._finals(side, f"{side}.quantize", final)):
            if not keep_input and not self.manifest.reusable(convert_stage, key, [inter]):
                log.info("%s: converting to %s", side, inter)
                sha = convert(inter)
                self.manifest.record(convert_stage, key, [inter], hashes={inter: sha})
            log.info("%s: quantizing to %s", side, final)
            with _bar(self.progress, f"quantize {side}") as bar:
                q = stages.quantize_stage(inter, final, quant, self.opts.threads, self.opts.quantizer, bar,
                                          imatrix=imatrix, overrides=overrides)
            self._record_final(side, f"{side}.quantize", q_key, final, q.sha256, quantizer=q.quantizer,
                               quantizer_version=q.version)
        if not keep_input and last_use and not self.opts.keep_intermediate and inter.exists():
            inter.unlink()
            log.info("%s: removed the intermediate %s", side, inter.name)
        rec = self.manifest.stages[f"{side}.quantize"]
        made_by = f"{rec.quantizer} quantizer: {rec.quantizer_version or '?'}"
        kept = self.opts.keep_intermediate and not keep_input and inter.exists()
        return Made(quant, made_by, self._record_of(inter, convert_stage) if kept else None)

    def _auto_imatrix(self, key: dict[str, Any], convert: Callable[[Path], str | None], inter: Path,
                      convert_stage: str, keep_input: bool) -> Path:
        """--imatrix auto: b11434's llama-imatrix on the run's 16-bit target (``inter``, converted first when needed)
        over the calibration text, into ``imatrix/imatrix-<name>.gguf``; reused while the target's conversion key,
        the text's sha256, the context, the chunks and the tool are the same (the ``imatrix`` stage), and taken from
        :mod:`made_cache` when any earlier run, into any folder, made it from the same inputs."""
        text = self.calibration
        assert text is not None, "run_pipeline resolves --calibration before the run"
        dest = self.outdir / IMATRIX_DIR / f"imatrix-{self.imatrix_name}.gguf"
        text_sha = sha256_file(text.path)
        ikey = {"target": key, "text": {"name": text.spec, "sha256": text_sha},
                "ctx": self.opts.calibration_ctx, "chunks": self.opts.calibration_chunks,
                "tool": imatrix_tool()}
        if not self.manifest.reusable("imatrix", ikey, [dest]):
            # llama-imatrix records the text's file name in the matrix (and llama-quantize copies it into the quants)
            made_key = {"target": key, "text": {"file": Path(text.path).name, "sha256": text_sha},
                        "ctx": self.opts.calibration_ctx, "chunks": self.opts.calibration_chunks,
                        "tool": ikey["tool"]}
            dest.parent.mkdir(exist_ok=True)
            kept = made_cache.lookup("imatrix", made_key, ".gguf")
            if kept is not None:
                log.info("importance matrix: made earlier for the same target and text, taken from %s", kept.path)
                with atomic_output(dest) as tmp:
                    shutil.copyfile(kept.path, tmp)
            else:
                if not keep_input and not self.manifest.reusable(convert_stage, key, [inter]):
                    log.info("target: converting to %s", inter)
                    sha = convert(inter)
                    self.manifest.record(convert_stage, key, [inter], hashes={inter: sha})
                log.info("importance matrix: llama-imatrix on %s over %s", inter.name, text.name)
                make_imatrix(inter, text.path, dest, ctx=self.opts.calibration_ctx,
                             chunks=self.opts.calibration_chunks, threads=self.opts.threads)
                made_cache.keep("imatrix", made_key, dest, ".gguf")
            self.manifest.record("imatrix", ikey, [dest])
        self.imatrix_sha256 = self.manifest.stages["imatrix"].outputs[0].sha256
        return dest

    def _finals(self, side: str, stage: str, final: Path) -> list[Path]:
        """What ``stage`` wrote for ``final``: the file, or the shards it was split into (--split-max-size)."""
        rec = self.manifest.stages.get(stage)
        if not is_target_side(side) or not self.opts.split.given or rec is None or len(rec.outputs) < 2:
            return [final]
        names = [self.manifest.name_of(shard_path(final, k, len(rec.outputs)))
                 for k in range(1, len(rec.outputs) + 1)]
        return [self.outdir / n for n in names] if [o.file for o in rec.outputs] == names else [final]

    def _record_final(self, side: str, stage: str, key: dict[str, Any], final: Path, sha: str | None, *,
                      converter: bool = False, **extra: Any) -> None:
        """Record ``stage``'s final output; with --split-max-size and a target above it, split it first and record
        the shards (the single file removed): byte for byte b11434's converter's for an unquantized target
        (``converter``), llama-gguf-split's for a quantized one."""
        shards: list[tuple[Path, str]] = []
        if is_target_side(side) and self.opts.split.given:
            with _bar(self.progress, "split target") as bar:
                shards = split_gguf(final, self.opts.split, converter=converter, on_progress=bar)
        if not shards:  # not asked for, or the target fits in one
            self.manifest.record(stage, key, [final], hashes={final: sha}, **extra)
            return
        log.info("target: split %s into %d shards (%s)", final.name, len(shards), self.opts.split.describe())
        final.unlink()
        self.manifest.record(stage, key, [p for p, _ in shards], hashes=dict(shards), **extra)

    def _served(self, final: Path, side: str = "target") -> Path:
        """The file llama.cpp is given for ``final``: itself, or the first shard its stage recorded."""
        if final.is_file():
            return final
        for stage in (f"{side}.quantize", f"{side}.convert"):
            shards = self._finals(side, stage, final)
            if len(shards) > 1 and shards[0].is_file():
                return shards[0]
        return final

    def _record_of(self, path: Path, stage: str | None = None) -> FileRecord:
        """size + sha256 of an output, from the stage that recorded it when there is one."""
        for name, rec in self.manifest.stages.items():
            if stage is not None and name != stage:
                continue
            for f in rec.outputs:
                if f.file == self.manifest.name_of(path) and path.is_file() and path.stat().st_size == f.size:
                    return f
        return file_record(path, name=self.manifest.name_of(path))

    def _output(self, path: Path, made: Made) -> OutputRecord:
        """The record of a final output: where it is, how it was made, and what it links to when it is a link."""
        links_to = Path(os.readlink(path)).name if path.is_symlink() else None  # a name: pair.json may be published
        name = self.manifest.name_of(path)
        shards = next((rec.outputs[1:] for rec in self.manifest.stages.values()
                       if len(rec.outputs) > 1 and rec.outputs[0].file == name), None)
        return OutputRecord.of(self._record_of(path), made, links_to=links_to, shards=shards)
