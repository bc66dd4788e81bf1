"""Type stub of the optional compiled kernels (``_kernels.c``): what ``kernels.py`` calls."""

from _typeshed import ReadableBuffer, WriteableBuffer

def quantize(src: ReadableBuffer, src_type: int, dst: WriteableBuffer, dst_type: int) -> None:
    """Quantize (or round) the values in ``src`` into ``dst`` (types by ggml id)."""

def count_nonfinite(data: ReadableBuffer, type: int) -> int:
    """NaN or infinite values, or block scales, in ``data``."""
