"""Every type llama-quantize b11434 makes, by its names: accepted by --quant, --draft-quant and ``quantize``; made by
the built-in in one pass where it can (q4_0, q8_0), else by llama-quantize from the BF16 conversion exactly as a
user would run it; refused before anything is fetched when it cannot be made here.
"""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli, use_kernels
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dflash_gguf.errors import QuantizeError
from dflash_gguf.pipeline.naming import gguf_name, size_ratio
from dflash_gguf.quantize import kernels, native
from dflash_gguf.quantize.rules import OVERRIDE_TYPES, SUPPORTED_TYPES
from dflash_gguf.quantize.types import NAMES, TENSOR_TYPES, TYPES, ggml_type, quant_type

Q = GGMLQuantizationType


def test_the_names_are_llama_quantizes_in_any_case() -> None:
    assert quant_type("q4_k_m").name == "Q4_K_M" and quant_type("Q4_K").name == "Q4_K_M"  # llama-quantize's alias
    assert quant_type("iq4_xs").key == "iq4_xs" and quant_type("BF16").unquantized
    assert quant_type("IQ2_XXS").needs_imatrix and quant_type("Q2_K_S").needs_imatrix
    assert not quant_type("Q2_K").needs_imatrix and not quant_type("IQ3_S").needs_imatrix
    for bad in ("COPY", "q4_k_x", "fp8"):
        with pytest.raises(QuantizeError, match="not a type llama-quantize b11434 makes"):
            quant_type(bad)
    assert {"Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "MXFP4_MOE", "Q8_0"} <= set(NAMES)
    assert gguf_name("gemma-4-12B-it", "q4_k_m") == "gemma-4-12B-it-Q4_K_M.gguf"
    assert size_ratio("q4_0") == pytest.approx(18 / 64) and size_ratio("q8_0") == pytest.approx(34 / 64)
    assert 0.28 < size_ratio("q4_k_m") < 0.29  # 4.58 GB for Llama-3-8B's 8.03 B weights


def test_one_record_per_tensor_type_and_the_file_types_follow_them() -> None:
    """Each tensor type has one record, with ggml's block geometry; a file type's facts come from its default tensor
    type's: the built-in makes exactly the file types whose tensor type it makes, and needs an importance matrix
    where b11434's tensor_requires_imatrix does (the IQ1/IQ2/IQ3_XXS types, and Q2_K in a Q2_K_S file)."""
    assert len({t.qtype for t in TENSOR_TYPES}) == len(TENSOR_TYPES)
    for t in TENSOR_TYPES:
        assert (t.block_size, t.type_size) == GGML_QUANT_SIZES[t.qtype], t.name
        assert ggml_type(int(t.qtype)) is t
        if t.kernel is not None:  # a kernel implies the rest of the built-in's facts
            assert t.builtin and t.scales is not None and t.compiled, t.name
        if t.fallback is not None:  # a 256-block type falls back to a 32-block one
            assert t.block_size == 256 and ggml_type(t.fallback).block_size == 32, t.name
    for f in TYPES:
        if f.tensor is not None:
            ggml_type(f.tensor)
    assert set(SUPPORTED_TYPES) == {f.key for f in TYPES if f.tensor is not None and ggml_type(f.tensor).builtin}
    assert {f.name for f in TYPES if f.needs_imatrix} == {
        "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "Q2_K_S"}
    assert {f.name for f in TYPES if f.unquantized} == {"F16", "BF16", "F32"}
    assert list(OVERRIDE_TYPES) == ["q4_0", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16", "f32"]


def test_the_compiled_dispatch_takes_exactly_the_recorded_types() -> None:
    """The extension's own type switch (``_kernels.c``) against the records, for every id up to 63: it quantizes to
    exactly the types with a kernel (by their c_id, in blocks of their size), reads exactly the types with a source
    dtype, and checks exactly the types with a scale layout."""
    for _ in use_kernels("compiled"):  # skips (fails on CI) without the extension
        lib = native.compiled()
        assert lib is not None
        by_id = {t.c_id: t for t in TENSOR_TYPES if t.c_id is not None}
        for c_id in range(64):
            t = by_id.get(c_id)
            src = np.zeros(3 * (t.block_size if t is not None else 32), np.float32)
            if t is not None and t.compiled:
                lib.quantize(src, int(Q.F32), np.empty(3 * t.type_size, np.uint8), c_id)
                with pytest.raises(ValueError, match="destination size"):
                    lib.quantize(src, int(Q.F32), np.empty(3 * t.type_size + 2, np.uint8), c_id)
            else:
                with pytest.raises(ValueError, match="destination type"):
                    lib.quantize(src, int(Q.F32), np.empty(64, np.uint8), c_id)
            q8 = np.empty(ggml_type(Q.Q8_0).type_size, np.uint8)
            if t is not None and t.values_dtype is not None:
                lib.quantize(np.zeros(32, t.values_dtype), c_id, q8, int(Q.Q8_0))
            else:
                with pytest.raises(ValueError, match="source type"):
                    lib.quantize(np.zeros(32, np.float32), c_id, q8, int(Q.Q8_0))
            if t is not None and t.scales is not None:
                assert lib.count_nonfinite(np.zeros(4 * t.type_size, np.uint8), c_id) == 0
            else:
                with pytest.raises(ValueError, match="type must be"):
                    lib.count_nonfinite(np.zeros(64, np.uint8), c_id)


def test_count_nonfinite_reads_where_each_record_says(kernel_path: str) -> None:
    """An infinite fp16 scale or value, or an E8M0 exponent 0xFF, at each place a record's scale layout names is
    counted once, by both kernel paths."""
    inf16 = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    for t in TENSOR_TYPES:
        if t.scales is None:
            continue
        if t.block_size == 1:  # a float type: one infinite value among finite ones
            assert t.values_dtype is not None
            bits = np.zeros(8, t.values_dtype).view(np.uint8).copy()
            mask = t.scales.exponent_mask.to_bytes(t.type_size, "little")
            bits[t.type_size:2 * t.type_size] = np.frombuffer(mask, np.uint8)
            assert kernels.count_nonfinite(bits, t.qtype) == 1, t.name
            continue
        if t.kernel is None:  # IQ4_NL / IQ4_XS: made by the compiled weighted kernels only
            if not kernel_path.startswith("compiled"):
                continue
            data = kernels.quantize_weighted(np.zeros(4 * t.block_size, np.float32), Q.F32, t.qtype, t.block_size,
                                             None)
        else:
            data = kernels.quantize_rows(np.zeros(4 * t.block_size, np.float32), Q.F32, t.qtype)
        assert kernels.count_nonfinite(data, t.qtype) == 0, t.name
        for at in t.scales.fp16_at:
            bad = data.copy()
            bad[t.type_size + at:t.type_size + at + 2] = inf16
            assert kernels.count_nonfinite(bad, t.qtype) == 1, (t.name, at)
        for at in t.scales.e8m0_at:
            bad = data.copy()
            bad[t.type_size + at] = 0xFF
            assert kernels.count_nonfinite(bad, t.qtype) == 1, (t.name, at)


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    return mf.make_gemma4_target(tmp_path / "targets"), mf.make_drafter(tmp_path / "drafters", target="gemma4")


def test_what_cannot_be_made_here_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    target, drafter = _pair(tmp_path)
    out = tmp_path / "pair"
    iq2 = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "IQ2_XXS")
    assert iq2.returncode == 8 and "IQ2_XXS needs an importance matrix" in iq2.stderr and "--imatrix" in iq2.stderr
    assert not out.exists()
    drafter_iq = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out,
                         "--draft-quant", "iq1_m")
    assert drafter_iq.returncode == 8 and "--draft-quant IQ1_M needs an importance matrix" in drafter_iq.stderr
    bad = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "Q4_K_X")
    assert bad.returncode == 2 and "Q4_K_M" in bad.stderr and not out.exists()  # the list of names
    outfile = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outfile", tmp_path / "d.gguf",
                      "--quant", "q4_k_m")
    assert outfile.returncode == 2 and "run the pipeline" in outfile.stderr and not (tmp_path / "d.gguf").exists()
    missing = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant",
                      "IQ3_S", "--quantizer", "builtin")
    assert missing.returncode == 8 and "IQ3_S is made by llama-quantize" in missing.stderr and not out.exists()


