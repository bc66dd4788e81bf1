"""The optional compiled quantization kernels (``dflash_gguf.quantize._kernels``); everything else is in pyproject.toml.

Optional because the package must install without a C compiler: a failed build only warns, and
``dflash_gguf.quantize.kernels`` then runs its numpy kernels (bit-identical, slower).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Exactness: ggml's portable build fuses no multiply-adds; -ffp-contract=off keeps the compiler from fusing
# ours, and nothing here may enable -ffast-math (it would reorder and drop NaN handling).
_FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c99"]


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing, whatever goes wrong (no compiler, no Python headers, ...)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # any failure means: use the numpy kernels
            self._warn(e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            self._warn(e)

    @staticmethod
    def _warn(e: Exception) -> None:
        print(f"WARNING: the compiled quantization kernels were not built ({e}); dflash-gguf will use its "
              "numpy kernels (same output, slower).", file=sys.stderr)


setup(
    ext_modules=[Extension("dflash_gguf.quantize._kernels", ["dflash_gguf/quantize/_kernels.c"],
                           depends=["dflash_gguf/quantize/_kquants.h"],
                           extra_compile_args=_FLAGS, optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
