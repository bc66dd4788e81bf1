"""The optional compiled kernels (``_kernels.c``, built by setup.py) and which kernels quantize now.

Why a CPython extension rather than a ctypes library: setuptools builds and names it for the interpreter, and a
missing build is simply an ImportError (the numpy kernels then take over, same bytes, slower). The extension knows a
type by its ggml id (``TensorType.c_id``). ``DFLASH_GGUF_KERNELS=numpy`` forces the numpy kernels, ``=compiled``
refuses to run without the extension; :func:`kernel_path` says which one is active.
"""

from __future__ import annotations

import os
from types import ModuleType

KERNELS_ENV = "DFLASH_GGUF_KERNELS"  # "numpy": force the fallback; "compiled": require the extension
KERNEL_PATHS = ("compiled", "numpy")


def _load_compiled(mode: str) -> ModuleType | None:
    """The C extension, or None for the numpy kernels (``mode``: auto, numpy or compiled)."""
    if mode == "numpy":
        return None
    try:
        from . import _kernels  # optional: built only where a C compiler was present
    except ImportError as e:
        if mode == "compiled":
            raise ImportError(f"{KERNELS_ENV}=compiled, but the compiled kernels are not built ({e}); reinstall "
                              "dflash-gguf with a C compiler present, or unset it to use the numpy kernels.") from e
        return None
    return _kernels


_compiled = _load_compiled(os.environ.get(KERNELS_ENV, "auto").strip().lower())


def compiled() -> ModuleType | None:
    """The extension while the compiled kernels are active, else None (the numpy kernels run)."""
    return _compiled


def compiled_available() -> bool:
    """Whether the C extension can be imported (whatever the active path)."""
    return _load_compiled("auto") is not None


def kernel_path() -> str:
    """``"compiled"`` or ``"numpy"``: which kernels quantize now (for ``--json`` and the bench report)."""
    return "numpy" if _compiled is None else "compiled"


def set_kernel_path(path: str) -> None:
    """Switch the active kernels at run time (tests and the bench compare both).

    Raises:
        ImportError: ``"compiled"`` without the extension.
    """
    global _compiled
    if path not in KERNEL_PATHS:
        raise ValueError(f"kernel path must be one of {KERNEL_PATHS}, not {path!r}")
    _compiled = _load_compiled(path)
