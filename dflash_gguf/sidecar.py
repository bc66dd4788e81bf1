"""llama.cpp's serving layout for drafters: a target GGUF with its drafter beside it, named by prefix.

llama.cpp b11434 treats a GGUF whose name starts with a drafter prefix as a sidecar of the target in the same
folder: ``llama-server --models-dir DIR`` serves each ``DIR/<name>/`` as model ``<name>`` with its sidecar
attached (common/preset.cpp ``draft_prefixes``, ``load_from_models_dir``), and ``llama-server -hf user/repo``
fetches a repo's ``dflash-`` file with the model (common/download.cpp ``find_best_dflash``). The spec type
is inferred from the drafter's metadata (``common_speculative_types_from_gguf``).

Each drafter family names its prefix (``DrafterFamily.sidecar_kind``): a file's comes from the family its header
belongs to, and before the file exists from the family that reads the checkpoint's config.
"""

from __future__ import annotations

from pathlib import Path

from . import drafters
from .errors import DflashGgufError
from .ggufio.reader import GGUFMeta

PRESET_NAME = "models.ini"  # beside the pair; --models-preset reads it (common/preset.cpp parse_ini_from_file)


def is_sidecar(path: Path | str) -> bool:
    name = Path(path).name
    return name.endswith(".gguf") and name.startswith(drafters.SIDECAR_PREFIXES)


def drafter_kind(meta: GGUFMeta) -> str:
    """The sidecar kind of a drafter GGUF (``dflash``, ``dspark``, ``mtp``, ``eagle3``), from its family; a
    dflash-like file no family claims (a fork's layout) is named as a DFlash one."""
    family = drafters.family_of_gguf(meta)
    return family.sidecar_kind if family is not None else drafters.DEFAULT_FAMILY.sidecar_kind


def drafter_kind_of_checkpoint(drafter_dir: Path) -> str:
    """The sidecar kind of the GGUF a Hugging Face drafter checkpoint converts to (its family writes it)."""
    try:
        name = drafters.interpret_folder(Path(drafter_dir)).family
    except DflashGgufError:
        name = None
    return drafters.family_named(name).sidecar_kind if name else drafters.DEFAULT_FAMILY.sidecar_kind


def sidecar_name(target_model: str, type_name: str, kind: str = drafters.DEFAULT_FAMILY.sidecar_kind) -> str:
    """``dflash-gemma-4-12B-it-Q8_0.gguf``: the prefix, the target's model name and the drafter's encoding."""
    return f"{kind}-{target_model}-{type_name.upper()}.gguf"


def sidecars_beside(target: Path) -> list[Path]:
    """The drafter sidecars in the target's folder, in name order."""
    folder = Path(target).parent
    return sorted(p for p in folder.glob("*.gguf") if is_sidecar(p) and p.is_file())


def target_beside(drafter: Path) -> Path | None:
    """The one non-sidecar GGUF in a sidecar's folder (None when there is none or more than one)."""
    folder = Path(drafter).parent
    found = [p for p in folder.glob("*.gguf") if p.is_file() and not is_sidecar(p)]
    return found[0] if len(found) == 1 else None
