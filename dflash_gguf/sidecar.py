"""llama.cpp's serving layout for drafters: a target GGUF with its drafter beside it, named by prefix.

llama.cpp b11434 treats a GGUF whose name starts with a drafter prefix as a sidecar of the target in the same
folder: ``llama-server --models-dir DIR`` serves each ``DIR/<name>/`` as model ``<name>`` with its sidecar
attached (common/preset.cpp ``draft_prefixes``, ``load_from_models_dir``), and ``llama-server -hf user/repo``
fetches a repo's ``dflash-`` file with the model (common/download.cpp ``find_best_dflash``). The spec type
is inferred from the drafter's metadata (``common_speculative_types_from_gguf``).
"""

from __future__ import annotations

from pathlib import Path

# general.architecture of a drafter -> its file-name prefix (eagle3- is excluded from targets by
# gguf_filename_is_model, the other three are preset.cpp's draft_prefixes).
PREFIXES = {"dflash": "dflash-", "dspark": "dspark-", "mtp": "mtp-", "eagle3": "eagle3-"}
PRESET_NAME = "models.ini"  # beside the pair; --models-preset reads it (common/preset.cpp parse_ini_from_file)


def is_sidecar(path: Path | str) -> bool:
    name = Path(path).name
    return name.endswith(".gguf") and name.startswith(tuple(PREFIXES.values()))


def sidecar_name(target_model: str, type_name: str, arch: str = "dflash") -> str:
    """``dflash-gemma-4-12B-it-Q8_0.gguf``: the prefix, the target's model name and the drafter's encoding."""
    return f"{PREFIXES[arch]}{target_model}-{type_name.upper()}.gguf"


def sidecars_beside(target: Path) -> list[Path]:
    """The drafter sidecars in the target's folder, in name order."""
    folder = Path(target).parent
    return sorted(p for p in folder.glob("*.gguf") if is_sidecar(p) and p.is_file())


def target_beside(drafter: Path) -> Path | None:
    """The one non-sidecar GGUF in a sidecar's folder (None when there is none or more than one)."""
    folder = Path(drafter).parent
    found = [p for p in folder.glob("*.gguf") if p.is_file() and not is_sidecar(p)]
    return found[0] if len(found) == 1 else None
