"""What a pipeline run is asked for: ``PipelineOptions`` (the CLI's flags, typed) and the rules that settle them
before anything is fetched: the quant types checked, the target's default type, which tags convert and quantize in
one pass, and the stage-record names of each tag's target and drafter."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..cores import machine_cores
from ..errors import InputError, QuantizeError
from ..ggufio.split import NO_SPLIT, SplitRule
from ..quantize import check_makeable, quant_type
from ..quantize.builtin import NO_OVERRIDES, Overrides
from ..quantize.imatrix import DEFAULT_CTX as DEFAULT_IMATRIX_CTX
from ..quantize.recipes import NamedRecipe
from ..quantize.rules import ONE_PASS_TYPES
from ..tune import TuneOptions
from . import stages
from .naming import DEFAULT_PROJECTOR_TYPE, encoding, gguf_name
from .sources import Source

DEFAULT_QUANT = "q4_0"  # the target's type when --quant is not given
# The drafter's type of a run of one tag when --draft-quant is not given. Q8_0: ggml-org publishes DFlash drafters
# only as BF16 and Q8_0, a 4-bit DFlash2 drafter collapsed to no useful drafts in another engine, and the drafter is
# small next to the target, so the safe precision costs little. q4_0 stays available; `tune` decides between them.
DEFAULT_DRAFT_QUANT = "q8_0"
MXFP4_MOE = "mxfp4_moe"  # ... and for a checkpoint whose experts are MXFP4


@dataclass(frozen=True)
class PipelineOptions:
    """Everything ``dflash-convert --target --drafter`` takes; field names mirror the flags."""

    target: str
    drafter: str
    quant: str | None = None  # the target's type (what users ask for); None: its default, see target_quant
    outdir: Path | None = None
    target_gguf: str | None = None
    llama_cpp: Path | None = None
    keep_intermediate: bool = False
    allow_derived_target: bool = False
    dry_run: bool = False
    threads: int = field(default_factory=machine_cores)
    # The drafter's own type (see drafter_types).
    draft_quant: str | None = None  # None: DEFAULT_DRAFT_QUANT for one tag, each tag's own type for several
    quantizer: str = "auto"  # as dflash-gguf quantize --quantizer: see quantize.choose_quantizer
    tune: bool = False  # measure with llama-server at the end (when one is found)
    tune_options: TuneOptions | None = None
    more_drafters: tuple[str, ...] = ()  # further --drafter specs for the same target, compared by tune
    drop_mtp: bool = False  # --no-mtp: the target GGUF without its own MTP head (b11434's converter flag)
    imatrix: Path | None = None  # --imatrix: an importance matrix for llama-quantize (the target's quantization)
    imatrix_auto: bool = False  # --imatrix auto: made by llama-imatrix from the run's 16-bit target on --calibration
    calibration: str | None = None  # --calibration TEXT | REPO[@REV]:FILE
    calibration_ctx: int = DEFAULT_IMATRIX_CTX  # --calibration-ctx: llama-imatrix -c
    calibration_chunks: int | None = None  # --calibration-chunks: llama-imatrix --chunks (None: the whole text)
    # --pure / --token-embedding-type / --output-tensor-type for the target's quantization
    target_overrides: Overrides = NO_OVERRIDES
    mmproj: bool = True  # --no-mmproj: leave the target's vision/audio projector out
    mmproj_type: str = DEFAULT_PROJECTOR_TYPE  # --mmproj-type
    split: SplitRule = NO_SPLIT  # --split-max-size / --split-max-tensors: the target in shards above it
    # --quant A,B,C: the tags after the first (``quant``), made from one read of the checkpoint, each with its drafter
    more_quants: tuple[str, ...] = ()
    more_draft_quants: tuple[str, ...] = ()  # --draft-quant A,B,C: the drafter's type for each tag after the first
    keep_source: bool = True  # --no-keep-source: the target's shards in the work folder, each removed once consumed
    recipes: tuple[NamedRecipe, ...] = ()  # --recipe NAME=BASE_TYPE:FILE: tags after the --quant ones, named NAME

    @property
    def drafters(self) -> tuple[str, ...]:
        return (self.drafter, *self.more_drafters)

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag the run makes, the first served by default (settled: see ``target_type``): a type's name, or a
        named recipe's (--recipe); :meth:`type_of` and :meth:`overrides_of` say how each is made."""
        return (self.target_type, *self.more_quants, *(r.name for r in self.recipes))

    def recipe_of(self, tag: str) -> NamedRecipe | None:
        return next((r for r in self.recipes if r.name == tag), None)

    def type_of(self, tag: str) -> str:
        """The quant type a tag (of the target or of its drafter) is made as: a named recipe's base type, else the
        tag itself."""
        recipe = self.recipe_of(tag)
        return recipe.base if recipe is not None else tag

    def overrides_of(self, tag: str) -> Overrides:
        """The target's per-tensor flags for ``tag``: a named recipe's rules (with the run's --pure,
        --output-tensor-type and --token-embedding-type), else the run's."""
        recipe = self.recipe_of(tag)
        return self.target_overrides if recipe is None else replace(self.target_overrides, tensor_types=recipe.rules)

    @property
    def uses_imatrix(self) -> bool:
        """The target is quantized with an importance matrix (given, or made in the run)."""
        return self.imatrix is not None or self.imatrix_auto

    @property
    def several_tags(self) -> bool:
        return bool(self.more_quants or self.recipes)

    def drafter_types(self) -> tuple[str, ...]:
        """The drafter's type served with each tag: ``--draft-quant`` (one for every tag, or one per tag); by default
        Q8_0 for one tag, and for several each tag's own type, so ``-hf REPO:TAG`` pairs each target with the sidecar
        named ``-TAG.`` (a type that only fits experts, MXFP4_MOE, becomes Q8_0: what it makes of the rest)."""
        if self.more_draft_quants:
            return (self.draft_quant or DEFAULT_DRAFT_QUANT, *self.more_draft_quants)
        if self.draft_quant is not None or not self.several_tags:
            return (self.draft_quant or DEFAULT_DRAFT_QUANT,) * len(self.tags)
        return tuple(DEFAULT_DRAFT_QUANT if self.type_of(tag) == MXFP4_MOE else tag for tag in self.tags)

    @property
    def target_type(self) -> str:
        """The target's type, once ``target_quant`` has settled it (before anything reads it)."""
        if self.quant is None:
            raise AssertionError("the target's type is settled when its config.json is read (target_quant)")
        return self.quant


