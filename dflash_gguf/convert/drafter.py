"""Convert any drafter checkpoint for llama.cpp b11434: its family (read from config.json) converts it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import drafters
from .result import ConvertResult


def convert_drafter(
    drafter_dir: Path,
    target_dir: Path,
    outfile: Path,
    outtype: str = "auto",
    *,
    tokenizer_dir: Path | None = None,
    provenance: dict[str, str] | None = None,
    quant: str | None = None,
    dry_run: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert the drafter in ``drafter_dir`` for the target in ``target_dir`` into ``outfile``.

    ``tokenizer_dir`` (default: ``target_dir``) is where the target's tokenizer files are read, so a repaired
    overlay can stand in for a read-only snapshot. ``provenance`` adds our own keys. ``quant`` ("q4_0", "q8_0",
    ...) quantizes in the same pass, giving the bytes of converting to ``outtype`` and then running
    llama-quantize, with no intermediate file.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, IncompatiblePairError, TokenizerError,
        InputError, OutputError: each with a message naming the file, the field and the fix.
    """
    reading = drafters.interpret_folder(Path(drafter_dir))
    if reading.family is None:
        reading.require()  # not a drafter any family reads: its error finding says so
    family = drafters.family_named(str(reading.family))
    return family.converter().convert(reading, Path(drafter_dir), Path(target_dir), outfile, outtype,
                                      tokenizer_dir=tokenizer_dir, provenance=provenance, quant=quant,
                                      dry_run=dry_run, on_progress=on_progress)


__all__ = ["convert_drafter"]
