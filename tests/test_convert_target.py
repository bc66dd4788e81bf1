"""The built-in target converter: parity with llama.cpp b11434, refusals before writing, serving."""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import gguf
import numpy as np
import pytest
import reference
from click.testing import CliRunner, Result
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli
from fixtures.gemma import GEMMA4_TARGET_VARIANTS, make_gemma4_target_variant
from fixtures.safetensors_io import _pack_safetensors
from gguf_compare import diff, read_kv

from dflash_gguf.cli import main
from dflash_gguf.convert.safetensors import index_checkpoint
from dflash_gguf.convert.targets import SUPPORTED_ARCHITECTURES, TensorSpec, builtin_family, convert_target
from dflash_gguf.convert.targets.writers import spec_writer
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import UnsupportedModelError
from dflash_gguf.verify import verify_files

LM = "model.language_model"

# (fixture target, outtype) converted by both tools and compared byte for byte.
PARITY_CASES = [
    *[("gemma4", o) for o in ("bf16", "f16", "q8_0", "f32", "auto")],
    *[("qwen3", o) for o in ("bf16", "f16", "q8_0")],
    ("qwen3-tied", "auto"),
    *[(f"gemma4-{v}", "auto") for v in GEMMA4_TARGET_VARIANTS],
    ("gemma4-shared_kv", "q8_0"),
    ("gemma4-moe", "q8_0"),
]


@pytest.fixture(scope="module")
def target_dirs(targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Fixture targets by name, made on first use ("qwen3*" need the b11434 sdist's vocab)."""
    work = tmp_path_factory.mktemp("target-fx")

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            if name == "gemma4":
                self[name] = targets["gemma4"]
            elif name == "qwen3":
                self[name] = targets["qwen3"]
            elif name == "qwen3-tied":
                reference.require_or_skip(reference.llama_cpp_src_available())
                self[name] = mf.make_qwen3_target(work, llama_cpp_src=llama_cpp_src(), tied=True)
            else:
                self[name] = make_gemma4_target_variant(work, name.removeprefix("gemma4-"))
            return self[name]

    return Dirs()


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, ["convert-target", *map(str, args)])


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} exists"
    assert not out.with_name(out.name + ".partial").exists(), f"{out}.partial exists"


def _copy_target(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensors(model_dir: Path, edit) -> None:
    """Rewrite model.safetensors after ``edit(list of (name, dtype, shape, raw))`` changes the entries."""
    path = model_dir / "model.safetensors"
    entries = mf.read_safetensors_raw(path)
    path.write_bytes(_pack_safetensors(edit(entries)))


def _edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))


# ----------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, target_dirs: dict[str, Path], name: str, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    model = target_dirs[name]
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_target(model, ours, outtype)
    proc = reference.run_reference_convert(model, None, ref, outtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"target/{name}/{outtype}")


