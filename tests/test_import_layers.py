"""The package's imports run one way: cli → publish → forecast → pipeline → tune → verify → sidecar →
tokenizer_fixups → hub → drafters → convert → quantize → ggufio → the base modules, with no circle between modules,
and a drafter family's package reached from outside ``drafters/`` only through the registry
(``dflash_gguf.drafters``) and its shared records (``drafters.findings``, ``drafters.family``). Every import counts,
those inside functions too."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import dflash_gguf

PACKAGE = Path(dflash_gguf.__file__).parent
# Lowest first. A module belongs to the longest prefix listed; anything else in the package is a base module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ggufio",),
    ("quantize",),
    ("convert",),
    ("drafters",),
    ("hub",),
    ("tokenizer_fixups",),
    ("sidecar",),
    ("verify",),
    ("tune",),
    ("pipeline",),
    ("forecast",),
    ("publish",),
    ("cli",),
)
FAMILY_SHARED = ("findings", "family")  # drafters' modules every layer above may import


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(root, path): path for path in sorted(root.rglob("*.py"))}


def import_edges(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    modules = _modules(root)
    top = root.name
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.split(".")[0] == top:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    folder = root.parent.joinpath(*target.split("."))
                    if sub not in modules and any(folder.glob(f"{alias.name}.*")):
                        continue  # a compiled extension (its .c / .pyi / .so): no Python imports of its own
                    edges[name].add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name.split(".")[0] == top)
    return edges


def _layer(module: str) -> int:
    """The rank of a module's layer (-1: a base module)."""
    inner = module.split(".")[1:]
    return next((rank for rank, prefixes in enumerate(LAYERS) if inner and inner[0] in prefixes), -1)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer, and every reach into a drafter family's package from outside drafters/."""
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            if _layer(dst) > _layer(src):
                bad.append(f"{src} imports {dst}")
            parts = dst.split(".")
            if (len(parts) > 2 and parts[1] == "drafters" and parts[2] not in FAMILY_SHARED
                    and src.split(".")[1:2] != ["drafters"]):
                bad.append(f"{src} reaches into drafter family {dst} (ask the registry, dflash_gguf.drafters)")
    return sorted(bad)


def test_imports_run_one_way_with_no_circle() -> None:
    edges = import_edges(PACKAGE)
    assert len(edges) > 100  # every module was read
    assert circles(edges) == []
    assert upward(edges) == []


def test_the_check_fails_on_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    copy = tmp_path / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    vocab = copy / "convert" / "vocab.py"
    vocab.write_text(vocab.read_text(encoding="utf-8") + "\n\ndef _planted() -> None:\n"
                     "    from ..tune import report  # noqa: F401\n", encoding="utf-8")
    dspark = copy / "drafters" / "dspark" / "rules.py"
    dspark.write_text(dspark.read_text(encoding="utf-8") + "\nfrom ...pipeline import stages  # noqa: E402\n",
                      encoding="utf-8")
    edges = import_edges(copy)
    assert "dflash_gguf.convert.vocab imports dflash_gguf.tune.report" in upward(edges)
    assert "dflash_gguf.drafters.dspark.rules imports dflash_gguf.pipeline.stages" in upward(edges)
    # tune.report imports the drafters registry, which imports convert: the planted import closes a circle
    assert any("dflash_gguf.convert.vocab" in group and "dflash_gguf.tune.report" in group
               for group in circles(edges))
