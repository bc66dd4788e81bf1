"""ggml b11434's reference quantizers in numpy, bit for bit, one module per block family.

The fallback of the compiled kernels (``_kernels.c``: the same bytes, several times faster) and their reference in
the tests. Each family's kernel has one signature, ``kernel(blocks, src_type, out)``: whole blocks of values stored as
F32, F16 or BF16 (raw words) in, the type's bytes out. A type's record (``quantize/types.py``) names its kernel; the
entry points (``quantize/kernels.py``) check the input, allocate the output and pick compiled or numpy.
"""
