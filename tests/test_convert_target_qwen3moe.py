"""The built-in Qwen3-MoE target converter (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): parity with llama.cpp b11434's
``Qwen3MoeModel``, libllama loading, the one pass, the expert stacking checked on its own, refusals, and a
DFlash pair made and served through the built-in path.

Targets are ``fixtures.qwen.make_qwen3moe_target``: the real config layout, one tensor per expert (12 experts, so
the sorted names read ``experts.10`` before ``experts.2``), or fused experts, or two shards cut inside a layer's
experts as a real release is cut.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.common import FF, H
from fixtures.qwen import QWEN3MOE_SIZES
from fixtures.safetensors_io import _bf16_bytes, _pack_safetensors
from gguf_compare import diff, read_tensors_fast

from dflash_gguf.cli import main
from dflash_gguf.convert.safetensors import index_checkpoint
from dflash_gguf.convert.targets import SUPPORTED_ARCHITECTURES, builtin_family, convert_target
from dflash_gguf.convert.tensor_io import to_f32
from dflash_gguf.ggufio.reader import read_gguf

E, MF = QWEN3MOE_SIZES["experts"], QWEN3MOE_SIZES["moe_intermediate"]
FIXTURES = {  # name -> make_qwen3moe_target keywords
    "untied": {},
    "tied": {"tied": True},
    "fused": {"fused": True},
    "sharded": {"sharded": True},
}
# (fixture, outtype) converted by both tools and compared byte for byte
PARITY_CASES = [("untied", "bf16"), ("untied", "auto"), ("untied", "q8_0"), ("tied", "bf16"), ("tied", "auto"),
                ("fused", "bf16"), ("sharded", "bf16")]
# (fixture, type): our one pass against b11434's bf16 conversion run through llama-quantize
ONE_PASS_CASES = [("untied", "q4_0"), ("untied", "q8_0"), ("tied", "q4_0")]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture targets by name, made on first use."""
    return reference.FixtureTargets(tmp_path_factory.mktemp("qwen3moe-fx"), mf.make_qwen3moe_target, FIXTURES)


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory: pytest.TempPathFactory, moe_dirs: dict[str, Path]) -> dict:
    """b11434's convert_hf_to_gguf.py output per (fixture, outtype), converted once."""
    return reference.ReferenceConversions(tmp_path_factory.mktemp("qwen3moe-ref"), moe_dirs)


@pytest.fixture(scope="module")
def ours_bf16(tmp_path_factory: pytest.TempPathFactory, moe_dirs: dict[str, Path]) -> dict:
    """Our BF16 conversion per fixture, made on first use."""
    work = tmp_path_factory.mktemp("qwen3moe-ours")

    class Ours(dict):
        def __missing__(self, name: str) -> Path:
            self[name] = convert_target(moe_dirs[name], work / f"{name}-BF16.gguf", "bf16").outfile
            return self[name]

    return Ours()




def _hf(model: Path, name: str) -> np.ndarray:
    ref = index_checkpoint(model)[name]
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return to_f32(f.read(ref.nbytes), ref.dtype).reshape(ref.shape)


# ----------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, moe_dirs: dict[str, Path], reference_outputs: dict, name: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    ours = tmp_path / "ours.gguf"
    result = convert_target(moe_dirs[name], ours, outtype)
    assert diff(ours, reference_outputs[(name, outtype)]) == []
    assert result.vocab.model == "gpt2/qwen2" and result.outtype == ("bf16" if outtype == "auto" else outtype)
    REFERENCE_COMPARISONS.append(f"target/qwen3moe-{name}/{outtype}")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "quant"), ONE_PASS_CASES)
