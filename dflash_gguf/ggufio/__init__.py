"""GGUF bytes only: the layout (``layout``), a bounded header reader (``reader``), a streaming writer
(``writer``). Nothing here knows about DFlash, Hugging Face or quantization rules."""

from .layout import ALIGNMENT, StringArray, pad, row_bytes, tensor_nbytes
from .reader import KV, GGUFMeta, TensorInfo, read_gguf, read_rows
from .writer import GGUFPlan, TensorOut, Written

__all__ = ["ALIGNMENT", "KV", "GGUFMeta", "GGUFPlan", "StringArray", "TensorInfo", "TensorOut", "pad", "read_gguf",
           "read_rows", "row_bytes", "tensor_nbytes", "Written"]
