"""The built-in target converter: a Hugging Face decoder checkpoint -> the GGUF llama.cpp b11434 writes.

``convert_target`` reads the config, picks the family module for ``architectures[0]``, plans every
tensor (names, order, types, shapes, b11434's ``modify_tensors`` transformations) and every key
(``general.*``, the family's ``set_gguf_parameters``, the vocabulary), checks it all against the
checkpoint, and only then streams the tensors into ``<out>.partial`` and renames it. Unchanged tensors
are copied file to file; type changes and transformations go through bounded chunks.

This package is also the registry of target architectures: every module in it that declares ``ARCHS`` is a target
family, found by :data:`TARGET_ARCHS`, :func:`by_hf` and :func:`by_gguf`; nothing else lists them. A new family is a
module with these parts:

* ``ARCHS: tuple[TargetArch, ...]``: its architectures' rows of facts (``configs.TargetArch``: the GGUF name, the
  HF ``architectures[0]`` values, the b11434 graph, whether a drafter can tap it, its MTP graph, the vocabulary
  path). A module with ``ARCHS`` alone describes targets the built-in converter does not convert.
* ``FAMILY`` (optional): a :class:`~.base.TextFamily` subclass mirroring the b11434 class
  (``conversion/<family>.py``); it converts every HF class of its ``ARCHS``.
  Set ``gguf_arch`` (general.architecture, from its row) and ``tensor_map`` (normalised HF name with ``{bid}`` ->
  GGUF name, no ``.weight``). Override only what the b11434 class overrides:

  - ``load_hparams(raw)`` (classmethod): ``self.hparams`` as b11434 sees them (e.g. transformers
    config defaults); the default merges ``text_config`` into the root;
  - ``check_config()``: refusals (ConfigError, UnsupportedModelError), before any tensor is read;
  - ``expected_shapes()``: (required, optional) GGUF name -> HF shape implied by the config; a tensor
    outside both is refused as unknown, a missing required one as missing, any other shape as wrong;
  - ``normalise_name`` / ``skip``: b11434's ``filter_tensors``;
  - ``modify(spec, hf_name)`` / ``extra_tensors()``: ``modify_tensors`` / ``generate_extra_tensors``,
    returning :class:`~.base.TensorSpec` (``row_order`` / ``transform`` are streamed chunk-wise,
    e.g. Llama's q/k permutation);
  - ``force_f32(name)``: tensors b11434 keeps in F32 whatever the outtype;
  - ``add_hparams(plan, ftype)``: ``set_gguf_parameters``; call ``add_text_hparams(self, plan, ftype)``
    first, as b11434's ``super()`` does;
  - ``add_vocab(plan)``: ``set_vocab``; the default is the drafter converter's target-vocabulary code.

The framework does the rest the same way for every family: the multimodal filter, unknown /
missing / mis-shaped / non-float tensors refused before writing, the output type of each tensor, the
``general.*`` and provenance keys, the atomic write.

A family whose checkpoints carry vision or audio towers may also expose ``PROJECTOR`` (HF class -> a
:class:`~.projector.ProjectorFamily` subclass mirroring b11434's ``MmprojModel`` subclass): :func:`projector_for`,
:func:`has_projector` and :func:`convert_projector` write the file ``convert_hf_to_gguf.py --mmproj`` writes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import pkgutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ... import provenance as prov
from ...errors import ConfigError, DflashGgufError, NotCoveredError, TensorError
from ...ggufio import GGUFPlan, TensorOut
from ...ggufio.layout import GGML_QUANT_VERSION, pad
from ...ggufio.readahead import warm_up
from ...hf_configs import read_config
from ...quantize.ahead import HeadStart
from ...quantize.builtin import NO_OVERRIDES, Overrides, QuantOutput, TensorJob, ahead_jobs, input_from_plan
from ...quantize.builtin import plan_tensors as quant_plan
from ...quantize.imatrix import Importance
from ..configs import TargetArch, TargetConfig, parse_target_config
from ..general import add_general
from ..outtype import OUTTYPES, resolve_outtype, tensor_type
from ..result import ConvertResult, finish, target_record
from ..safetensors import TensorRef, index_checkpoint
from ..vocab import VocabInfo
from .base import TargetSource, TensorSpec, TextFamily, add_text_hparams, block_id, trimmed_rows
from .projector import ProjectorFamily, ProjectorSource, build_projector_plan, plan_projector
from .writers import spec_writer

log = logging.getLogger(__name__)

# Every module of this package that declares ARCHS is a target family (the shared machinery declares none).
_FAMILY_MODULES = {name: module for name, module in (
    (m.name, importlib.import_module(f"{__name__}.{m.name}")) for m in pkgutil.iter_modules(__path__))
    if hasattr(module, "ARCHS")}
TARGET_ARCHS: tuple[TargetArch, ...] = tuple(arch for module in _FAMILY_MODULES.values() for arch in module.ARCHS)
_BY_GGUF = {arch.gguf: arch for arch in TARGET_ARCHS}
_BY_HF = {hf: arch for arch in TARGET_ARCHS for hf in arch.hf}
# HF architectures[0] -> the family module whose FAMILY converts it
SUPPORTED_ARCHITECTURES: dict[str, str] = {hf: name for name, module in _FAMILY_MODULES.items()
                                           if hasattr(module, "FAMILY") for arch in module.ARCHS for hf in arch.hf}
# HF architectures[0] -> the projector class of its family module (PROJECTOR), for --mmproj files
PROJECTORS: dict[str, type[ProjectorFamily]] = {hf: cls for module in _FAMILY_MODULES.values()
                                                for hf, cls in getattr(module, "PROJECTOR", {}).items()}


def by_gguf(name: str | None) -> TargetArch | None:
    """The row of a ``general.architecture``."""
    return _BY_GGUF.get(name or "")


def by_hf(name: str | None) -> TargetArch | None:
    """The row of a config.json ``architectures[0]``."""
    return _BY_HF.get(name or "")


def drafter_vocab_archs() -> tuple[str, ...]:
    """HF class names whose vocabulary the drafter converter embeds."""
    return tuple(hf for arch in TARGET_ARCHS if arch.drafter_vocab for hf in arch.hf)


def read_target_config(target_dir: Path) -> TargetConfig:
    """The target's config.json, with its architecture's row of facts.

    Raises:
        ConfigError: missing or unparsable config, no architecture or hidden size.
    """
    return parse_target_config(Path(target_dir), by_hf)


def _architecture(model_dir: Path) -> tuple[str | None, dict[str, Any]]:
    raw = read_config(Path(model_dir) / "config.json", "Target config")
    text = raw.get("text_config") or {}
    archs = text.get("architectures") or raw.get("architectures") or [None]
    return archs[0], raw


def builtin_family(model_dir: Path) -> str | None:
    """The family when the built-in converter covers config.json's architectures, else None.

    Raises:
        ConfigError: config.json is missing or unreadable.
    """
    return SUPPORTED_ARCHITECTURES.get(_architecture(model_dir)[0] or "")


def unsupported_message(path: Path, arch: str | None) -> str:
    """One paragraph: what is supported, and the two ways out."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    return (f"{path}: target architecture {arch!r} is not one the built-in target converter covers "
            f"(supported: {supported}). Either convert the target with llama.cpp's own converter (the pipeline "
            "does so with --llama-cpp DIR, a llama.cpp checkout with convert_hf_to_gguf.py and its Python "
            "requirements), or pass an existing GGUF of the target with --target-gguf.")


