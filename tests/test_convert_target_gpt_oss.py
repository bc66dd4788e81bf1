"""The built-in gpt-oss target converter (openai/gpt-oss-20b, gpt-oss-120b): parity with llama.cpp b11434's
``GptOssModel`` on the MXFP4 release and the BF16 re-release, libllama loading, the one pass (and its refusal on
MXFP4 experts, as llama-quantize's), the MXFP4 repack and the gate/up split checked on their own, refusals.

Targets are ``fixtures.gpt_oss.make_gpt_oss_target``: the real config layout, MXFP4 blocks and scales (or BF16
experts), attention sinks, biases, yarn rope scaling, alternating sliding / full attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.gpt_oss import GPT_OSS_SIZES, gpt_oss_tensors
from fixtures.safetensors_io import write_safetensors
from gguf import GGMLQuantizationType, quants
from gguf_compare import diff, read_tensors_fast

from dflash_gguf.convert.safetensors import index_checkpoint
from dflash_gguf.convert.targets import SUPPORTED_ARCHITECTURES, builtin_family, convert_target
from dflash_gguf.convert.targets.gpt_oss import repack_mxfp4
from dflash_gguf.convert.tensor_io import to_f32
from dflash_gguf.errors import ConfigError, DflashGgufError, QuantizeError, TensorError
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.quantize import quantize_gguf

E, FF, H, L = GPT_OSS_SIZES["experts"], GPT_OSS_SIZES["intermediate"], GPT_OSS_SIZES["hidden"], GPT_OSS_SIZES["layers"]
FIXTURES = {"mxfp4": {}, "bf16": {"mxfp4": False}}  # name -> make_gpt_oss_target keywords
# (fixture, outtype) converted by both tools and compared byte for byte
PARITY_CASES = [("mxfp4", "auto"), ("mxfp4", "bf16"), ("mxfp4", "f16"), ("mxfp4", "q8_0"),
                ("bf16", "auto"), ("bf16", "f16"), ("bf16", "q8_0")]
# FP4 (E2M1) code -> value, as the checkpoint's MXFP4 format defines it
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


@pytest.fixture(scope="module")
def oss_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture targets by name, made on first use."""
    return reference.FixtureTargets(tmp_path_factory.mktemp("gpt-oss-fx"), mf.make_gpt_oss_target, FIXTURES)


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory: pytest.TempPathFactory, oss_dirs: dict[str, Path]) -> dict:
    """b11434's convert_hf_to_gguf.py output per (fixture, outtype), converted once."""
    return reference.ReferenceConversions(tmp_path_factory.mktemp("gpt-oss-ref"), oss_dirs)




def _raw(model: Path, name: str) -> np.ndarray:
    ref = index_checkpoint(model)[name]
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.nbytes)
    if ref.dtype == "U8":
        return np.frombuffer(data, dtype=np.uint8).reshape(ref.shape)
    return to_f32(data, ref.dtype).reshape(ref.shape)


def _decode_checkpoint_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's MXFP4 as values, straight from its definition (byte i of a block: values 2i low, 2i+1 high)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = FP4_VALUES[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


# ----------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, oss_dirs: dict[str, Path], reference_outputs: dict, name: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    ours = tmp_path / "ours.gguf"
    result = convert_target(oss_dirs[name], ours, outtype)
    assert diff(ours, reference_outputs[(name, outtype)]) == []
    assert result.vocab.model == "gpt2/qwen2" and result.outtype == ("bf16" if outtype == "auto" else outtype)
    REFERENCE_COMPARISONS.append(f"target/gpt-oss-{name}/{outtype}")


