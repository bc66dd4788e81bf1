"""The output tensor type rules b11434's converter applies to every model (ModelBase.prepare_tensors).

Shared by the drafter and target converters so both make the same choice for the same tensor:
``--outtype auto`` keeps the checkpoint's own 16-bit float type; 1-D tensors, norms and anything not
named ``*.weight`` stay F32; Q8_0 falls back to F16 for rows that are not a multiple of 32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gguf import GGMLQuantizationType, LlamaFileType

from ..quantize.types import ggml_type
from .safetensors import TensorRef

log = logging.getLogger(__name__)

OUTTYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
    "f16": (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, GGMLQuantizationType.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
}
OUTTYPE_CHOICES = ("auto", *OUTTYPES)
_Q8_BLOCK = ggml_type(GGMLQuantizationType.Q8_0).block_size


def resolve_outtype(outtype: str, refs: Iterable[TensorRef]) -> str:
    """``auto``: the first matrix stored as BF16 or F16 decides; none at all gives f16 (as b11434 logs)."""
    if outtype not in OUTTYPE_CHOICES:
        raise ValueError(f"unknown outtype {outtype!r}")
    if outtype != "auto":
        return outtype
    for ref in refs:
        if len(ref.shape) >= 2 and ref.dtype in ("BF16", "F16"):
            return ref.dtype.lower()
    return "f16"


def tensor_type(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                force_f32: bool = False) -> GGMLQuantizationType:
    """The ggml type of one output tensor; ``shape`` in PyTorch order (last dim = row length)."""
    if force_f32 or len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.Q8_0 and shape[-1] % _Q8_BLOCK:
        log.warning("%s: row length %d is not a multiple of %d, writing F16 as llama.cpp does", name, shape[-1],
                    _Q8_BLOCK)
        return GGMLQuantizationType.F16
    return qtype
