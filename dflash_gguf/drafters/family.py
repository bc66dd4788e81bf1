"""What a drafter family provides, as one typed record: the contract every family package fills in.

A family package (``drafters/<family>/``) holds its config rules (``rules``), the GGUF converter (``convert``), the
checks verify runs on its files (``checks``) and, in its ``__init__``, one ``DrafterFamily`` naming all of it and
its serving facts. Commands never branch on a family's name or architecture: they ask the registry
(``dflash_gguf.drafters``) for the family of a config or of a GGUF and read its record.

The converter and the checks are named by module, not imported by the record: verify must not import the converter
(nor the converter verify), so each loads only the part it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

from ..convert.configs import TargetFacts
from ..ggufio.reader import GGUFMeta
from .findings import DrafterSpec, Finding, Interpretation


@dataclass(frozen=True)
class Drafter:
    """A drafter GGUF as llama-server serves it: the spec type, its block size and the longest draft it keeps.

    Families whose limits differ subclass it (a DSpark head, an MTP head, an EAGLE-3 head)."""

    path: Path
    arch: str
    spec_type: str | None  # --spec-type value
    block_size: int | None
    type_name: str  # the file's tensor type, e.g. Q8_0

    @property
    def max_n_max(self) -> int:
        """llama.cpp clamps --spec-draft-n-max to block_size - 1 for block drafters (a family without a block
        overrides it)."""
        return max(1, (self.block_size or 2) - 1)

    @property
    def required_p_min(self) -> float | None:
        """The --spec-draft-p-min the file must be served with, or None when any value works."""
        return None


# (path, header, tensor type name) -> the file as llama-server serves it
ServedAs = Callable[[Path, GGUFMeta, str], Drafter]


SpecT = TypeVar("SpecT", bound=DrafterSpec)


@dataclass(frozen=True)
class DrafterFamily(Generic[SpecT]):
    """One drafter family: how its configs and files are recognised, read, converted, checked and served."""

    name: str  # the family (Interpretation.family): dflash, dspark, eagle3, gemma4_assistant
    title: str  # how messages call one: "a DFlash drafter", "an EAGLE-3 head"
    config_architectures: tuple[str, ...]  # config.json ``architectures[0]`` values it reads
    gguf_arch: str  # general.architecture of its GGUF files
    marker_tensor: str | None  # the tensor that tells it from another family of the same gguf_arch
    spec_type: str  # llama-server --spec-type
    spec_type_inferred: bool  # llama-server infers it from the file (common_speculative_types_from_gguf)
    drafts: Literal["block", "token"]  # a block per step, or one token per step (no block)
    sidecar_kind: str  # the file-name prefix without its dash (common/preset.cpp draft_prefixes, -hf's finders)
    models_dir_attaches: bool  # llama-server --models-dir attaches its sidecar beside the target
    fetch_files: tuple[str, ...]  # files of its Hub repo beyond weights and tokenizer
    spec_class: type[SpecT]  # what its config rules read a config into
    interpret: Callable[[dict[str, Any], Path], Interpretation[SpecT]]
    pair_rules: Callable[[SpecT, TargetFacts], tuple[Finding, ...]]
    served_as: ServedAs
    checks_module: str  # check_drafter(d, t) -> Report
    converter_module: str  # convert(reading, drafter_dir, target_dir, outfile, outtype, **options) -> ConvertResult
    # The one default family: it judges headers that only look like a drafter (``claims``), and names a sidecar of
    # an unknown kind.
    default: bool = False
    claims: Callable[[GGUFMeta], bool] | None = None  # headers it judges beyond its own files (forks, old layouts)
    target_weight_files: tuple[str, ...] = ()  # checkpoint files whose presence means conversion reads target weights
    # Its spec type also runs a target's own MTP head (no drafter file); the longest draft tune tries for one.
    own_mtp_max_n_max: int | None = None
    published_with_target: bool = False  # the target's publisher releases one per target (verify.lineage names it)

    @property
    def sidecar_prefix(self) -> str:
        return f"{self.sidecar_kind}-"

    def matches(self, meta: GGUFMeta) -> bool:
        """Whether a GGUF header is this family's file (its architecture, and its marker tensor when it has one)."""
        return meta.arch == self.gguf_arch and (self.marker_tensor is None or self.marker_tensor in meta.tensors)

    def pair_findings(self, spec: DrafterSpec, target: TargetFacts) -> tuple[Finding, ...]:
        """Its rules for a spec it read, with this target."""
        if not isinstance(spec, self.spec_class):
            raise TypeError(f"the {self.name} family reads {self.spec_class.__name__}, not {type(spec).__name__}")
        return self.pair_rules(spec, target)

    def checks(self) -> ModuleType:
        return importlib.import_module(self.checks_module)

    def converter(self) -> ModuleType:
        return importlib.import_module(self.converter_module)

    def draft_length_note(self, spec: DrafterSpec) -> str:
        """What precheck says of the draft length a config allows."""
        if self.drafts == "token":
            never = ", which llama-server never infers" if not self.spec_type_inferred else ""
            return (f"no block: {self.title} drafts one token per step (served with --spec-type {self.spec_type}"
                    f"{never}); 'dflash-gguf tune' measures the fastest --spec-draft-n-max")
        return (f"block_size {spec.block_size}: --spec-draft-n-max can go up to {spec.n_max_limit}; 'dflash-gguf "
                "tune' measures the fastest")