@pytest.mark.reference
@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_one_pass_equals_convert_then_llama_quantize(tmp_path: Path, oss_dirs: dict[str, Path],
                                                     reference_outputs: dict, quant: str) -> None:
    """The BF16 re-release: experts requantized like every other matrix, byte for byte llama-quantize's."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_one_pass_parity(oss_dirs["bf16"], reference_outputs[("bf16", "bf16")], quant, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/gpt-oss-bf16/one-pass-{quant}")


@pytest.mark.reference
@pytest.mark.parametrize("name", ["mxfp4", "bf16"])
def test_one_pass_mxfp4_moe_equals_convert_then_llama_quantize(tmp_path: Path, oss_dirs: dict[str, Path],
                                                               reference_outputs: dict, name: str) -> None:
    """llama-quantize's MXFP4_MOE: the expert stacks MXFP4 (the release's own blocks kept as they are; the BF16
    re-release's quantized by quantize_row_mxfp4_ref), every other matrix Q8_0, the output Q8_0."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    ours = reference.assert_one_pass_parity(oss_dirs[name], reference_outputs[(name, "bf16")], "MXFP4_MOE",
                                            tmp_path)
    types = {qtype for qtype, _, _ in read_tensors_fast(ours).values()}
    assert types == {"MXFP4", "Q8_0", "F32"}, types
    REFERENCE_COMPARISONS.append(f"target/gpt-oss-{name}/one-pass-mxfp4_moe")


@pytest.mark.reference
@pytest.mark.parametrize("quantizer", ["builtin", "llama-quantize"])
def test_quantize_keeps_the_mxfp4_experts_of_a_converted_release(tmp_path: Path, reference_outputs: dict,
                                                                 quantizer: str) -> None:
    """Two steps (b11434's BF16 conversion, then ``dflash-gguf quantize``): MXFP4_MOE keeps the experts, with either
    quantizer, and a type that would requantize them is refused before either runs, with llama-quantize's reason."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    src, binary = reference_outputs[("mxfp4", "bf16")], reference.llama_bin("llama-quantize")
    ref = tmp_path / "ref.gguf"
    proc = reference.run_llama_quantize(src, ref, "MXFP4_MOE")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = tmp_path / "ours.gguf"
    quantize_gguf(src, ours, "MXFP4_MOE", quantizer=quantizer, llama_quantize=binary)
    assert diff(ours, ref) == []
    with pytest.raises(QuantizeError, match="requantizing from type mxfp4 is disabled"):
        quantize_gguf(src, tmp_path / "q4.gguf", "q4_0", quantizer=quantizer, llama_quantize=binary)
    assert not (tmp_path / "q4.gguf").exists()
    REFERENCE_COMPARISONS.append(f"target/gpt-oss-mxfp4/quantize-mxfp4_moe [{quantizer}]")


@pytest.mark.reference
def test_one_pass_refuses_mxfp4_experts_as_llama_quantize_does(tmp_path: Path, oss_dirs: dict[str, Path],
                                                               reference_outputs: dict) -> None:
    """llama-quantize stops on the MXFP4 experts ('requantizing from type mxfp4 is disabled'); so does the one
    pass, and it leaves nothing behind."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    proc = reference.run_llama_quantize(reference_outputs[("mxfp4", "bf16")], tmp_path / "ref.gguf", "q4_0")
    assert proc.returncode != 0 and "requantizing from type mxfp4 is disabled" in proc.stderr, proc.stderr[-2000:]
    out = tmp_path / "out" / "ours.gguf"
    out.parent.mkdir()
    with pytest.raises(DflashGgufError, match="MXFP4"):
        convert_target(oss_dirs["mxfp4"], out, "bf16", quant="q4_0")
    assert list(out.parent.iterdir()) == []
    REFERENCE_COMPARISONS.append("target/gpt-oss-mxfp4/one-pass-q4_0-refused")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), [("mxfp4", "auto"), ("mxfp4", "q8_0"), ("bf16", "q4_0")])