def family_for(model_dir: Path, tokenizer_dir: Path | None = None, cls: type[TextFamily] | None = None, *,
               drop_mtp: bool = False) -> TextFamily:
    """The family object for a target dir, with its checkpoint indexed and config checked.

    ``cls`` forces a family outside the target registry (a drafter converted by a target-style b11434 class,
    e.g. the Gemma-4 assistant). ``drop_mtp``: b11434's ``--no-mtp`` (a family without an MTP head ignores it).

    Raises:
        ConfigError, UnsupportedModelError, TensorError, InputError.
    """
    model_dir = Path(model_dir)
    arch, raw = _architecture(model_dir)
    if arch is None:
        raise ConfigError(f"{model_dir / 'config.json'}: no 'architectures' field, so the model family is "
                          "unknown. Use the config.json published with the model.")
    if cls is None:
        family_name = SUPPORTED_ARCHITECTURES.get(arch)
        if family_name is None:
            raise NotCoveredError(unsupported_message(model_dir / "config.json", arch))
        cls = _FAMILY_MODULES[family_name].FAMILY
    config = read_target_config(model_dir)
    hparams = cls.load_hparams(raw)
    src = TargetSource(model_dir, Path(tokenizer_dir or model_dir), config, hparams, index_checkpoint(model_dir))
    fam = cls(src, drop_mtp=drop_mtp)
    fam.check_config()
    return fam


