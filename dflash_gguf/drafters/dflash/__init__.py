"""DFlash and DFlash2 drafters (z-lab): block-diffusion drafts conditioned on the target's tapped hidden states.

``rules``: the config rules; ``gguf_format``: the dflash GGUF keys, tensors and shapes (DSpark files share them,
as b11434's loader ``src/models/dflash.cpp`` does); ``convert``: the converter; ``checks``: verify's checks.
"""

from __future__ import annotations

from pathlib import Path

from ...ggufio.reader import GGUFMeta
from ..family import Drafter, DrafterFamily
from . import rules
from .gguf_format import ARCH, DEFAULT_BLOCK_SIZE, Keys, is_drafter_like


def block_size(meta: GGUFMeta) -> int:
    """dflash.block_size, or the 16 llama.cpp assumes for a file without it."""
    value = meta.get(Keys.BLOCK_SIZE)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else DEFAULT_BLOCK_SIZE


def _served(path: Path, meta: GGUFMeta, type_name: str) -> Drafter:
    return Drafter(path, meta.arch or ARCH, rules.SPEC_TYPE, block_size(meta), type_name)


FAMILY = DrafterFamily(
    name=rules.NAME,
    title="a DFlash drafter",
    config_architectures=rules.ARCHITECTURES,
    gguf_arch=ARCH,
    marker_tensor=None,
    spec_type=rules.SPEC_TYPE,
    spec_type_inferred=True,
    drafts="block",
    sidecar_kind=ARCH,
    models_dir_attaches=True,
    fetch_files=(rules.MASK_EMBEDDING,),
    spec_class=rules.DFlashSpec,
    interpret=rules.interpret,
    pair_rules=rules.pair_findings,
    served_as=_served,
    checks_module=f"{__name__}.checks",
    converter_module=f"{__name__}.convert",
    default=True,
    claims=is_drafter_like,
    target_weight_files=(rules.MASK_EMBEDDING,),
)
