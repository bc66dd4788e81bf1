"""Real llama.cpp b11434 loads what we write, and fails on what we refuse for the reason we give."""

from __future__ import annotations

from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS

from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import DflashGgufError

LOADABLE = [("gemma4", "default", "auto"), ("qwen3", "default", "auto"), ("gemma4", "more_taps_than_layers", "auto"),
            ("gemma4", "is_causal_false", "f16"), ("qwen3", "mask_top_level_only", "q8_0")]


@pytest.mark.reference
@pytest.mark.parametrize(("family", "variant", "outtype"), LOADABLE)
def test_llama_cpp_loads_our_drafters(tmp_path: Path, targets: dict[str, Path], family: str, variant: str,
                                      outtype: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    target = targets[family]  # the Qwen target goes through the guard when the sdist is missing
    drafter = mf.make_drafter(tmp_path, target=family, variant=variant)
    out = tmp_path / "d.gguf"
    convert_drafter(drafter, target, out, outtype)
    loaded, log = reference.load_with_libllama(out)
    assert loaded, log[-3000:]
    assert "DFlash extract_layers" in log
    q8 = tmp_path / "d-q8_0.gguf"
    proc = reference.run_llama_quantize(out, q8, "Q8_0")  # runs the dflash hparams loader
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    REFERENCE_COMPARISONS.append(f"llama-load-ours/{family}/{variant}/{outtype}")


# variant -> the text llama.cpp b11434 prints when it meets the file b11434's converter writes for it;
# our converter refuses the same drafter, quoting that reason.
LLAMA_FAILURES = [
    ("no_taps", "requires 'target_layers'"),
    ("attention_bias", "wrong number of tensors"),
    ("missing_tensor", "not found"),
    ("fc_width_wrong", "wrong shape"),
]


@pytest.mark.reference
@pytest.mark.parametrize(("variant", "llama_error"), LLAMA_FAILURES)
def test_refusals_match_llama_cpp_failures(tmp_path: Path, targets: dict[str, Path], variant: str,
                                           llama_error: str) -> None:
    drafter = mf.make_drafter(tmp_path, target="gemma4", variant=variant)
    with pytest.raises(DflashGgufError) as ours:
        convert_drafter(drafter, targets["gemma4"], tmp_path / "ours.gguf")
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    ref = tmp_path / "ref.gguf"
    proc = reference.run_reference_convert(drafter, targets["gemma4"], ref)
    assert proc.returncode == 0, proc.stderr[-2000:]  # b11434's converter writes the defective file
    loaded, log = reference.load_with_libllama(ref)
    assert not loaded
    assert llama_error in log, log[-3000:]
    assert llama_error.strip("'") in str(ours.value)
    REFERENCE_COMPARISONS.append(f"llama-load/{variant}")


@pytest.mark.reference
def test_unmappable_tensor_also_stops_the_reference(tmp_path: Path, targets: dict[str, Path]) -> None:
    """An unknown per-block tensor: b11434's converter itself stops; we refuse with the loader's reason."""
    drafter = mf.make_drafter(tmp_path, target="gemma4", variant="unexpected_tensor")
    with pytest.raises(DflashGgufError, match="wrong number of tensors"):
        convert_drafter(drafter, targets["gemma4"], tmp_path / "ours.gguf")
    reference.require_or_skip(reference.reference_available())
    proc = reference.run_reference_convert(drafter, targets["gemma4"], tmp_path / "ref.gguf")
    assert proc.returncode != 0 and "Can not map tensor" in proc.stderr
    REFERENCE_COMPARISONS.append("reference-convert-stops/unexpected_tensor")
