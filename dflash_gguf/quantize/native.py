"""The optional compiled kernels (``_kernels.c``, built by setup.py) and which kernels quantize now.

Why a CPython extension rather than a ctypes library: setuptools builds and names it for the interpreter, and a
missing build is simply an ImportError (the numpy kernels then take over, same bytes, slower). The extension knows a
type by its ggml id (``TensorType.c_id``). ``DFLASH_GGUF_KERNELS=numpy`` forces the numpy kernels, ``=compiled``
refuses to run without the extension; :func:`kernel_path` says which one is active.

The extension picks the widest instruction set this CPU has (AVX-512, AVX2, or its portable code) at run time;
``DFLASH_GGUF_SIMD=portable|avx2|avx512`` caps it (tests hold every level to libggml; all give the same bytes).
"""

from __future__ import annotations

import os
from types import ModuleType

KERNELS_ENV = "DFLASH_GGUF_KERNELS"  # "numpy": force the fallback; "compiled": require the extension
KERNEL_PATHS = ("compiled", "numpy")
SIMD_ENV = "DFLASH_GGUF_SIMD"  # cap the compiled kernels' instruction set: portable, avx2 or avx512
SIMD_LEVELS = ("portable", "avx2", "avx512")  # every level the extension knows, lowest first


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


def _apply_simd_env() -> None:
    """Cap the extension's instruction set at ``$DFLASH_GGUF_SIMD`` (or the CPU's best below it), once."""
    wanted = os.environ.get(SIMD_ENV, "").strip().lower()
    lib = _load_compiled("auto")
    if not wanted or lib is None:
        return
    if wanted not in SIMD_LEVELS:
        raise ImportError(f"{SIMD_ENV}={wanted!r} is not an instruction set; use one of {', '.join(SIMD_LEVELS)}, or "
                          "unset it for the widest this CPU has.")
    have = lib.simd_levels()
    lib.set_simd(wanted if wanted in have else have[-1])


_apply_simd_env()
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


def simd_levels() -> tuple[str, ...]:
    """The instruction sets the compiled kernels can use on this CPU, lowest first (empty without the extension)."""
    lib = _load_compiled("auto")
    return () if lib is None else tuple(lib.simd_levels())


def simd() -> str | None:
    """The instruction set the compiled kernels use (None without the extension), whichever path is active."""
    lib = _load_compiled("auto")
    return None if lib is None else str(lib.simd())


def set_simd(level: str) -> None:
    """Make the compiled kernels use ``level`` (one of :func:`simd_levels`): tests and the bench compare them.

    Raises:
        ValueError: this CPU or build has no such level.
    """
    lib = _load_compiled("auto")
    if lib is None or level not in lib.simd_levels():
        have = ", ".join(simd_levels()) or "none"
        raise ValueError(f"instruction set {level!r} is not available here (have: {have})")
    lib.set_simd(level)
