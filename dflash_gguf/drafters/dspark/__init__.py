"""DSpark drafters: a DFlash backbone with a Markov head (and optionally a confidence head).

The file is a dflash GGUF (b11434's DSparkModel subclasses DFlashModel, and one loader reads both): the dflash
package's converter and checks handle its tensors, and its ``markov_w1.weight`` is what makes it a DSpark file.
``rules``: its config rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...ggufio.reader import GGUFMeta
from ..dflash import block_size
from ..dflash import rules as dflash_rules
from ..dflash.gguf_format import ARCH, DSPARK_MARKER, Keys
from ..family import Drafter, DrafterFamily
from . import rules


@dataclass(frozen=True)
class DSparkDrafter(Drafter):
    """A DSpark file: its n-max limit and the p-min its confidence head (or lack of one) needs."""

    sample_from_anchor: bool = True
    has_confidence_head: bool = True

    @property
    def max_n_max(self) -> int:
        return dflash_rules.n_max_limit(self.block_size or 1, self.sample_from_anchor)

    @property
    def required_p_min(self) -> float | None:
        """0 without a confidence head: llama-server stops with 'DSpark draft has no confidence head' at any other
        --spec-draft-p-min."""
        return None if self.has_confidence_head else 0.0


def _served(path: Path, meta: GGUFMeta, type_name: str) -> DSparkDrafter:
    """common/speculative.cpp: a missing sample_from_anchor or has_confidence_head counts as true."""
    return DSparkDrafter(path, meta.arch or ARCH, rules.SPEC_TYPE, block_size(meta), type_name,
                         sample_from_anchor=meta.get(Keys.SAMPLE_FROM_ANCHOR, True) is not False,
                         has_confidence_head=meta.get(Keys.HAS_CONFIDENCE_HEAD, True) is not False)


FAMILY = DrafterFamily(
    name=rules.NAME,
    title="a DSpark drafter",
    config_architectures=rules.ARCHITECTURES,
    gguf_arch=ARCH,
    marker_tensor=DSPARK_MARKER,
    spec_type=rules.SPEC_TYPE,
    spec_type_inferred=True,
    drafts="block",
    sidecar_kind="dspark",
    models_dir_attaches=True,
    fetch_files=(dflash_rules.MASK_EMBEDDING,),
    spec_class=dflash_rules.DFlashSpec,
    interpret=rules.interpret,
    pair_rules=rules.pair_findings,
    served_as=_served,
    checks_module="dflash_gguf.drafters.dflash.checks",  # one loader reads dflash and DSpark files
    converter_module="dflash_gguf.drafters.dflash.convert",  # DSparkModel is a DFlashModel in b11434
)