def check_quant_types(opts: PipelineOptions) -> PipelineOptions:
    """``--quant`` and ``--draft-quant`` as the types they name (any case, llama-quantize's aliases), refused before
    anything is fetched when they cannot be made here: a type only llama-quantize makes with none found, or one
    that needs an importance matrix without ``--imatrix`` (the target's; the drafter's type gets none), a tag named
    twice, or a drafter type per tag that does not match the tags.

    Raises:
        QuantizeError: as above, naming the flag and the way out.
        InputError: several tags with several --drafter, a tag twice, or --draft-quant's count off.
    """
    def checked(name: str, flag: str, target: bool) -> str:
        found = quant_type(name, flag)
        check_makeable(found, opts.quantizer, imatrix=opts.imatrix if target else None, flag=flag,
                       imatrix_auto=opts.imatrix_auto and target,
                       overrides=opts.target_overrides if target else NO_OVERRIDES)
        return found.key

    drafts = [checked(d, "--draft-quant", False) for d in ((opts.draft_quant,) if opts.draft_quant else ())
              + opts.more_draft_quants]
    opts = replace(opts, draft_quant=drafts[0] if drafts else None, more_draft_quants=tuple(drafts[1:]))
    tags = [checked(t, "--quant", True) for t in ((opts.quant,) if opts.quant else ()) + opts.more_quants]
    if len(tags) != len(set(tags)):
        raise InputError(f"--quant {','.join(tags)} names a tag twice; name each once.")
    opts = replace(opts, recipes=tuple(_checked_recipe(opts, r, tags) for r in opts.recipes))
    if len(tags) + len(opts.recipes) > 1 and opts.more_drafters:
        raise InputError("Several --quant tags and several --drafter are two comparisons at once: make the tags with "
                         "one drafter, or compare the drafters at one tag (two runs with two --outdir folders).")
    if len(drafts) > 1 and len(drafts) != len(tags) + len(opts.recipes):
        which = "--quant tag(s)" if not opts.recipes else "tag(s) of --quant and --recipe"
        raise InputError(f"--draft-quant {','.join(drafts)} names {len(drafts)} types for "
                         f"{len(tags) + len(opts.recipes)} {which}: give one type for every tag, or one per tag in "
                         "the order of --quant, then --recipe.")
    if (len(tags) > 1 or opts.recipes) and opts.target_gguf is not None:
        raise InputError("Several --quant tags and --recipe tags are made from the target's checkpoint; --target-gguf "
                         "is used as it is. Leave out --target-gguf, or give one --quant and no --recipe.")
    if not tags:  # settled by target_quant once the target's config.json is here
        return opts
    return replace(opts, quant=tags[0], more_quants=tuple(tags[1:]))


def _checked_recipe(opts: PipelineOptions, recipe: NamedRecipe, tags: list[str]) -> NamedRecipe:
    """A --recipe with its base type settled (any case, llama-quantize's aliases) and checked as --quant's are.

    Raises:
        QuantizeError: the base type cannot be made here with its rules (see check_makeable).
        InputError: its name is a type's (a file named so would be taken for that type), or another tag's.
    """
    try:
        quant_type(recipe.name)
    except QuantizeError:
        pass
    else:
        raise InputError(f"--recipe {recipe.name}=...: {recipe.name} is the name of a quant type; a file named so "
                         "would be taken for one made by that type's rules. Name the recipe's tag otherwise (say "
                         f"{recipe.name}_R).")
    others = [*tags, *(r.name for r in opts.recipes if r is not recipe)]
    if recipe.name.upper() in (t.upper() for t in others):
        raise InputError(f"--recipe {recipe.name} names a tag twice (files are named by the tag, in capitals); name "
                         "each once.")
    base = quant_type(recipe.base, f"--recipe {recipe.name}")
    check_makeable(base, opts.quantizer, imatrix=opts.imatrix, flag=f"--recipe {recipe.name}",
                   imatrix_auto=opts.imatrix_auto, overrides=replace(opts.target_overrides, tensor_types=recipe.rules))
    return replace(recipe, base=base.key)


