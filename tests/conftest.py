"""Shared fixtures: tiny HF repos generated offline per session, and a count of reference comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import make_fixtures  # noqa: E402
import reference  # noqa: E402

REFERENCE_COMPARISONS: list[str] = []


def llama_cpp_src() -> Path | None:
    src = reference.env.llama_cpp_src()
    return src if (src / "models" / "ggml-vocab-qwen2.gguf").is_file() else None


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The standard targets and drafters (Qwen ones only when the b11434 sdist is present)."""
    return make_fixtures.make_all(tmp_path_factory.mktemp("fx"), llama_cpp_src=llama_cpp_src())


@pytest.fixture(scope="session")
def targets(fixtures: dict[str, Path]) -> dict[str, Path]:
    return {"gemma4": fixtures["gemma-4-tiny-it"], **({"qwen3": fixtures["qwen3-tiny"]} if "qwen3-tiny" in fixtures
                                                     else {})}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REFERENCE_COMPARISONS:
        terminalreporter.write_line(
            f"reference comparisons against llama.cpp b11434: {len(REFERENCE_COMPARISONS)} ran "
            f"({', '.join(REFERENCE_COMPARISONS)})")
    else:
        terminalreporter.write_line("reference comparisons against llama.cpp b11434: 0 ran")
