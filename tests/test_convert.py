"""The drafter converter: parity with llama.cpp b11434, refusals with reasons, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import make_fixtures
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS
from gguf_compare import diff, read_kv

from dflash_gguf.cli import main
from dflash_gguf.convert.drafter import convert_drafter
from dflash_gguf.errors import (
    ConfigError,
    IncompatiblePairError,
    InputError,
    OutputError,
    TensorError,
    TokenizerError,
    UnsupportedModelError,
)

# (target family, fixture variant, outtype) the reference converts correctly: compared byte for byte.
PARITY_CASES = [
    ("gemma4", "default", "auto"),
    ("qwen3", "default", "auto"),
    ("gemma4", "block_size_nested", "auto"),
    ("qwen3", "block_size_top", "auto"),
    ("qwen3", "rope_parameters", "auto"),
    ("gemma4", "rope_flat", "auto"),
    ("gemma4", "more_taps_than_layers", "auto"),
    ("qwen3", "no_readme_no_automap", "auto"),
    ("qwen3", "swa_layer_types", "auto"),
    ("gemma4", "is_causal_false", "auto"),
    ("gemma4", "embed_and_lm_head", "auto"),
    ("gemma4", "sliding_types_but_swa_off", "auto"),
    ("qwen3", "torch_dtype_old", "auto"),
    ("gemma4", "default", "f16"),
    ("gemma4", "default", "f32"),
    ("gemma4", "default", "q8_0"),
]


def _drafter(tmp_path: Path, target: str, variant: str, **kw: object) -> Path:
    return make_fixtures.make_drafter(tmp_path / "drafters", target=target, variant=variant, **kw)


def _target(targets: dict[str, Path], family: str) -> Path:
    if family not in targets:
        reference.require_or_skip("the Qwen fixture needs the llama.cpp b11434 sdist (models/ggml-vocab-qwen2.gguf)")
    return targets[family]


@pytest.mark.parametrize(("family", "variant", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, targets: dict[str, Path], family: str, variant: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    target = _target(targets, family)
    drafter = _drafter(tmp_path, family, variant)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, target, ours, outtype)
    proc = reference.run_reference_convert(drafter, target, ref, outtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"{family}/{variant}/{outtype}")


def test_sharded_checkpoint_matches_reference(tmp_path: Path, targets: dict[str, Path]) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = make_fixtures.make_sharded(_drafter(tmp_path, "gemma4", "default"))
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, targets["gemma4"], ours)
    assert reference.run_reference_convert(drafter, targets["gemma4"], ref).returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("gemma4/sharded/auto")


def test_contract_values_without_reference(tmp_path: Path, targets: dict[str, Path]) -> None:
    """The keys the b11434 loader needs, with the right types, checked directly (runs everywhere)."""
    out = tmp_path / "d.gguf"
    result = convert_drafter(_drafter(tmp_path, "gemma4", "default"), targets["gemma4"], out)
    kv = read_kv(out)
    assert kv["general.architecture"] == (["STRING"], "dflash")
    assert kv["dflash.target_layers"] == (["ARRAY", "INT32"], [2, 4])  # HF ids [1, 3] + 1
    assert kv["dflash.block_size"] == (["UINT32"], 16)
    assert kv["tokenizer.ggml.mask_token_id"] == (["UINT32"], 4)
    assert kv["dflash.embedding_scale"] == (["FLOAT32"], 8.0)  # sqrt(64) for a Gemma target
    assert kv["dflash.attention.sliding_window_pattern"] == (["ARRAY", "BOOL"], [True, False])
    assert kv["tokenizer.ggml.model"] == (["STRING"], "gemma4")
    tokens = kv["tokenizer.ggml.tokens"][1]
    assert tokens[105:107] == ["<|turn>", "<turn|>"] and len(tokens) == 512
    reader = gguf.GGUFReader(out)
    assert len(reader.tensors) == 11 * 2 + 3 == result.n_tensors
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["fc.weight"] == "BF16"


# (variant, target family, exception, exit code, words the message must contain)
REFUSALS = [
    ("no_taps", "gemma4", ConfigError, 3, ["target_layer_ids", "target_layers"]),
    ("no_mask", "gemma4", ConfigError, 3, ["mask_token_id", "failed to add embedding"]),
    ("fc_width_wrong", "gemma4", IncompatiblePairError, 6, ["fc.weight", "wrong shape"]),
    ("hidden_mismatch", "gemma4", IncompatiblePairError, 6, ["hidden_size 96", "64"]),
    ("tap_out_of_range", "gemma4", IncompatiblePairError, 6, ["taps target layers [6]"]),
    ("tap_last_layer", "gemma4", IncompatiblePairError, 6, ["taps target layers [5]"]),
    ("missing_tensor", "gemma4", TensorError, 5, ["layers.1.mlp.down_proj.weight", "not found"]),
    ("unexpected_tensor", "gemma4", TensorError, 5, ["layers.0.self_attn.gate.weight", "wrong number of tensors"]),
    ("attention_bias", "gemma4", UnsupportedModelError, 4, ["attention_bias", "wrong number of tensors"]),
    ("d2t", "gemma4", UnsupportedModelError, 4, ["d2t", "DSpark"]),
    ("gelu", "gemma4", UnsupportedModelError, 4, ["hidden_act", "gelu", "SiLU"]),
    ("swa_without_layer_types", "gemma4", ConfigError, 3, ["layer_types", "sliding_window 32"]),
    ("wrong_arch", "gemma4", UnsupportedModelError, 4, ["architectures", "DFlashDraftModel"]),
]


@pytest.mark.parametrize(("variant", "family", "exc", "code", "words"), REFUSALS)
def test_refuses_bad_drafters(tmp_path: Path, targets: dict[str, Path], variant: str, family: str,
                              exc: type[Exception], code: int, words: list[str]) -> None:
    drafter = _drafter(tmp_path, family, variant)
    out = tmp_path / "out.gguf"
    with pytest.raises(exc) as err:
        convert_drafter(drafter, targets[family], out)
    for word in words:
        assert word in str(err.value)
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(targets[family]),
                                       "--outfile", str(out)])
    assert result.exit_code == code, result.output
    assert result.output.startswith("Error: ")
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_refuses_bad_files(tmp_path: Path, targets: dict[str, Path]) -> None:
    target = targets["gemma4"]
    cases: list[tuple[Path, type[Exception], str]] = []
    d = _drafter(tmp_path / "a", "gemma4", "default")
    (d / "config.json").unlink()
    cases.append((d, ConfigError, "config.json does not exist"))
    d = _drafter(tmp_path / "b", "gemma4", "default")
    (d / "config.json").write_text("{not json")
    cases.append((d, ConfigError, "not valid JSON"))
    d = make_fixtures.truncate_safetensors(_drafter(tmp_path / "c", "gemma4", "default")).parent
    cases.append((d, InputError, "truncated"))
    d = _drafter(tmp_path / "d", "gemma4", "default")
    make_fixtures.corrupt_safetensors_header(d, how="json")
    cases.append((d, InputError, "corrupt safetensors header"))
    d = _drafter(tmp_path / "e", "gemma4", "default")
    make_fixtures.corrupt_safetensors_header(d, how="length")
    cases.append((d, InputError, "model.safetensors"))
    for drafter, exc, words in cases:
        out = tmp_path / "out.gguf"
        with pytest.raises(exc, match=words):
            convert_drafter(drafter, target, out)
        assert not out.exists()


def test_refuses_target_without_tokenizer(tmp_path: Path) -> None:
    target = make_fixtures.make_gemma4_target(tmp_path / "t")
    (target / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        convert_drafter(_drafter(tmp_path, "gemma4", "default"), target, tmp_path / "o.gguf")
    (target / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(TokenizerError, match="corrupt"):
        convert_drafter(_drafter(tmp_path, "gemma4", "default"), target, tmp_path / "o.gguf")


def test_top_level_mask_is_fixed_and_recorded(tmp_path: Path, targets: dict[str, Path]) -> None:
    """Deviation C7: b11434 ignores a top-level mask_token_id; we write it and say so."""
    out = tmp_path / "d.gguf"
    result = convert_drafter(_drafter(tmp_path, "qwen3" if "qwen3" in targets else "gemma4",
                                      "mask_top_level_only"), _target(targets, "qwen3"), out)
    assert read_kv(out)["tokenizer.ggml.mask_token_id"] == (["UINT32"], 151669)
    assert any("C7" in n for n in result.notes)
    assert "C7" in json.dumps(read_kv(out)["dflash_gguf.notes"][1])
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    drafter = _drafter(tmp_path / "r", "qwen3", "mask_top_level_only")
    assert reference.run_reference_convert(drafter, targets["qwen3"], ref).returncode == 0
    assert "tokenizer.ggml.mask_token_id" not in read_kv(ref)  # the defect we do not copy


def test_failure_mid_write_leaves_nothing(tmp_path: Path, targets: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_gguf.convert import drafter as drafter_mod

    def broken_writer(src, qtype):  # noqa: ANN001, ANN202
        def write(out):  # noqa: ANN001, ANN202
            out.write(b"x" * 10)
            raise OSError(28, "No space left on device")
        return write

    monkeypatch.setattr(drafter_mod, "tensor_writer", broken_writer)
    out = tmp_path / "d.gguf"
    with pytest.raises(OutputError, match="No space left on device"):
        convert_drafter(_drafter(tmp_path, "gemma4", "default"), targets["gemma4"], out)
    assert list(tmp_path.glob("d.gguf*")) == []
    drafter = tmp_path / "drafters" / "gemma4-tiny-it-DFlash"
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(targets["gemma4"]),
                                       "--outfile", str(tmp_path / "no" / "x.gguf")])
    assert result.exit_code == 10 and "does not exist" in result.output


def test_never_runs_remote_code(tmp_path: Path, targets: dict[str, Path]) -> None:
    """The Qwen-style drafter ships dflash.py that raises on import; converting must not touch it."""
    drafter = _drafter(tmp_path, "qwen3", "default")
    assert (drafter / "dflash.py").is_file()
    convert_drafter(drafter, _target(targets, "qwen3"), tmp_path / "d.gguf")


def test_cli_json_and_dry_run(tmp_path: Path, targets: dict[str, Path]) -> None:
    drafter = _drafter(tmp_path, "gemma4", "default")
    out = tmp_path / "d.gguf"
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target-model-dir",
                                       str(targets["gemma4"]), "--outfile", str(out), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["dry_run"] is True and doc["tensors"] == 25 and doc["vocab"]["tokens"] == 512
    assert not out.exists()


def _qwen3_target_with_sentencepiece(tmp_path: Path) -> Path:
    """A Qwen3-architecture target that ships a tokenizer.model: b11434 takes its SentencePiece path."""
    import shutil

    donor = make_fixtures.make_gemma3_target(tmp_path / "g3")
    target = tmp_path / "qwen3-sp"
    target.mkdir()
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(donor / name, target / name)
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 512, "bos_token_id": 2, "eos_token_id": 1}))
    return target


def test_sentencepiece_target_matches_reference(tmp_path: Path) -> None:
    target = _qwen3_target_with_sentencepiece(tmp_path)
    drafter = _drafter(tmp_path, "qwen3", "default",
                       config_overrides={"vocab_size": 600, "dflash_config.mask_token_id": 4})
    ours = tmp_path / "ours.gguf"
    result = convert_drafter(drafter, target, ours)
    kv = read_kv(ours)
    assert kv["tokenizer.ggml.model"] == (["STRING"], "llama") and result.vocab.n_tokens == 600
    assert kv["tokenizer.ggml.tokens"][1][599] == "[PAD599]"  # padded to the drafter's vocab_size
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    proc = reference.run_reference_convert(drafter, target, ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("qwen3-sentencepiece/default/auto")


def test_cli_reads_tokenizer_overlay_and_records_origin(tmp_path: Path, targets: dict[str, Path]) -> None:
    from dflash_gguf.tokenizer_fixups import fix_tokenizer

    drafter = _drafter(tmp_path, "gemma4", "default")
    overlay = fix_tokenizer(targets["gemma4"], out=tmp_path / "overlay").overlay
    assert overlay is not None and (overlay / "tokenizer.model").is_file()
    direct, repaired = tmp_path / "direct.gguf", tmp_path / "repaired.gguf"
    convert_drafter(drafter, targets["gemma4"], direct)
    result = CliRunner().invoke(main, ["convert", "--drafter", str(drafter), "--target", str(targets["gemma4"]),
                                       "--tokenizer-dir", str(overlay), "--pair-with", "t.gguf",
                                       "--outfile", str(repaired)])
    assert result.exit_code == 0, result.output
    kv = read_kv(repaired)
    assert kv["dflash_gguf.tokenizer.origin"][1] == "synthesized"
    assert kv["dflash_gguf.target.file"][1] == "t.gguf"
    assert diff(repaired, direct) == []  # same vocabulary and tensors either way