@pytest.mark.reference
def test_a_k_quant_pipeline_is_llama_quantize_on_the_bf16_conversion(tmp_path: Path) -> None:
    """--quant Q4_K_M --draft-quant q6_k --quantizer llama-quantize: the target through llama-quantize from the BF16
    conversion (kept here),
    byte for byte what running llama-quantize by hand on that file gives; the names, the plan and pair.json follow
    the type."""
    reference.require_or_skip(reference.llama_cpp_available())
    target, drafter = _pair(tmp_path)
    out = tmp_path / "pair"
    env = {"LLAMA_QUANTIZE": str(reference.llama_bin("llama-quantize"))}
    plan = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "q4_k_m",
                   "--draft-quant", "Q6_K", "--quantizer", "llama-quantize", "--dry-run", env=env)
    assert plan.returncode == 0 and "gemma-4-tiny-it-Q4_K_M.gguf" in plan.stdout, plan.stdout + plan.stderr
    assert "(intermediate" in plan.stdout  # K-quants go through the BF16 file
    run = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "q4_k_m",
                  "--draft-quant", "Q6_K", "--keep-intermediate", "--quantizer", "llama-quantize", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "pair.json").read_text())
    made = doc["outputs"]["target"]
    assert made["file"] == "gemma-4-tiny-it-Q4_K_M.gguf" and made["type"] == "q4_k_m"
    assert made["made_by"].startswith("llama-quantize")
    assert doc["outputs"]["drafter"]["file"] == "dflash-gemma-4-tiny-it-Q6_K.gguf"
    by_hand = tmp_path / "by-hand-Q4_K_M.gguf"
    proc = reference.run_llama_quantize(out / made["intermediate"]["file"], by_hand, "Q4_K_M")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / made["file"]).read_bytes() == by_hand.read_bytes()
    assert run_cli("dflash-verify", out / "pair.json").returncode == 0
    REFERENCE_COMPARISONS.append("pipeline --quant Q4_K_M = llama-quantize by hand")