def plan_tensors(fam: TextFamily) -> list[TensorSpec]:
    """Every output tensor in b11434's order; refuse unknown, missing, mis-shaped or non-float tensors.

    Raises:
        TensorError: each problem named with the tensor, the file and the fix.
    """
    src = fam.src
    required, optional = fam.expected_shapes()
    specs: list[TensorSpec] = list(fam.extra_tensors())
    unknown: list[str] = []
    seen: dict[str, str] = {}
    for hf_name, ref in src.tensors.items():
        if fam.skip(hf_name):
            continue
        name = fam.normalise_name(hf_name)
        gguf_name = fam.gguf_name(name)
        want = required.get(gguf_name) if gguf_name else None
        want = want if want is not None else optional.get(gguf_name or "")
        if gguf_name is None or want is None:
            unknown.append(hf_name)
            continue
        if gguf_name in seen:
            raise TensorError(f"{ref.path}: tensors {seen[gguf_name]!r} and {hf_name!r} both map to {gguf_name}. "
                              "The checkpoint mixes two layouts; re-download it.")
        seen[gguf_name] = hf_name
        if ref.dtype not in ("BF16", "F16", "F32") and not fam.dequantizes(hf_name):
            raise TensorError(f"{ref.path}: tensor {hf_name!r} has dtype {ref.dtype}. The built-in converter reads "
                              "BF16/F16/F32 checkpoints; for FP8 or pre-quantized weights use llama.cpp's "
                              "converter (--llama-cpp DIR).")
        if tuple(ref.shape) != tuple(want):
            raise TensorError(
                f"{ref.path}: tensor {hf_name!r} has shape {list(ref.shape)}, but {src.config.path} implies "
                f"{list(want)}. The config and the weights do not belong together: re-download the checkpoint "
                "(config.json and every shard from the same revision).")
        specs.extend(fam.modify(TensorSpec(gguf_name, ref.shape, ref=ref), hf_name))
    if unknown:
        more = f" and {len(unknown) - 6} more" if len(unknown) > 6 else ""
        raise TensorError(
            f"{src.model_dir}: tensor(s) {unknown[:6]}{more} are not part of a {fam.gguf_arch} model as "
            f"{src.config.path.name} describes it (architecture {src.config.arch}). llama.cpp b11434's converter "
            "would stop with 'Can not map tensor' or write a file its loader rejects. Check that config.json and "
            "the weights come from the same model, or convert it with llama.cpp's converter (--llama-cpp DIR).")
    if missing := [n for n in required if n not in seen]:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise TensorError(
            f"{src.model_dir}: tensor(s) missing from the checkpoint: {missing[:6]}{more} (GGUF names), required by "
            f"{src.config.path.name} ({fam.block_count} layers). llama.cpp would fail at load with "
            "'missing tensor'. Download the complete checkpoint (every shard of model.safetensors.index.json).")
    return specs