@pytest.mark.reference
def test_tokenizer_overlay_matches_reference_on_the_overlay(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    """--tokenizer-dir with a fix-tokenizer overlay (it adds tokenizer.model, which switches b11434's
    token_embd trimming to the SentencePiece count) equals b11434 run on the overlay folder."""
    reference.require_or_skip(reference.reference_available())
    from dflash_gguf.tokenizer_fixups import fix_tokenizer

    target = target_dirs["gemma4"]
    overlay = tmp_path / "overlay"
    fix_tokenizer(target, out=overlay)
    assert (overlay / "tokenizer.model").is_file()
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = _cli(target, "--outfile", ours, "--tokenizer-dir", overlay)
    assert result.exit_code == 0, result.output
    proc = reference.run_reference_convert(overlay, None, ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    assert read_kv(ours)["dflash_gguf.tokenizer.origin"][1] == "synthesized"
    REFERENCE_COMPARISONS.append("target/gemma4/tokenizer-overlay")


def test_gemma4_layout_without_reference(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    """The Gemma-4 particulars checked directly (runs everywhere): per-layer arrays, rope_freqs, k_eq_v."""
    out = tmp_path / "g.gguf"
    result = convert_target(target_dirs["gemma4"], out, "q8_0")
    kv = read_kv(out)
    assert kv["general.architecture"] == (["STRING"], "gemma4")
    assert kv["gemma4.attention.head_count_kv"] == (["ARRAY", "INT32"], [2, 2, 2, 2, 2, 1])
    assert kv["gemma4.attention.sliding_window_pattern"][1] == [True] * 5 + [False]
    assert kv["gemma4.attention.key_length"][1] == 32 and kv["gemma4.attention.key_length_swa"][1] == 16
    assert kv["gemma4.rope.dimension_count"][1] == 32 and kv["gemma4.rope.dimension_count_swa"][1] == 16
    assert kv["general.sampling.top_k"] == (["INT32"], 64)
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.tensors[0].name == "rope_freqs.weight"
    np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, [1.0] * 4 + [np.float32(1e30)] * 12)
    assert "blk.5.attn_v.weight" not in tensors and "blk.4.attn_v.weight" in tensors  # k_eq_v full layer
    assert tensors["blk.0.layer_output_scale.weight"].tensor_type.name == "F32"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert "output.weight" not in tensors and len(tensors) == result.n_tensors == 86


def test_builtin_family_and_registry(target_dirs: dict[str, Path], tmp_path: Path) -> None:
    assert builtin_family(target_dirs["gemma4"]) == "gemma4"
    assert builtin_family(target_dirs["gemma4-causal_lm"]) == "gemma4"
    assert SUPPORTED_ARCHITECTURES["Qwen3ForCausalLM"] == "qwen3"
    other = _copy_target(target_dirs["gemma4"], tmp_path / "mistral")
    _edit_config(other, lambda c: c.update(architectures=["MistralForCausalLM"], text_config={}))
    assert builtin_family(other) is None


def test_streamed_permutation_and_transform(tmp_path: Path) -> None:
    """The chunked path a family uses for row permutations (Llama's q/k) and value changes, against numpy."""
    x = mf._randn("perm", "x", (96, 64))
    mf.write_safetensors(tmp_path / "model.safetensors", {"w": x}, float_dtype="F32")
    ref = index_checkpoint(tmp_path)["w"]
    order = np.random.default_rng(0).permutation(96)
    spec = TensorSpec("blk.0.attn_q.weight", (96, 64), ref=ref, row_order=order, transform=lambda a: a * 2 + 1)
    write, source = spec_writer(spec, gguf.GGMLQuantizationType.F16)
    assert source is None
    with open(tmp_path / "out.bin", "wb", buffering=0) as f:
        write(f)
    got = np.frombuffer((tmp_path / "out.bin").read_bytes(), "<f2").reshape(96, 64)
    np.testing.assert_array_equal(got, (x[order] * 2 + 1).astype(np.float16))


# -------------------------------------------------------------------------------- refusals (CLI)

def _missing_shard(d: Path) -> None:
    (d / "model-00002-of-00003.safetensors").unlink()


def _truncated_shard(d: Path) -> None:
    mf.truncate_safetensors(d, "model-00003-of-00003.safetensors")


def _missing_tensor(d: Path) -> None:
    _edit_tensors(d, lambda es: [e for e in es if e[0] != f"{LM}.layers.2.self_attn.k_proj.weight"])


def _unknown_tensor(d: Path) -> None:
    extra = (f"{LM}.layers.0.mlp.extra_proj.weight", "BF16", (4, 4), bytes(32))
    _edit_tensors(d, lambda es: [*es, extra])


def _wrong_shape(d: Path) -> None:
    _edit_config(d, lambda c: c["text_config"].update(intermediate_size=96))


def _fp8_tensor(d: Path) -> None:
    def edit(entries):
        return [(n, "F8_E4M3", s, raw[: len(raw) // 2]) if n.endswith("layers.0.mlp.up_proj.weight")
                else (n, dt, s, raw) for n, dt, s, raw in entries]
    _edit_tensors(d, edit)


def _unsupported_arch(d: Path) -> None:
    _edit_config(d, lambda c: c.update(architectures=["Olmo2ForCausalLM"], text_config={}))


def _moe_incomplete(d: Path) -> None:
    _edit_config(d, lambda c: c["text_config"].update(enable_moe_block=True, num_experts=8, moe_intermediate_size=32))


def _per_layer_embeddings_incomplete(d: Path) -> None:
    _edit_config(d, lambda c: c["text_config"].update(hidden_size_per_layer_input=16))


def _experts_without_moe_block(d: Path) -> None:
    _edit_config(d, lambda c: c["text_config"].update(num_experts=8))


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _bad_index(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


# (case, source fixture, damage, exit code, phrases the message must contain)
REFUSALS = [
    ("missing_shard", "gemma4-sharded", _missing_shard, 5, ["model-00002-of-00003.safetensors", "missing",
                                                            "complete checkpoint"]),
    ("truncated_shard", "gemma4-sharded", _truncated_shard, 2, ["model-00003-of-00003.safetensors", "truncated",
                                                                "Re-download"]),
    ("bad_index", "gemma4-sharded", _bad_index, 5, ["model.safetensors.index.json", "disagrees", "layers.9"]),
    ("missing_tensor", "gemma4", _missing_tensor, 5, ["missing", "blk.2.attn_k.weight", "complete checkpoint"]),
    ("unknown_tensor", "gemma4", _unknown_tensor, 5, ["mlp.extra_proj.weight", "not part of a gemma4 model",
                                                      "--llama-cpp"]),
    ("wrong_shape", "gemma4", _wrong_shape, 5, ["layers.0.mlp.down_proj.weight", "[64, 128]", "[64, 96]",
                                                "do not belong together"]),
    ("fp8_tensor", "gemma4", _fp8_tensor, 5, ["F8_E4M3", "up_proj", "--llama-cpp"]),
    ("unsupported_arch", "gemma4", _unsupported_arch, 18, ["Olmo2ForCausalLM", "Gemma4ForCausalLM",
                                                          "Qwen3ForCausalLM", "--llama-cpp", "--target-gguf"]),
    ("moe_incomplete", "gemma4", _moe_incomplete, 3, ["enable_moe_block", "'top_k_experts'"]),
    ("per_layer_embeddings_incomplete", "gemma4", _per_layer_embeddings_incomplete, 3,
     ["hidden_size_per_layer_input", "vocab_size_per_layer_input"]),
    ("experts_without_moe_block", "gemma4", _experts_without_moe_block, 4, ["num_experts", "enable_moe_block",
                                                                            "--llama-cpp", "--target-gguf"]),
    ("no_config", "gemma4", _no_config, 3, ["config.json", "does not exist"]),
]


@pytest.mark.parametrize(("case", "source", "damage", "code", "phrases"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refuses_before_writing(tmp_path: Path, target_dirs: dict[str, Path], case: str, source: str, damage,
                                code: int, phrases: list[str]) -> None:
    model = _copy_target(target_dirs[source], tmp_path / f"target-{case}")
    damage(model)
    out = tmp_path / "out.gguf"
    result = _cli(model, "--outfile", out)
    assert result.exit_code == code, result.output
    message = result.output.strip()
    assert message.startswith("Error: ") and message.count("\n") == 0, message
    for phrase in phrases:
        assert phrase in message, (phrase, message)
    _assert_nothing_written(out)


def test_output_folder_missing(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    out = tmp_path / "nowhere" / "out.gguf"
    result = _cli(target_dirs["gemma4"], "--outfile", out)
    assert result.exit_code == 10 and "does not exist" in result.output
    _assert_nothing_written(out)


def test_unsupported_message_is_one_paragraph_naming_the_ways_out(tmp_path: Path, target_dirs: dict[str, Path]):
    model = _copy_target(target_dirs["gemma4"], tmp_path / "t")
    _unsupported_arch(model)
    with pytest.raises(UnsupportedModelError) as err:
        convert_target(model, tmp_path / "o.gguf")
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_dry_run_json_writes_nothing(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    out = tmp_path / "dry.gguf"
    result = _cli(target_dirs["gemma4"], "--outfile", out, "--dry-run", "--json",
                  "--target-repo", "google/gemma-4-tiny-it@abc123")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["dry_run"] is True and doc["tensors"] == 86 and doc["outtype"] == "bf16"
    assert doc["provenance"]["target.repo"] == "google/gemma-4-tiny-it"
    assert doc["provenance"]["target.revision"] == "abc123"
    _assert_nothing_written(out)


def test_cli_summary_and_provenance(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    out = tmp_path / "t.gguf"
    result = _cli(target_dirs["gemma4"], "--outfile", out, "--outtype", "f16")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {out}: 86 tensors") and "f16, vocab gemma4 (512 tokens)" in result.output
    kv = read_kv(out)
    assert kv["dflash_gguf.target.architecture"][1] == "Gemma4UnifiedForConditionalGeneration"
    assert kv["dflash_gguf.target.embd_fingerprint"][1].startswith("efp1:512x64")
    assert kv["general.name"][1] == target_dirs["gemma4"].name


def test_verify_passes_on_our_target_and_drafter(tmp_path: Path, target_dirs: dict[str, Path]) -> None:
    target = target_dirs["gemma4"]
    target_gguf, drafter_gguf = tmp_path / "target.gguf", tmp_path / "drafter.gguf"
    convert_target(target, target_gguf)
    convert_drafter(mf.make_drafter(tmp_path / "drafters", target="gemma4"), target, drafter_gguf)
    report = verify_files(drafter_gguf, target_gguf)
    assert report.errors == [] and report.warnings == []
    assert any(r.id == "lineage.fingerprint" and r.status == "pass" for r in report.results)


# ------------------------------------------------------------------------------------------ serving


@pytest.mark.reference
def test_llama_server_serves_our_gemma4_target_alone_and_with_our_drafter(tmp_path: Path,
                                                                         target_dirs: dict[str, Path]) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    target = target_dirs["gemma4"]
    target_gguf, drafter_gguf = tmp_path / "gemma-4-tiny-it-BF16.gguf", tmp_path / "drafter-BF16.gguf"
    convert_target(target, target_gguf)
    convert_drafter(mf.make_drafter(tmp_path / "drafters", target="gemma4"), target, drafter_gguf)
    output = reference.serve_with_and_without_drafter(target_gguf, drafter_gguf, n_predict=16, n_max=15)
    assert "block_size=16, mask_token_id=4, n_extract=2" in output
    verdict = run_cli("dflash-verify", str(drafter_gguf), str(target_gguf))
    assert verdict.returncode == 0, verdict.stdout
    REFERENCE_COMPARISONS.append("llama-server/our-gemma4-target")


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["moe", "per_layer_input", "shared_kv", "untied", "causal_lm", "multimodal",
                                     "per_layer_config"])
def test_llama_server_loads_our_gemma4_variant(tmp_path: Path, target_dirs: dict[str, Path], variant: str) -> None:
    """Each layout the converter writes loads in b11434 and completes greedily (no drafter)."""
    reference.require_or_skip(reference.llama_cpp_available())
    out = tmp_path / f"{variant}.gguf"
    convert_target(target_dirs[f"gemma4-{variant}"], out)
    with reference.start_llama_server(out, None) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion",
                                           {"prompt": "hello world", "n_predict": 8, "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["tokens_predicted"] > 0, body
    REFERENCE_COMPARISONS.append(f"llama-server/gemma4-{variant}")
