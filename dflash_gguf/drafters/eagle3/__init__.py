"""EAGLE-3 draft heads: one Llama decoder layer fed with three of the target's hidden states.

``rules``: the config rules; ``convert``: the converter (b11434's LlamaModel EAGLE-3 path); ``checks``: verify's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...ggufio.reader import GGUFMeta
from ..family import Drafter, DrafterFamily
from . import rules

# The longest draft the tuner tries for an EAGLE-3 head. It has no block: draft-eagle3 runs its one decoder layer
# once per drafted token on its own pre-norm hidden state (llama.cpp never clamps --spec-draft-n-max for it).
# Acceptance falls with every step, and EAGLE-3 heads are trained with about 7 unrolled steps (SpecForge's
# ttt_length 7), so longer drafts mostly cost verification rows; 8 leaves one step past training for the sweep.
EAGLE3_MAX_N_MAX = 8


@dataclass(frozen=True)
class Eagle3Drafter(Drafter):
    """An EAGLE-3 head: no block size, n-max bounded by ``EAGLE3_MAX_N_MAX``."""

    @property
    def max_n_max(self) -> int:
        return EAGLE3_MAX_N_MAX


def _served(path: Path, meta: GGUFMeta, type_name: str) -> Eagle3Drafter:
    return Eagle3Drafter(path, rules.GGUF_ARCH, rules.SPEC_TYPE, None, type_name)


FAMILY = DrafterFamily(
    name=rules.NAME,
    title="an EAGLE-3 head",
    config_architectures=rules.ARCHITECTURES,
    gguf_arch=rules.GGUF_ARCH,
    marker_tensor=None,
    spec_type=rules.SPEC_TYPE,
    spec_type_inferred=False,
    drafts="token",
    sidecar_kind=rules.GGUF_ARCH,
    models_dir_attaches=False,  # common/preset.cpp's draft_prefixes have no eagle3-
    fetch_files=(),
    spec_class=rules.Eagle3Spec,
    interpret=rules.interpret,
    pair_rules=rules.pair_findings,
    served_as=_served,
    checks_module=f"{__name__}.checks",
    converter_module=f"{__name__}.convert",
)