@pytest.mark.reference
@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_s"])
def test_a_k_quant_pipeline_converts_and_quantizes_in_one_pass(tmp_path: Path, quant: str) -> None:
    """--quant Q4_K_M with the built-in: one pass from safetensors to the final file, no BF16 on disk, and the bytes
    llama-quantize makes from the BF16 conversion; the drafter at its own K-quant likewise."""
    reference.require_or_skip(reference.llama_cpp_available())
    from gguf_compare import diff

    from dflash_gguf.convert.targets import convert_target
    from dflash_gguf.drafters import convert_drafter

    target, drafter = _pair(tmp_path)
    out = tmp_path / "pair"
    run = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", quant,
                  "--draft-quant", "q6_k", "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "converting and quantizing in one pass" in run.stderr and not list(out.glob("*BF16*"))
    doc = json.loads((out / "pair.json").read_text())
    made = doc["outputs"]["target"]
    assert made["file"] == f"gemma-4-tiny-it-{quant.upper()}.gguf"
    assert made["made_by"] == "built-in converter and quantizer in one pass"
    bf16 = convert_target(target, tmp_path / "t-BF16.gguf", "bf16").outfile
    by_hand = tmp_path / "by-hand.gguf"
    assert reference.run_llama_quantize(bf16, by_hand, quant.upper()).returncode == 0
    assert diff(out / made["file"], by_hand) == []
    d_bf16 = convert_drafter(drafter, target, tmp_path / "d-BF16.gguf", "bf16").outfile
    d_hand = tmp_path / "d-by-hand.gguf"
    assert reference.run_llama_quantize(d_bf16, d_hand, "Q6_K").returncode == 0
    assert diff(out / doc["outputs"]["drafter"]["file"], d_hand) == []
    REFERENCE_COMPARISONS.append(f"pipeline --quant {quant} one pass = convert + llama-quantize")


