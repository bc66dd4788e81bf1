"""Every file type llama-quantize b11434 makes, by the names it accepts (``QUANT_OPTIONS`` in
tools/quantize/quantize.cpp, matched case-insensitively), with what the pipeline needs to know of each.

``bits`` is the average bits per weight of a whole file, for size estimates only: the block size for the uniform
types (Q4_0: 4.5), and for the mixtures the size llama-quantize's own table gives for Llama-3-8B (Q4_K_M: 4.58 GB
of 8.03 B weights). ``needs_imatrix``: b11434 refuses to make the type without an importance matrix
(``tensor_requires_imatrix`` in src/llama-quant.cpp: the IQ1/IQ2/IQ3_XXS targets, and Q2_K inside Q2_K_S).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuantizeError


@dataclass(frozen=True)
class QuantType:
    """One llama-quantize file type."""

    name: str  # as llama-quantize spells it: "Q4_K_M"
    bits: float
    needs_imatrix: bool = False

    @property
    def key(self) -> str:
        """The lower-case name the pipeline's options, pair.json and file stages use: "q4_k_m"."""
        return self.name.lower()

    @property
    def unquantized(self) -> bool:
        return self.name in ("F16", "BF16", "F32")


_LLAMA3_8B_WEIGHTS = 8.03e9


def _mix(gigabytes: float) -> float:
    """Bits per weight of a mixture from its Llama-3-8B file size in llama-quantize's table."""
    return gigabytes * 1e9 * 8 / _LLAMA3_8B_WEIGHTS


TYPES: tuple[QuantType, ...] = (
    QuantType("Q1_0", 1.125), QuantType("Q2_0", 2.25), QuantType("Q4_0", 4.5), QuantType("Q4_1", 5.0),
    QuantType("MXFP4_MOE", 4.25), QuantType("Q5_0", 5.5), QuantType("Q5_1", 6.0),
    QuantType("IQ2_XXS", 2.06, True), QuantType("IQ2_XS", 2.31, True), QuantType("IQ2_S", 2.5, True),
    QuantType("IQ2_M", 2.7, True), QuantType("IQ1_S", 1.56, True), QuantType("IQ1_M", 1.75, True),
    QuantType("TQ1_0", 1.69), QuantType("TQ2_0", 2.06), QuantType("Q2_K", _mix(2.96)),
    QuantType("Q2_K_S", _mix(2.96), True), QuantType("IQ3_XXS", 3.06, True), QuantType("IQ3_S", 3.44),
    QuantType("IQ3_M", 3.66), QuantType("IQ3_XS", 3.3), QuantType("Q3_K_S", _mix(3.41)),
    QuantType("Q3_K_M", _mix(3.74)), QuantType("Q3_K_L", _mix(4.03)), QuantType("IQ4_NL", 4.5),
    QuantType("IQ4_XS", 4.25), QuantType("Q4_K_S", _mix(4.37)), QuantType("Q4_K_M", _mix(4.58)),
    QuantType("Q5_K_S", _mix(5.21)), QuantType("Q5_K_M", _mix(5.33)), QuantType("Q6_K", 6.5625),
    QuantType("Q8_0", 8.5), QuantType("F16", 16.0), QuantType("BF16", 16.0), QuantType("F32", 32.0),
)
# llama-quantize's aliases: the file it writes is of the type aliased (and named so here).
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
_BY_KEY = {t.key: t for t in TYPES}
NAMES = tuple(t.name for t in TYPES)


def quant_type(name: str, flag: str = "type") -> QuantType:
    """The type ``name`` denotes (any case; Q4_K is Q4_K_M, as llama-quantize reads it).

    Raises:
        QuantizeError: not a type llama-quantize b11434 makes (COPY included: it quantizes nothing).
    """
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _BY_KEY:
        raise QuantizeError(f"{flag} {name!r} is not a type llama-quantize b11434 makes. Choose one of "
                            f"{', '.join(NAMES)} (any case).")
    return _BY_KEY[key]