def convert_target(model_dir: Path, outfile: Path, outtype: str = "auto", *,
                   tokenizer_dir: Path | None = None,
                   provenance: dict[str, str] | None = None,
                   quant: str | None = None,
                   dry_run: bool = False,
                   read_ahead: bool = True,
                   drop_mtp: bool = False,
                   on_progress: Callable[[int, int], None] | None = None,
                   more: Sequence[QuantOutput] = (), importance: Importance | None = None,
                   overrides: Overrides = NO_OVERRIDES) -> ConvertResult:
    """Convert a target checkpoint into the GGUF llama.cpp b11434's convert_hf_to_gguf.py writes.

    ``tokenizer_dir`` (default ``model_dir``) is where the tokenizer files are read; ``provenance`` adds
    our own ``dflash_gguf.*`` keys (``provenance.Provenance.keys()``). ``quant`` ("q4_0", "q8_0", ...)
    quantizes in the same pass: the bytes of converting to ``outtype`` and then running llama-quantize
    (its Q6_K output rule included), with no intermediate file. ``read_ahead=False``: the caller already
    works ahead itself (:func:`working_ahead`; the pipeline does, from its first stage on), so the vocabulary is
    built without. ``drop_mtp``: as b11434's ``--no-mtp``, a multi-token-prediction head is left out (the target's
    own ``draft-mtp`` drafting then cannot be served). ``more``: further (file, type) outputs of the same one pass
    (several quant tags from one read of the checkpoint; ``quant`` is the first). ``importance``: an importance
    matrix the one pass quantizes with, as llama-quantize --imatrix does; ``overrides``: llama-quantize's
    per-tensor flags (``--tensor-type`` recipes among them) for the one pass.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, TokenizerError, InputError, OutputError: each
        one paragraph naming the file, the field and the fix; nothing is written.
    """
    start = time.perf_counter()
    model_dir = Path(model_dir)
    fam = family_for(model_dir, tokenizer_dir, drop_mtp=drop_mtp)
    specs = plan_tensors(fam)
    one_pass_defaults = not (more or importance or overrides.given)  # the head start quantizes by the default rules
    ahead = (working_ahead(fam, specs, Path(outfile), outtype, quant if one_pass_defaults else None)
             if read_ahead and not dry_run else contextlib.nullcontext())
    with ahead:  # the disk streams, and the output's first tensor is quantized, while the vocabulary builds
        plan, vocab, outtype = build_plan(fam, outtype, (provenance or {}).get(prov.TARGET_REPO) or model_dir.name,
                                          specs)
        recorded = target_record(fam.src.model_dir, fam.src.config.path, fam.src.config.arch, vocab.sha256,
                                 provenance)
        return finish(plan, Path(outfile), outtype, vocab, tuple(fam.notes), recorded, start, quant=quant,
                      dry_run=dry_run, on_progress=on_progress, more=more, importance=importance,
                      overrides=overrides)


@contextlib.contextmanager
def working_ahead(fam: TextFamily, specs: list[TensorSpec], outfile: Path, outtype: str, quant: str | None
                  ) -> Iterator[HeadStart | None]:
    """What a conversion can do before its vocabulary is built, done while the caller builds it.

    With ``quant`` (the one pass), a :class:`~...quantize.ahead.HeadStart` quantizes the output's first tensors
    beside ``outfile`` on the free core, reading them just in time; it is yielded. Without, the weights are read
    into the page cache in the converter's order (:func:`~...ggufio.readahead.warm_up`), which the copies that
    follow then find there. Why not both: on this project's VM, pages read seconds before their use cost the one
    pass more system time than reading them from the disk when needed (the README's speed section)."""
    jobs = _quant_jobs(fam, specs, outfile, outtype, quant) if quant is not None else None
    if jobs is None:
        with warm_up((ref.path, ref.offset, ref.nbytes) for ref in _refs(specs)):
            yield None
        return
    with HeadStart(ahead_jobs(jobs, outfile), outfile.parent, outfile.name,
                   reserve=sum(pad(j.dst_nbytes) for j in jobs)) as head:
        yield head