def target_quant(opts: PipelineOptions, target: Source) -> PipelineOptions:
    """The target's type: ``--quant`` as given, else q4_0, or for a checkpoint whose experts are MXFP4 (gpt-oss)
    llama-quantize's MXFP4_MOE, which keeps those blocks as they are. Any other block type for such a checkpoint
    is refused here, before a weight is fetched: llama-quantize b11434 does not requantize MXFP4.

    Raises:
        QuantizeError: a block type other than MXFP4_MOE asked of an MXFP4 checkpoint.
    """
    mxfp4 = opts.target_gguf is None and stages.has_mxfp4_experts(target)
    if opts.quant is None:
        settled = replace(opts, quant=MXFP4_MOE if mxfp4 else DEFAULT_QUANT)
        check_makeable(quant_type(settled.target_type), opts.quantizer, imatrix=opts.imatrix, flag="--quant",
                       imatrix_auto=opts.imatrix_auto, overrides=opts.target_overrides)
        return settled
    for tag in map(opts.type_of, opts.tags):
        if mxfp4 and tag != MXFP4_MOE and not quant_type(tag).unquantized:
            raise QuantizeError(
                f"{target.label}: its experts are MXFP4 (config.json: quantization_config.quant_method mxfp4), and "
                f"llama-quantize b11434 does not requantize MXFP4 ('requantizing from type mxfp4 is disabled'), so "
                f"--quant {tag} cannot be made from this checkpoint. Leave --quant out (this target's default, "
                f"{MXFP4_MOE}: the experts kept as they are and every other matrix Q8_0, as llama-quantize's "
                "MXFP4_MOE makes them), or pass --quant bf16/f16 (the experts stay MXFP4), or convert the model's "
                "BF16 release.")
    return opts


def check_tag_names(opts: PipelineOptions, model: str) -> None:
    """Each named recipe's files found by its tag alone: llama.cpp's ``-hf REPO:TAG`` takes the first model file whose
    name holds ``TAG`` followed by '.' or '-' (common/download.cpp ``find_best_model``, any case), so a recipe's tag
    must not be found so in another tag's file name (the model's name included), nor another tag in its file's.

    Raises:
        InputError: naming the two tags and a name that would not be taken for the other.
    """
    files = {tag: gguf_name(model, tag) for tag in opts.tags}
    for recipe in opts.recipes:
        for tag in opts.tags:
            if tag == recipe.name:
                continue
            for a, b in ((recipe.name, tag), (tag, recipe.name)):
                if re.search(f"{re.escape(encoding(a))}[.-]", files[b], re.IGNORECASE):
                    raise InputError(
                        f"--recipe {recipe.name}: llama.cpp's -hf REPO:{encoding(a)} would find {files[b]} (it takes "
                        f"the first file whose name holds '{encoding(a)}' and then '.' or '-'), so the tags "
                        f"{encoding(recipe.name)} and {encoding(tag)} cannot be told apart in one repo. Name the "
                        "recipe so that no other tag, and not the model's name, holds it or is held by it (say "
                        f"{encoding(recipe.name)}_R).")


def makes_in_one_pass(opts: PipelineOptions, tag: str, *, target: bool = False) -> bool:
    """Convert and quantize in one pass (the built-in converters): the built-in quantizer's bytes without a
    BF16 file on disk. Only when the built-in quantizer is the one that would run (for the target with --imatrix
    FILE: its weighted kernels; not with --imatrix auto, whose matrix is made from the 16-bit GGUF), and no
    intermediate is to be kept. ``tag``: a type, or a named recipe's tag. The target's per-tensor overrides (--pure,
    --tensor-type, a recipe's rules, ...) apply in the one pass too."""
    if target and opts.imatrix_auto:
        return False
    imatrix = target and opts.uses_imatrix
    quant = opts.type_of(tag)
    return (quant in ONE_PASS_TYPES and not opts.keep_intermediate
            and stages.quantizer_choice(quant, opts.quantizer, imatrix=imatrix,
                                        overrides=opts.overrides_of(tag) if target else NO_OVERRIDES) == "builtin")


def tag_side(tag: str, tags: tuple[str, ...]) -> str:
    """The stage-record name of a tag's target: ``target`` for the first (a run of one tag has only it), then
    ``target.<tag>``."""
    return "target" if tag == tags[0] else f"target.{tag}"


def is_target_side(side: str) -> bool:
    return side == "target" or side.startswith("target.")


def drafter_side(draft_quant: str, types: tuple[str, ...]) -> str:
    """The stage-record name of the drafter at a type: ``drafter`` for the first tag's, then ``drafter.<type>``."""
    return "drafter" if draft_quant == types[0] else f"drafter.{draft_quant}"
