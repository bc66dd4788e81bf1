"""The optional compiled kernels (``_kernels.c``, built by setup.py) and which kernels quantize now.

Why a CPython extension rather than a ctypes library: setuptools builds and names it for the interpreter, and a
missing build is simply an ImportError (the numpy kernels then take over, same bytes, slower). The extension knows a
type by its ggml id (``TensorType.c_id``). ``DFLASH_GGUF_KERNELS=numpy`` forces the numpy kernels, ``=compiled``
refuses to run without the extension; :func:`kernel_path` says which one is active.

The extension picks the widest instruction set this CPU has (AVX-512, AVX2, or its portable code) at run time;
``DFLASH_GGUF_SIMD=portable|avx2|avx512`` caps it, and everything that asks which levels exist (:func:`simd_levels`,
the tests' kernel variants) then sees this CPU as one whose widest set is the cap: an AVX2-only or an old CPU can be
reproduced on any machine. All levels give the same bytes; the tests hold each to libggml.
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


def _simd_cap() -> str | None:
    """``$DFLASH_GGUF_SIMD`` checked, or None when unset.

    Raises:
        ImportError: a name that is no instruction set (the import fails with the names it takes).
    """
    wanted = os.environ.get(SIMD_ENV, "").strip().lower()
    if not wanted:
        return None
    if wanted not in SIMD_LEVELS:
        raise ImportError(f"{SIMD_ENV}={wanted!r} is not an instruction set; use one of {', '.join(SIMD_LEVELS)}, or "
                          "unset it for the widest this CPU has.")
    return wanted


_SIMD_CAP = _simd_cap()


def _levels_under_cap(lib: ModuleType) -> tuple[str, ...]:
    """The extension's levels on this CPU, none above the cap."""
    have = tuple(str(level) for level in lib.simd_levels())
    if _SIMD_CAP is None:
        return have
    return tuple(level for level in have if SIMD_LEVELS.index(level) <= SIMD_LEVELS.index(_SIMD_CAP))


def _apply_simd_cap() -> None:
    """Start the extension at the widest level under the cap (it starts at the CPU's widest)."""
    lib = _load_compiled("auto")
    if _SIMD_CAP is not None and lib is not None:
        lib.set_simd(_levels_under_cap(lib)[-1])


_apply_simd_cap()
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
    """The instruction sets the compiled kernels can use on this CPU, lowest first, none above ``$DFLASH_GGUF_SIMD``
    (empty without the extension)."""
    lib = _load_compiled("auto")
    return () if lib is None else _levels_under_cap(lib)


def simd() -> str | None:
    """The instruction set the compiled kernels use (None without the extension), whichever path is active."""
    lib = _load_compiled("auto")
    return None if lib is None else str(lib.simd())


def set_simd(level: str) -> None:
    """Make the compiled kernels use ``level`` (one of :func:`simd_levels`): tests and the bench compare them.

    Raises:
        ValueError: this CPU or build has no such level, or it is above ``$DFLASH_GGUF_SIMD``.
    """
    lib = _load_compiled("auto")
    if lib is None or level not in _levels_under_cap(lib):
        have = ", ".join(simd_levels()) or "none"
        raise ValueError(f"instruction set {level!r} is not available here (have: {have})")
    lib.set_simd(level)
