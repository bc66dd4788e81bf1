"""Gemma-4 MTP assistants (google/gemma-4-<size>-it-assistant): an MTP head over the target's own KV cache.

``rules``: the config rules; ``convert``: the converter (b11434's Gemma4AssistantModel, a Gemma4Model subclass);
``checks``: verify's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...ggufio.reader import GGUFMeta
from ..family import Drafter, DrafterFamily
from . import rules

# The longest draft the tuner tries for an MTP head. It has no block: draft-mtp runs it once per drafted token
# (is_mem_shared: no clamp to its layer count), each step feeding on its own predicted hidden state, so acceptance
# falls off with every step while each drafted token still costs a verification row; past 7 (the coarse grid's
# third step) the expected accepted length hardly grows.
MTP_MAX_N_MAX = 7


@dataclass(frozen=True)
class MtpDrafter(Drafter):
    """An MTP head: no block size, n-max bounded by ``MTP_MAX_N_MAX``."""

    @property
    def max_n_max(self) -> int:
        return MTP_MAX_N_MAX


def _served(path: Path, meta: GGUFMeta, type_name: str) -> MtpDrafter:
    return MtpDrafter(path, rules.GGUF_ARCH, rules.SPEC_TYPE, None, type_name)


FAMILY = DrafterFamily(
    name=rules.NAME,
    title="an MTP head",
    config_architectures=rules.ARCHITECTURES,
    gguf_arch=rules.GGUF_ARCH,
    marker_tensor=None,
    spec_type=rules.SPEC_TYPE,
    spec_type_inferred=False,
    drafts="token",
    sidecar_kind="mtp",
    models_dir_attaches=True,
    fetch_files=(),
    spec_class=rules.AssistantSpec,
    interpret=rules.interpret,
    pair_rules=rules.pair_findings,
    served_as=_served,
    checks_module=f"{__name__}.checks",
    converter_module=f"{__name__}.convert",
    own_mtp_max_n_max=MTP_MAX_N_MAX,
    published_with_target=True,
)