def test_libllama_loads_it(tmp_path: Path, oss_dirs: dict[str, Path], name: str, outtype: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_libllama_loads_target(oss_dirs[name], outtype, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/gpt-oss-{name}/{outtype}/libllama")


# ------------------------------------------------------------------------- what is written, on its own


def test_registered() -> None:
    assert SUPPORTED_ARCHITECTURES["GptOssForCausalLM"] == "gpt_oss"


def test_repack_is_the_checkpoint_values_in_ggml_layout() -> None:
    """Independent of b11434: our repacked blocks decode (gguf-py's MXFP4 dequantizer) to the values the
    checkpoint's MXFP4 definition gives."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, size=(3, 5, 2), dtype=np.uint8)
    packed = repack_mxfp4(blocks, scales)
    assert packed.shape == (3, 5, 2, 17) and (packed[..., 0] == scales).all()
    got = quants.dequantize(packed.reshape(3, 5, 34), GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got, _decode_checkpoint_mxfp4(blocks, scales))


def test_mxfp4_experts_keys_and_split(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    """MXFP4 experts first and MXFP4 whatever the outtype; gate = even rows of gate_up, up = odd rows; biases split
    by even / odd column; router F32; the gpt-oss keys."""
    model = oss_dirs["mxfp4"]
    out = convert_target(model, tmp_path / "o.gguf", "bf16").outfile
    meta, ts = read_gguf(out), read_tensors_fast(out)
    assert list(ts)[:3] == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    assert meta.get("general.file_type") == 38  # MOSTLY_MXFP4_MOE
    assert meta.get("gpt-oss.attention.sliding_window") == GPT_OSS_SIZES["sliding_window"]
    assert meta.get("gpt-oss.expert_feed_forward_length") == FF
    assert meta.get("gpt-oss.rope.scaling.type") == "yarn"
    p = "model.layers.1.mlp.experts."
    gate_up = _decode_checkpoint_mxfp4(_raw(model, p + "gate_up_proj_blocks"), _raw(model, p + "gate_up_proj_scales"))
    for kind, start in (("gate", 0), ("up", 1)):
        qtype, ne, data = ts[f"blk.1.ffn_{kind}_exps.weight"]
        assert (qtype, ne) == ("MXFP4", [H, FF, E])
        got = quants.dequantize(np.frombuffer(data, np.uint8).reshape(E, FF, -1), GGMLQuantizationType.MXFP4)
        np.testing.assert_array_equal(got, gate_up[:, start::2])
        qtype, ne, data = ts[f"blk.1.ffn_{kind}_exps.bias"]
        assert (qtype, ne) == ("F32", [FF, E])
        np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(E, FF),
                                      _raw(model, p + "gate_up_proj_bias")[:, start::2])
    assert ts["blk.1.ffn_down_exps.weight"][:2] == ("MXFP4", [FF, H, E])
    assert ts["blk.1.ffn_gate_inp.weight"][0] == "F32" and ts["blk.1.attn_sinks.weight"][:2] == ("F32", [4])
    assert "blk.1.post_attention_norm.weight" in ts


def test_bf16_experts_transposed_and_split(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    model = oss_dirs["bf16"]
    out = convert_target(model, tmp_path / "o.gguf", "f32").outfile
    ts = read_tensors_fast(out)
    assert read_gguf(out).get("general.file_type") == 0  # no quantization_config: no MXFP4 label
    p = "model.layers.2.mlp.experts."
    gate_up = _raw(model, p + "gate_up_proj").transpose(0, 2, 1)  # [E, 2*ff, h]
    for kind, start in (("gate", 0), ("up", 1)):
        qtype, ne, data = ts[f"blk.2.ffn_{kind}_exps.weight"]
        assert (qtype, ne) == ("F32", [H, FF, E])
        np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(E, FF, H), gate_up[:, start::2])
    qtype, ne, data = ts["blk.2.ffn_down_exps.weight"]
    assert (qtype, ne) == ("F32", [FF, H, E])
    np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(E, H, FF),
                                  _raw(model, p + "down_proj").transpose(0, 2, 1))


# ----------------------------------------------------------------------------------------- refusals


def _variant(src: Path, dst: Path, *, drop: str | None = None, replace: dict[str, np.ndarray] | None = None,
             config: dict | None = None) -> Path:
    """A copy of a fixture target with one tensor dropped or replaced, or config fields changed."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = gpt_oss_tensors(mxfp4=True)
    if drop is not None:
        del tensors[drop]
    tensors.update(replace or {})
    write_safetensors(dst / "model.safetensors", tensors)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_mxfp4_scales_refused(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    bad = _variant(oss_dirs["mxfp4"], tmp_path / "m", drop="model.layers.3.mlp.experts.down_proj_scales")
    with pytest.raises(TensorError, match="down_proj_scales"):
        convert_target(bad, tmp_path / "o.gguf", "bf16", dry_run=True)
    assert not (tmp_path / "o.gguf").exists()


def test_mis_shaped_mxfp4_blocks_refused(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    wrong = np.zeros((E, 2 * FF, H // 32 + 1, 16), dtype=np.uint8)
    bad = _variant(oss_dirs["mxfp4"], tmp_path / "m", replace={"model.layers.0.mlp.experts.gate_up_proj_blocks": wrong})
    with pytest.raises(TensorError, match="gate_up_proj_blocks"):
        convert_target(bad, tmp_path / "o.gguf", "bf16", dry_run=True)


def test_null_sliding_window_refused(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    bad = _variant(oss_dirs["mxfp4"], tmp_path / "m", config={"sliding_window": None})
    assert builtin_family(bad) == "gpt_oss"
    with pytest.raises(ConfigError, match="sliding_window"):
        convert_target(bad, tmp_path / "o.gguf", "bf16", dry_run=True)


def test_other_layer_pattern_noted(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    variant = _variant(oss_dirs["mxfp4"], tmp_path / "m", config={"layer_types": ["full_attention"] * L})
    result = convert_target(variant, tmp_path / "o.gguf", "bf16", dry_run=True)
    assert any("layer_types" in n for n in result.notes)


def _drafter(root: Path) -> Path:
    """A z-lab-style DFlash drafter for the 4-layer fixture target, tapping layers 1 and 2."""
    return mf.make_drafter(root, target="qwen3",
                           config_overrides={"dflash_config.target_layer_ids": [1, 2], "num_target_layers": 4})


@pytest.mark.reference
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_drafter_for_it_matches_b11434(tmp_path: Path, oss_dirs: dict[str, Path], outtype: str) -> None:
    """A z-lab-style DFlash drafter takes its vocabulary from this target, as b11434's converter does with
    ``--target-model-dir``."""
    reference.require_or_skip(reference.reference_available())
    reference.assert_drafter_parity(_drafter(tmp_path / "d"), oss_dirs["mxfp4"], tmp_path, outtype)
    REFERENCE_COMPARISONS.append(f"gpt-oss/drafter/{outtype}")


@pytest.mark.reference
def test_pipeline_makes_mxfp4_moe_and_llama_server_serves_it(tmp_path: Path, oss_dirs: dict[str, Path]) -> None:
    """Without --quant, an MXFP4 release becomes llama-quantize's MXFP4_MOE in one pass (its expert blocks kept);
    verify passes, and b11434's llama-server serves the pair (its gpt-oss graph publishes its layer inputs): the
    drafter drafts and the greedy text is the target's own."""
    reference.require_or_skip(reference.llama_cpp_available())
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--drafter", _drafter(tmp_path / "d"), "--target", oss_dirs["mxfp4"],
                  "--outdir", outdir)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    target = manifest["outputs"]["target"]
    assert target["type"] == "mxfp4_moe" and target["file"] == "gpt-oss-tiny-MXFP4_MOE.gguf", target
    assert manifest["options"]["target_method"] == "builtin" and manifest["verify"]["servable"] is True
    assert "built-in converter and quantizer in one pass" in run.stdout
    assert read_gguf(outdir / target["file"]).get("general.file_type") == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    reference.serve_with_and_without_drafter(outdir / target["file"],
                                             outdir / manifest["outputs"]["drafter"]["file"])
    REFERENCE_COMPARISONS.append("llama-server/gpt-oss-mxfp4_moe-pipeline")


@pytest.mark.parametrize("quant", ["q4_0", "Q4_K_M"])
def test_pipeline_refuses_to_requantize_mxfp4_before_anything_is_written(tmp_path: Path, oss_dirs: dict[str, Path],
                                                                          quant: str) -> None:
    run = run_cli("dflash-convert", "--drafter", _drafter(tmp_path / "d"), "--target", oss_dirs["mxfp4"],
                  "--outdir", tmp_path / "pair", "--quant", quant)
    assert run.returncode == 8, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert "requantizing from type mxfp4 is disabled" in message and "mxfp4_moe" in message, message
    assert not (tmp_path / "pair").exists()
