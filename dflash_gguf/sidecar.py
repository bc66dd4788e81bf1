"""llama.cpp's serving layout for drafters: a target GGUF with its drafter beside it, named by prefix.

llama.cpp b11434 treats a GGUF whose name starts with a drafter prefix as a sidecar of the target in the same
folder: ``llama-server --models-dir DIR`` serves each ``DIR/<name>/`` as model ``<name>`` with its sidecar
attached (common/preset.cpp ``draft_prefixes``, ``load_from_models_dir``), and ``llama-server -hf user/repo``
fetches a repo's ``dflash-`` file with the model (common/download.cpp ``find_best_dflash``). The spec type
is inferred from the drafter's metadata (``common_speculative_types_from_gguf``).

A DSpark drafter keeps ``general.architecture`` dflash; its ``markov_w1.weight`` tensor is what makes it one
(and what llama.cpp infers ``draft-dspark`` from), so its prefix ``dspark-`` comes from the file's tensors or,
before the file exists, from the drafter family that writes that tensor.
"""

from __future__ import annotations

from pathlib import Path

from .dflash_format import DSPARK_MARKER
from .errors import DflashGgufError
from .ggufio.reader import GGUFMeta

# general.architecture of a drafter -> its file-name prefix (eagle3- is excluded from targets by
# gguf_filename_is_model, the other three are preset.cpp's draft_prefixes).
PREFIXES = {"dflash": "dflash-", "dspark": "dspark-", "mtp": "mtp-", "eagle3": "eagle3-"}
PRESET_NAME = "models.ini"  # beside the pair; --models-preset reads it (common/preset.cpp parse_ini_from_file)


def is_sidecar(path: Path | str) -> bool:
    name = Path(path).name
    return name.endswith(".gguf") and name.startswith(tuple(PREFIXES.values()))


def drafter_kind(meta: GGUFMeta) -> str:
    """The prefix key of a drafter GGUF: ``dspark`` when it carries the Markov head, else its architecture."""
    if meta.arch == "gemma4-assistant":  # an MTP head: preset.cpp's mtp- prefix
        return "mtp"
    return "dspark" if DSPARK_MARKER in meta.tensors else (meta.arch or "dflash")


def drafter_kind_of_checkpoint(drafter_dir: Path) -> str:
    """The prefix key of the GGUF a Hugging Face drafter checkpoint converts to (its family decides the tensors)."""
    from . import drafters

    try:
        family = drafters.interpret_folder(Path(drafter_dir)).family
    except DflashGgufError:
        return "dflash"
    if family == "gemma4_assistant":  # writes a gemma4-assistant file: an MTP head
        return "mtp"
    return family if family in ("dspark", "eagle3") else "dflash"  # eagle3: its own architecture


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