@pytest.mark.reference
def test_quantize_passes_any_type_to_llama_quantize(tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    from dflash_gguf.convert.targets import convert_target

    target, _ = _pair(tmp_path)
    bf16 = tmp_path / "t-BF16.gguf"
    convert_target(target, bf16, "bf16")
    ours = tmp_path / "ours-Q3_K_M.gguf"
    run = run_cli("dflash-gguf", "quantize", bf16, ours, "q3_k_m", "--json",
                  env={"LLAMA_QUANTIZE": str(reference.llama_bin("llama-quantize"))})
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["quantizer"] == "llama-quantize"
    by_hand = tmp_path / "by-hand.gguf"
    assert reference.run_llama_quantize(bf16, by_hand, "Q3_K_M").returncode == 0
    assert ours.read_bytes() == by_hand.read_bytes()
    refused = run_cli("dflash-gguf", "quantize", bf16, tmp_path / "x.gguf", "iq2_xs")
    assert refused.returncode == 8 and "needs an importance matrix" in refused.stderr
    REFERENCE_COMPARISONS.append("quantize Q3_K_M = llama-quantize by hand")


@pytest.mark.reference
def test_the_qat_recipe_pure_q4_0_with_a_q8_0_token_embedding(tmp_path: Path) -> None:
    """--pure --token-embedding-type q8_0 on the target (ggml-org's recipe for Gemma's QAT checkpoints): what
    llama-quantize makes with those flags from the same BF16 file, and no Q6_K output rule."""
    reference.require_or_skip(reference.llama_cpp_available())
    from gguf_compare import diff

    from dflash_gguf.ggufio.reader import read_gguf

    target, drafter = _pair(tmp_path)
    out = tmp_path / "pair"
    run = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out, "--quant", "q4_0",
                  "--pure", "--token-embedding-type", "q8_0", "--keep-intermediate")
    assert run.returncode == 0, run.stdout + run.stderr
    made = json.loads((out / "pair.json").read_text())["outputs"]["target"]
    types = {name: t.qtype for name, t in read_gguf(out / made["file"]).tensors.items()}
    assert types["token_embd.weight"] == 8 and 14 not in types.values()  # Q8_0 embedding, no Q6_K anywhere
    by_hand = tmp_path / "by-hand.gguf"
    proc = reference.run_llama_quantize(out / made["intermediate"]["file"], by_hand, "Q4_0", "--pure",
                                        "--token-embedding-type", "q8_0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert diff(out / made["file"], by_hand) == []
    REFERENCE_COMPARISONS.append("pipeline --pure q4_0 --token-embedding-type q8_0 = llama-quantize")


def test_a_qat_target_gets_ggml_orgs_recipe_named(tmp_path: Path) -> None:
    """A QAT checkpoint (its name says so) converted with the default mixture: the run says what ggml-org does with
    such targets and which flags do it; with those flags it says nothing."""
    qat = mf.make_gemma4_target(tmp_path / "targets", qat=True)
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    common = ("--target", qat, "--drafter", drafter, "--allow-derived-target", "--dry-run")
    plain = run_cli("dflash-convert", *common, "--outdir", tmp_path / "a")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "note: " in plain.stdout and "quantization-aware trained (QAT)" in plain.stdout, plain.stdout
    assert "--quant q4_0 --pure --token-embedding-type q8_0" in plain.stdout
    recipe = run_cli("dflash-convert", *common, "--outdir", tmp_path / "b", "--pure", "--token-embedding-type", "q8_0")
    assert recipe.returncode == 0 and "note: " not in recipe.stdout, recipe.stdout + recipe.stderr
    unqat = run_cli("dflash-convert", "--target", mf.make_gemma4_target(tmp_path / "plain"), "--drafter", drafter,
                    "--dry-run", "--outdir", tmp_path / "c")
    assert unqat.returncode == 0 and "note: " not in unqat.stdout, unqat.stdout