def _quant_jobs(fam: TextFamily, specs: list[TensorSpec], outfile: Path, outtype: str, quant: str
                ) -> list[TensorJob] | None:
    """The one pass's tensors as the quantizer will write them, in its order; None when they cannot be planned (the
    conversion itself reports why)."""
    plan = GGUFPlan(fam.gguf_arch)
    try:
        for tensor in _tensor_outs(fam, specs, outtype)[0]:
            plan.add_tensor(tensor)
        return quant_plan(input_from_plan(plan, outfile), quant).jobs
    except DflashGgufError:
        return None


def _refs(specs: list[TensorSpec]) -> list[TensorRef]:
    """Every checkpoint tensor the specs read, a stacked tensor's parts included (what the read-ahead warms)."""
    return [ref for spec in specs for ref in spec.sources]


def _tensor_outs(fam: TextFamily, specs: list[TensorSpec], outtype: str) -> tuple[list[TensorOut], str]:
    """The output tensors of ``specs`` in order, and the outtype ``auto`` resolved to."""
    outtype = resolve_outtype(outtype, (s.ref for s in specs if s.ref is not None and s.data is None))
    qtype = OUTTYPES[outtype][1]
    out = []
    for spec in specs:
        tq = tensor_type(spec.name, spec.shape, qtype, spec.force_f32 or fam.force_f32(spec.name))
        tq = spec.raw_type if spec.raw_type is not None else tq  # bytes already in a ggml type (MXFP4)
        write, source = spec_writer(spec, tq)
        out.append(TensorOut(spec.name, tuple(reversed(spec.shape)), tq, write, source, spec.read_paths))
    return out, outtype


def build_plan(fam: TextFamily, outtype: str, name: str, specs: list[TensorSpec] | None = None
               ) -> tuple[GGUFPlan, VocabInfo, str]:
    """Every tensor and key of a checked family, in b11434's order (no provenance keys): (plan, vocab, outtype).
    ``specs``: the family's :func:`plan_tensors`, when the caller has them already.

    Raises:
        TensorError, TokenizerError, ConfigError: as :func:`plan_tensors` and the family's vocabulary.
    """
    specs = plan_tensors(fam) if specs is None else specs
    tensors, outtype = _tensor_outs(fam, specs, outtype)
    plan = GGUFPlan(fam.gguf_arch)
    add_general(plan, name, fam.src.model_dir)
    for tensor in tensors:
        plan.add_tensor(tensor)
    fam.add_hparams(plan, OUTTYPES[outtype][0])
    plan.add_uint32("general.quantization_version", GGML_QUANT_VERSION)
    return plan, fam.add_vocab(plan), outtype


# ------------------------------------------------------------------------------------------ projectors (--mmproj)
def _projector_class(raw: dict[str, Any]) -> tuple[str | None, type[ProjectorFamily] | None]:
    """(HF class, projector class): b11434 picks an mmproj class by vision_config's ``architectures`` when it has
    one, else the top level's; None when the config describes no tower (no vision_config, no audio_config)."""
    vision = raw.get("vision_config")
    archs = (vision.get("architectures") if isinstance(vision, dict) else None) or raw.get("architectures") or [None]
    arch = archs[0] if isinstance(archs[0], str) else None
    if vision is None and raw.get("audio_config") is None:
        return arch, None
    return arch, PROJECTORS.get(arch or "")


def has_projector(model_dir: Path) -> bool:
    """Whether the built-in converter writes a projector for this target (its family has one and config.json
    describes a vision or audio tower); from config.json alone.

    Raises:
        ConfigError: config.json is missing or unreadable.
    """
    return _projector_class(read_config(Path(model_dir) / "config.json", "Target config"))[1] is not None


