"""Family registries: each family is a module that declares the ``ARCHITECTURES`` (config.json
``architectures[0]`` values) it handles; a package lists its family modules and maps architectures to them."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType


def by_architecture(package: str, modules: Iterable[str]) -> dict[str, ModuleType]:
    """``architectures[0]`` -> the family module of ``package`` that declares it."""
    out: dict[str, ModuleType] = {}
    for name in modules:
        mod = importlib.import_module(f"{package}.{name}")
        out.update(dict.fromkeys(mod.ARCHITECTURES, mod))
    return out