def test_one_pass_equals_convert_then_llama_quantize(tmp_path: Path, moe_dirs: dict[str, Path],
                                                     reference_outputs: dict, name: str, quant: str) -> None:
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_one_pass_parity(moe_dirs[name], reference_outputs[(name, "bf16")], quant, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/qwen3moe-{name}/one-pass-{quant}")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), [("untied", "q4_0"), ("tied", "bf16"), ("fused", "q8_0")])
def test_libllama_loads_it(tmp_path: Path, moe_dirs: dict[str, Path], name: str, outtype: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_libllama_loads_target(moe_dirs[name], outtype, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/qwen3moe-{name}/{outtype}/libllama")


# ------------------------------------------------------------------------- layout (no reference)


def test_registered_for_qwen3moe_targets(moe_dirs: dict[str, Path]) -> None:
    assert SUPPORTED_ARCHITECTURES["Qwen3MoeForCausalLM"] == "qwen3moe"
    assert builtin_family(moe_dirs["untied"]) == "qwen3moe"


def test_keys_and_tensor_order(moe_dirs: dict[str, Path], ours_bf16: dict) -> None:
    """Qwen2MoeModel's keys after TextModel's; in each block the stacked experts stand where the block's last-read
    expert tensor stands (sorted names: experts.9 after experts.10 and 11), down/gate/up, before the router."""
    meta = read_gguf(ours_bf16["untied"])
    assert meta.get("general.architecture") == "qwen3moe"
    keys = [k for k in meta.kv if k.startswith("qwen3moe.")]
    assert keys == [f"qwen3moe.{k}" for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_count",
        "expert_used_count", "attention.key_length", "attention.value_length", "expert_feed_forward_length")]
    assert meta.get("qwen3moe.expert_count") == E and meta.get("qwen3moe.expert_used_count") == 4
    assert meta.get("qwen3moe.expert_feed_forward_length") == MF and meta.get("qwen3moe.feed_forward_length") == FF
    assert meta.get("qwen3moe.attention.key_length") == 32  # head_dim: 4 heads x 32 is above hidden_size 64
    assert meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "qwen2"
    block0 = [n for n in meta.tensors if n.startswith("blk.0.")]
    assert block0 == [f"blk.0.{n}.weight" for n in (
        "attn_norm", "ffn_down_exps", "ffn_gate_exps", "ffn_up_exps", "ffn_gate_inp", "ffn_norm", "attn_k_norm",
        "attn_k", "attn_output", "attn_q_norm", "attn_q", "attn_v")]
    assert "output.weight" in meta.tensors and len(meta.tensors) == 3 + 12 * 6


def test_experts_stacked_by_index_router_kept_f32(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Each ``*_exps`` is the experts stacked in index order (not the reading order), values untouched; the router
    stays F32 in a Q8_0 file, the expert matrices are quantized."""
    model = moe_dirs["untied"]
    out = convert_target(model, tmp_path / "q8.gguf", "q8_0").outfile
    tensors = read_tensors_fast(out)
    qtype, ne, raw = tensors["blk.2.ffn_gate_inp.weight"]
    assert qtype == "F32" and ne == [H, E]
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(E, H), _hf(model, "model.layers.2.mlp.gate.weight"))
    assert tensors["blk.2.ffn_down_exps.weight"][:2] == ("Q8_0", [MF, H, E])
    bf16 = read_tensors_fast(convert_target(model, tmp_path / "bf16.gguf", "bf16").outfile)
    for kind in ("gate", "up", "down"):
        qtype, ne, raw = bf16[f"blk.2.ffn_{kind}_exps.weight"]
        want = np.stack([_hf(model, f"model.layers.2.mlp.experts.{e}.{kind}_proj.weight") for e in range(E)])
        assert qtype == "BF16" and ne == list(reversed(want.shape))
        assert raw == _bf16_bytes(want)


def test_fused_experts_write_the_same(ours_bf16: dict) -> None:
    """transformers-5 style fused experts (gate_up_proj split, down_proj as is) give the file the per-expert
    layout gives: same tensors, same order, same bytes."""
    per_expert, fused = read_tensors_fast(ours_bf16["untied"]), read_tensors_fast(ours_bf16["fused"])
    assert list(fused) == list(per_expert)
    assert [n for n in fused if fused[n] != per_expert[n]] == []


def test_sharded_moves_only_the_cut_layers_stacks(ours_bf16: dict) -> None:
    """Layer 1's experts straddle the two shards: its stacks are written where the second shard's last expert of
    layer 1 is read, after all the first shard holds (layer 1's router and attention) and after the second shard's
    lm_head and layer-1 input norm; the bytes are the same as unsharded."""
    one, two = read_tensors_fast(ours_bf16["untied"]), read_tensors_fast(ours_bf16["sharded"])
    assert one == two and list(one) != list(two)
    order = list(two)
    stacks = order.index("blk.1.ffn_down_exps.weight")
    assert order[stacks:stacks + 3] == [f"blk.1.ffn_{k}_exps.weight" for k in ("down", "gate", "up")]
    assert stacks > max(order.index(n) for n in ("blk.1.ffn_gate_inp.weight", "blk.1.attn_v.weight",
                                                 "output.weight", "blk.1.attn_norm.weight"))
    assert order[stacks + 3] == "blk.1.ffn_norm.weight"


def test_vocabulary_ignores_a_tokenizer_model(tmp_path: Path, moe_dirs: dict[str, Path], ours_bf16: dict) -> None:
    """Qwen3MoeModel.set_vocab is TextModel's GPT-2 path: a tokenizer.model beside it changes nothing (Qwen3's
    class would read it)."""
    model = Path(shutil.copytree(moe_dirs["untied"], tmp_path / "qwen3moe-tiny"))
    (model / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    out = convert_target(model, tmp_path / "o.gguf", "bf16").outfile
    a, b = read_gguf(out), read_gguf(ours_bf16["untied"])
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key


def test_norm_topk_prob_false_is_noted(tmp_path: Path, moe_dirs: dict[str, Path]) -> None:
    model = _variant(tmp_path, moe_dirs["untied"], norm_topk_prob=None)  # Qwen3MoeConfig's default: false
    result = convert_target(model, tmp_path / "o.gguf", "bf16", dry_run=True)
    assert any("norm_topk_prob" in n and "renormalises" in n for n in result.notes), result.notes


# ---------------------------------------------------------------------------------------- refusals


def _variant(tmp_path: Path, base: Path, **config: object) -> Path:
    """A copy of ``base`` (weights hard-linked) whose config.json has ``config`` applied (None deletes)."""
    out = tmp_path / base.name
    out.mkdir()
    for f in base.iterdir():
        if f.name != "config.json":
            os.link(f, out / f.name)
    cfg = json.loads((base / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


def _dense_layer_1(model: Path) -> None:
    """Layer 1 as a dense MLP (what mlp_only_layers [1] means to transformers): router and experts replaced."""
    path = model / "model.safetensors"
    keep = [e for e in mf.read_safetensors_raw(path)
            if not e[0].startswith(("model.layers.1.mlp.experts.", "model.layers.1.mlp.gate."))]
    dense = [(f"model.layers.1.mlp.{k}_proj.weight", "BF16", shape, _bf16_bytes(mf._randn("dense", k, shape)))
             for k, shape in (("gate", (FF, H)), ("up", (FF, H)), ("down", (H, FF)))]
    path.unlink()  # a hard link to the fixture's file: write a new one
    path.write_bytes(_pack_safetensors(keep + dense))


def _drop(name: str):
    def edit(model: Path) -> None:
        path = model / "model.safetensors"
        entries = [e for e in mf.read_safetensors_raw(path) if e[0] != name]
        path.unlink()
        path.write_bytes(_pack_safetensors(entries))
    return edit


REFUSALS = [
    # (case, config edits, checkpoint edit, exit code, words the message must contain)
    ("mlp_only_layers", {"mlp_only_layers": [1]}, _dense_layer_1, 4,
     ["layer(s) [1]", "dense MLP", "Can not map tensor", "decoder_sparse_step 1"]),
    ("decoder_sparse_step", {"decoder_sparse_step": 2}, None, 4, ["[0, 2, 4]", "decoder_sparse_step 2"]),
    ("experts_used_above_experts", {"num_experts_per_tok": 13}, None, 3, ["num_experts_per_tok (13)", "(12)"]),
    ("attention_bias", {"attention_bias": True}, None, 4, ["attention_bias", "--llama-cpp DIR"]),
    ("fewer_experts_in_config", {"num_experts": 8}, None, 5, ["layers.0.mlp.gate.weight", "[12, 64]", "[8, 64]"]),
    ("missing_expert", {}, _drop("model.layers.3.mlp.experts.7.up_proj.weight"), 5,
     ["missing", "blk.3.ffn_up_exps.weight[expert 7]"]),
    ("wrong_expert_shape", {"moe_intermediate_size": 64}, None, 5, ["experts.0.down_proj.weight", "[64, 32]",
                                                                     "[64, 64]"]),
]


@pytest.mark.parametrize(("case", "edits", "damage", "code", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refuses_before_writing(tmp_path: Path, moe_dirs: dict[str, Path], case: str, edits: dict[str, object],
                                damage, code: int, words: list[str]) -> None:
    model = _variant(tmp_path, moe_dirs["untied"], **edits)
    if damage is not None:
        damage(model)
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(main, ["convert-target", str(model), "--outfile", str(out)])
    assert result.exit_code == code, result.output
    message = " ".join(result.output.split())
    for word in (str(model), *words):
        assert word in message, (word, message)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


@pytest.mark.reference
def test_b11434_stops_on_a_dense_layer_too(tmp_path: Path, moe_dirs: dict[str, Path]) -> None:
    """The refusal's premise: b11434's Qwen3MoeModel maps no dense FFN tensor for qwen3moe."""
    reference.require_or_skip(reference.reference_available())
    model = _variant(tmp_path, moe_dirs["untied"], mlp_only_layers=[1])
    _dense_layer_1(model)
    proc = reference.run_reference_convert(model, None, tmp_path / "ref.gguf", "bf16")
    assert proc.returncode != 0 and "Can not map tensor 'model.layers.1.mlp.down_proj.weight'" in proc.stderr, \
        proc.stderr[-2000:]
    REFERENCE_COMPARISONS.append("target/qwen3moe-dense-layer/b11434-stops")


# ------------------------------------------------------------------------- a DFlash pair, built in


def test_precheck_and_pipeline_take_the_built_in_path(tmp_path: Path, moe_dirs: dict[str, Path]) -> None:
    """A z-lab-style DFlash drafter for a Qwen3-MoE target: precheck passes and the pipeline converts the target
    with the built-in converter (no --llama-cpp, no --target-gguf), and verify finds the pair servable."""
    drafter = mf.make_drafter(tmp_path / "d", target="qwen3")
    target = moe_dirs["untied"]
    precheck = run_cli("dflash-gguf", "precheck", drafter, target, "--json")
    checks = {c["id"]: c for c in json.loads(precheck.stdout)["checks"]}
    assert precheck.returncode == 0 and checks["pair.target_arch"]["status"] == "pass", precheck.stdout
    dry = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", tmp_path / "dry",
                  "--dry-run")
    assert dry.returncode == 0 and "target GGUF from the built-in converter" in dry.stdout, dry.stdout + dry.stderr
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", outdir)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["options"]["target_method"] == "builtin" and manifest["verify"]["servable"] is True
    assert read_gguf(outdir / manifest["outputs"]["target"]["file"]).get("general.architecture") == "qwen3moe"


@pytest.mark.reference
def test_llama_server_drafts_on_our_target(tmp_path: Path, moe_dirs: dict[str, Path]) -> None:
    """b11434's qwen3moe graph publishes its layer inputs: our target and our drafter make a working pair."""
    reference.require_or_skip(reference.llama_cpp_available())
    from dflash_gguf.drafters import convert_drafter

    target = moe_dirs["untied"]
    target_gguf, drafter_gguf = tmp_path / "qwen3moe-tiny-Q4_0.gguf", tmp_path / "drafter-BF16.gguf"
    convert_target(target, target_gguf, "bf16", quant="q4_0")
    convert_drafter(mf.make_drafter(tmp_path / "d", target="qwen3"), target, drafter_gguf)
    reference.serve_with_and_without_drafter(target_gguf, drafter_gguf)
    REFERENCE_COMPARISONS.append("llama-server/qwen3moe-target-ours")