def projector_for(model_dir: Path, *, with_tensors: bool = True) -> ProjectorFamily | None:
    """The projector family of a target dir, with its checkpoint indexed (unless not ``with_tensors``: the configs
    judged before any weight is here) and config checked; None when its family has no projector or config.json has
    neither vision_config nor audio_config.

    Raises:
        ConfigError, InputError, TensorError: the config or the preprocessor files cannot be converted (each
        message names the file, the field and the fix).
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    raw = read_config(path, "Target config")
    arch, cls = _projector_class(raw)
    if cls is None or arch is None:
        return None
    fam = cls(ProjectorSource(model_dir, path, arch, raw, index_checkpoint(model_dir) if with_tensors else {}))
    fam.check_config()
    return fam


def projector_reads(model_dir: Path) -> set[Path]:
    """The checkpoint files the projector's conversion reads (its towers' shards), from the headers alone; empty
    when the target has no projector.

    Raises:
        ConfigError, InputError, TensorError: as :func:`projector_for` and the projector's plan.
    """
    fam = projector_for(model_dir)
    if fam is None:
        return set()
    return {path for _, spec in plan_projector(fam)[0] for path in spec.read_paths}


def convert_projector(model_dir: Path, outfile: Path, outtype: str = "auto", *,
                      provenance: dict[str, str] | None = None,
                      dry_run: bool = False,
                      on_progress: Callable[[int, int], None] | None = None) -> ConvertResult:
    """Convert a target's vision / audio towers into the projector ("mmproj") GGUF llama.cpp b11434's
    ``convert_hf_to_gguf.py --mmproj`` writes (``outtype`` auto, f16, bf16, q8_0 or f32, as b11434 resolves them).

    The provenance keys are the target's (``provenance`` as for :func:`convert_target` wins), without the
    vocabulary ones: a projector has none. Output goes to ``<outfile>.partial``, renamed on success.

    Raises:
        NotCoveredError: the architecture's projector is not one the built-in converter writes.
        ConfigError, InputError, TensorError, OutputError: each one paragraph naming the file, the field and the
        fix; nothing is written.
    """
    start = time.perf_counter()
    model_dir = Path(model_dir)
    fam = projector_for(model_dir)
    if fam is None:
        raw = read_config(model_dir / "config.json", "Target config")
        arch, _ = _projector_class(raw)
        if raw.get("vision_config") is None and raw.get("audio_config") is None:
            raise ConfigError(f"{model_dir / 'config.json'}: neither 'vision_config' nor 'audio_config': the model "
                              "has no vision or audio tower, so there is no projector to convert.")
        covered = ", ".join(sorted(PROJECTORS))
        raise NotCoveredError(f"{model_dir / 'config.json'}: the projector of architecture {arch!r} is not one the "
                              f"built-in converter writes (it writes those of: {covered}). Convert it with llama.cpp's "
                              "converter: convert_hf_to_gguf.py DIR --mmproj.")
    planned = plan_projector(fam)
    name = (provenance or {}).get(prov.TARGET_REPO) or model_dir.name
    plan, outtype = build_projector_plan(fam, outtype, name, planned)
    recorded = target_record(model_dir, fam.src.config_path, fam.src.arch, "", None)
    recorded = {k: v for k, v in recorded.items() if k not in (prov.TARGET_VOCAB_SHA256, prov.TOKENIZER_ORIGIN)}
    return finish(plan, Path(outfile), outtype, VocabInfo("none", 0, ""), tuple(fam.notes),
                  {**recorded, **(provenance or {})}, start, dry_run=dry_run, on_progress=on_progress)


__all__ = ["PROJECTORS", "SUPPORTED_ARCHITECTURES", "TARGET_ARCHS", "ConvertResult", "ProjectorFamily", "TargetArch",
           "TargetConfig", "by_gguf", "by_hf", "drafter_vocab_archs", "read_target_config", "TargetSource",
           "TensorSpec", "TextFamily", "add_text_hparams", "block_id", "build_plan", "builtin_family",
           "convert_projector", "convert_target", "family_for", "has_projector", "plan_tensors", "projector_for",
           "trimmed_rows", "unsupported_message", "working_ahead"]
