"""The target's config.json, read raw as b11434 does, for the converters.

A drafter's config is read by its family in ``dflash_gguf.drafters`` (the rules the precheck applies too);
config files are read and normalised by ``dflash_gguf.hf_configs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..drafters import TargetFacts
from ..errors import ConfigError
from ..hf_configs import read_config
from ..target_archs import VocabPath, by_hf


@dataclass(frozen=True)
class TargetConfig:
    """What the drafter conversion needs from the target's config.json (read raw, as b11434 does)."""

    path: Path
    raw: dict[str, Any]
    arch: str
    hidden_size: int
    n_layer: int
    vocab_size: int | None

    @property
    def is_gemma(self) -> bool:
        return self.arch.startswith("Gemma")

    @property
    def vocab_path(self) -> VocabPath | None:
        """How b11434 reads this architecture's vocabulary, when the converters mirror it (``target_archs``)."""
        arch = by_hf(self.arch)
        return arch.drafter_vocab if arch is not None else None

    def facts(self) -> TargetFacts:
        return TargetFacts(self.arch, self.hidden_size, self.n_layer, self.vocab_size, self.path)

    @property
    def uses_mrope(self) -> bool:
        cfg = self.raw.get("text_config", self.raw)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return "mrope_section" in rope


def read_target_config(target_dir: Path) -> TargetConfig:
    """Read the target's config.json (whether its architecture can be served is ``drafters.target_findings``).

    Raises:
        ConfigError: missing or unparsable config, no architecture or hidden size.
    """
    path = target_dir / "config.json"
    raw = read_config(path, "Target config")
    text = raw.get("text_config") or {}
    arch = (text.get("architectures") or raw.get("architectures") or [None])[0]
    if arch is None:
        raise ConfigError(f"{path}: no 'architectures' field, so the target's tokenizer path is unknown. "
                          "Use the config.json published with the target model.")
    merged = {**raw, **text}
    try:
        hidden, layers = int(merged["hidden_size"]), int(merged["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: 'hidden_size' or 'num_hidden_layers' missing (also under text_config). "
                          "Use the config.json published with the target model.") from None
    vocab = merged.get("vocab_size")
    return TargetConfig(path, raw, arch, hidden, layers, int(vocab) if vocab is not None else None)
