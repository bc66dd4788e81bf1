"""Output file names by llama.cpp's convention (``<Name>-<Encoding>.gguf``) and the checkpoint's own type.

llama.cpp's ``gguf.naming_convention`` builds ``<BaseName>-<SizeLabel>-<FineTune>-<Encoding>``; a Hub repo
name already carries the first three (``gemma-4-12B-it``, ``gemma4-12B-it-DFlash``), so the repo's
basename plus the encoding gives the names users find on the Hub (``gemma-4-12B-it-Q4_0.gguf``).
"""

from __future__ import annotations

from pathlib import Path

from ..convert.outtype import resolve_outtype
from ..convert.safetensors import index_checkpoint
from ..ggufio.reader import SPLIT_NAME
from ..quantize.types import quant_type

# Inside --outdir: every drafter of a run that makes several, and a run's one drafter while it is not what is
# served (llama-server's --models-dir router attaches any dflash-/dspark-/mtp- file beside the target).
DRAFTERS_DIR = "drafters"
# Inside --outdir: the importance matrix the target was quantized with (not at the root, where the --models-dir
# router would take any .gguf for the model; -hf skips names containing "imatrix" wherever they are).
IMATRIX_DIR = "imatrix"


def size_ratio(type_name: str) -> float:
    """Bytes per weight of ``type_name`` relative to a 16-bit checkpoint (its bits per weight / 16); used only for
    the plan's size estimates."""
    return quant_type(type_name).bits / 16.0


def encoding(type_name: str) -> str:
    """``q4_0`` -> ``Q4_0``, ``bf16`` -> ``BF16``: the encoding part of a llama.cpp file name."""
    return type_name.upper()


def gguf_name(model_name: str, type_name: str) -> str:
    return f"{model_name}-{encoding(type_name)}.gguf"


def encoding_tag(file_name: str) -> str:
    """The tag ``-hf REPO:TAG`` picks a file by: the last dash-separated part of its name (``Qwen3-8B-Q4_K_M.gguf``
    -> ``Q4_K_M``), a shard's number left out."""
    name = Path(file_name).name
    shard = SPLIT_NAME.match(name)
    stem = shard["prefix"] if shard else name.removesuffix(".gguf")
    return stem.rsplit("-", 1)[-1].upper()


# The projector's type when --mmproj-type is not given: F16, the type ggml-org and unsloth publish projectors in
# (llama.cpp's CPU and GPU backends run every vision op in it; a BF16 im2col/conv is not implemented everywhere).
DEFAULT_PROJECTOR_TYPE = "f16"
PROJECTOR_TYPES = ("f16", "bf16", "f32", "q8_0")  # b11434's --mmproj outtypes that keep the towers servable


def projector_name(model_name: str, type_name: str) -> str:
    """``mmproj-<model>-<TYPE>.gguf``: ``mmproj`` in the name is how llama-server's -hf resolver
    (``find_best_mmproj``) and its --models-dir router (``is_mmproj_file``) find a target's projector."""
    return f"mmproj-{gguf_name(model_name, type_name)}"


def model_name(repo: str | None, folder: Path) -> str:
    """The repo's basename (``google/gemma-4-12B-it`` -> ``gemma-4-12B-it``), else the folder's name."""
    return repo.rsplit("/", 1)[-1] if repo else Path(folder).resolve().name


def checkpoint_type(model_dir: Path) -> str:
    """The 16-bit type a conversion with ``--outtype auto`` writes (the converters' own rule).

    Raises:
        TensorError, InputError: the checkpoint cannot be indexed.
    """
    return resolve_outtype("auto", index_checkpoint(model_dir).values())
