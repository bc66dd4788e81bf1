"""The built-in MiniMax-M2 target converter (MiniMax-M2, M2.5, M2.7): parity with llama.cpp b11434's
``MiniMaxM2Model`` on FP8 block-scaled checkpoints, the one pass, libllama loading, and the e4m3 decoder and the
block dequantization checked on their own.

Targets are ``fixtures.minimax.make_minimax_m2_target``: the real config layout, FP8 e4m3fn weights with one
float32 scale per 128x128 block (partial edge blocks), edge-case bytes (+-0, subnormals, +-448) in every weight,
NaN bytes in the ``nan`` variant, two shards cut inside a layer's experts in the ``sharded`` one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import hub_server
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from fixtures.common import SIZES
from fixtures.minimax import EDGE_BYTES, MINIMAX_SIZES, fp8_weight
from fixtures.safetensors_io import _pack_safetensors
from gguf_compare import diff, read_tensors_fast

from dflash_gguf.convert.safetensors import index_checkpoint
from dflash_gguf.convert.targets import SUPPORTED_ARCHITECTURES, builtin_family, convert_target
from dflash_gguf.convert.targets.minimax_m2 import E4M3, decode_e4m3, dequantize_rows
from dflash_gguf.convert.tensor_io import f32_to_bf16
from dflash_gguf.errors import DflashGgufError
from dflash_gguf.ggufio.reader import read_gguf

S = MINIMAX_SIZES
H, E, MF = S["hidden"], S["experts"], S["moe_intermediate"]
FIXTURES = {"plain": {}, "nan": {"nan": True}, "sharded": {"sharded": True},
            "deep": {"layers": 4}}  # deep: room for a drafter's taps at layers 1 and 2
# (fixture, outtype) converted by both tools and compared byte for byte. NaN only through float outtypes: a NaN
# in a Q8_0 block is undefined behaviour in both quantizers.
PARITY_CASES = [("plain", "bf16"), ("plain", "auto"), ("plain", "f16"), ("plain", "q8_0"), ("nan", "bf16"),
                ("nan", "f32"), ("sharded", "bf16")]
ONE_PASS_CASES = [("plain", "q4_0"), ("plain", "q8_0")]


@pytest.fixture(scope="module")
def mm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture targets by name, made on first use."""
    return reference.FixtureTargets(tmp_path_factory.mktemp("minimax-fx"), mf.make_minimax_m2_target, FIXTURES)


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory: pytest.TempPathFactory, mm_dirs: dict[str, Path]) -> dict:
    """b11434's convert_hf_to_gguf.py output per (fixture, outtype), converted once."""
    return reference.ReferenceConversions(tmp_path_factory.mktemp("minimax-ref"), mm_dirs)




# ----------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, mm_dirs: dict[str, Path], reference_outputs: dict, name: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    ours = tmp_path / "ours.gguf"
    result = convert_target(mm_dirs[name], ours, outtype)
    assert diff(ours, reference_outputs[(name, outtype)]) == []
    assert result.outtype == ("bf16" if outtype == "auto" else outtype)  # lm_head, the first matrix, is BF16
    REFERENCE_COMPARISONS.append(f"target/minimax-m2-{name}/{outtype}")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "quant"), ONE_PASS_CASES)
def test_one_pass_equals_convert_then_llama_quantize(tmp_path: Path, mm_dirs: dict[str, Path],
                                                     reference_outputs: dict, name: str, quant: str) -> None:
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_one_pass_parity(mm_dirs[name], reference_outputs[(name, "bf16")], quant, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/minimax-m2-{name}/one-pass-{quant}")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), [("plain", "q4_0"), ("plain", "bf16")])
def test_libllama_loads_it(tmp_path: Path, mm_dirs: dict[str, Path], name: str, outtype: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.assert_libllama_loads_target(mm_dirs[name], outtype, tmp_path)
    REFERENCE_COMPARISONS.append(f"target/minimax-m2-{name}/{outtype}/libllama")


@pytest.mark.reference
def test_e4m3_decoder_matches_torch() -> None:
    """All 256 bytes decoded by torch's float8_e4m3fn (what b11434's ``weight.float()`` does), bit for bit, NaN
    payloads included; torch runs in the reference venv."""
    reference.require_or_skip(reference.reference_available())
    py = reference.env.venv_python(reference.env.ref_venv_dir())
    code = ("import torch, sys; t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(); "
            "sys.stdout.write(t.view(torch.int32).tolist().__repr__())")
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    want = np.array(json.loads(proc.stdout), dtype=np.int64).astype(np.uint32)
    np.testing.assert_array_equal(E4M3.view(np.uint32), want)
    REFERENCE_COMPARISONS.append("target/minimax-m2/e4m3-256-bytes-vs-torch")


# ------------------------------------------------------------------------- no reference needed


def _e4m3_by_formula(b: int) -> float:
    """An independent reading of the OCP FP8 spec: (-1)^s * 2^(e-7) * (1 + m/8), subnormals 2^-6 * m/8."""
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def test_e4m3_decoder_all_256_bytes() -> None:
    got = decode_e4m3(bytes(range(256)))
    assert got.dtype == np.float32 and got.shape == (256,)
    for b in range(256):
        want = _e4m3_by_formula(b)
        if np.isnan(want):
            assert np.isnan(got[b]) and (got[b].view(np.uint32) >> 31) == b >> 7, hex(b)
        else:
            assert got[b] == np.float32(want) and np.signbit(got[b]) == bool(b >> 7), hex(b)
    assert got[0x7E] == 448 and got[0xFE] == -448 and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6
    assert int(np.isnan(got).sum()) == 2  # 0x7F, 0xFF: no infinities in e4m3fn


def test_dequantize_rows_block_scales_and_edges() -> None:
    """Each element times the scale of its 128x128 block, edge blocks partial; a chunk starting mid-tensor uses
    its own rows' scales; one float32 multiplication."""
    rows, cols, b = 300, 200, (128, 128)
    raw, scale = fp8_weight("t", "w", (rows, cols))
    whole = dequantize_rows(raw, scale, 0, cols, b)
    w = decode_e4m3(raw).reshape(rows, cols)
    for r in (0, 127, 128, 255, 256, 299):
        for c in (0, 127, 128, 199):
            assert whole[r, c] == np.float32(w[r, c] * scale[r // 128, c // 128])
    part = dequantize_rows(raw[130 * cols:], scale, 130, cols, b)
    np.testing.assert_array_equal(part, whole[130:])
    assert whole.dtype == np.float32 and raw[: len(EDGE_BYTES)] == EDGE_BYTES


def test_registered_and_layout(mm_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Keys after TextModel's (gating func sigmoid, before key_length) and MiniMaxM2Model's; in each block the
    stacked experts (gate, down, up) stand where the last-read expert tensor stands, scales gone."""
    model = mm_dirs["plain"]
    assert SUPPORTED_ARCHITECTURES["MiniMaxM2ForCausalLM"] == "minimax_m2"
    assert builtin_family(model) == "minimax_m2"
    out = convert_target(model, tmp_path / "o.gguf", "bf16").outfile
    meta = read_gguf(out)
    assert meta.get("general.architecture") == "minimax-m2"
    keys = [k.removeprefix("minimax-m2.") for k in meta.kv if k.startswith("minimax-m2.")]
    assert keys == ["block_count", "context_length", "embedding_length", "feed_forward_length",
                    "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                    "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count", "expert_gating_func",
                    "attention.key_length", "attention.value_length", "expert_feed_forward_length",
                    "rope.dimension_count"]
    assert meta.get("minimax-m2.expert_gating_func") == 2 and meta.get("minimax-m2.rope.dimension_count") == 32
    assert meta.get("minimax-m2.expert_feed_forward_length") == MF
    block0 = [n for n in meta.tensors if n.startswith("blk.0.")]
    assert block0 == ["blk.0.exp_probs_b.bias"] + [f"blk.0.{n}.weight" for n in (
        "ffn_gate_exps", "ffn_down_exps", "ffn_up_exps", "ffn_gate_inp", "attn_norm", "ffn_norm", "attn_k_norm",
        "attn_k", "attn_output", "attn_q_norm", "attn_q", "attn_v")]
    tensors = read_tensors_fast(out)
    assert tensors["blk.0.attn_q_norm.weight"][:2] == ("F32", [S["heads"] * S["head_dim"]])
    assert tensors["blk.0.ffn_gate_inp.weight"][:2] == ("F32", [H, E])
    assert tensors["blk.0.exp_probs_b.bias"][:2] == ("F32", [E])
    # an expert slice is that expert's dequantized weight, in BF16
    idx = index_checkpoint(model)
    qtype, ne, raw = tensors["blk.1.ffn_down_exps.weight"]
    assert qtype == "BF16" and ne == [MF, H, E]
    ref, sref = idx["model.layers.1.block_sparse_moe.experts.7.w2.weight"], \
        idx["model.layers.1.block_sparse_moe.experts.7.w2.weight_scale_inv"]
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        w8 = f.read(ref.nbytes)
        f.seek(sref.offset)
        sc = np.frombuffer(f.read(sref.nbytes), "<f4").reshape(sref.shape)
    want = f32_to_bf16(dequantize_rows(w8, sc, 0, MF, (128, 128)).reshape(-1)).tobytes()
    per = H * MF * 2
    assert raw[7 * per: 8 * per] == want
    assert SIZES["qwen_vocab"] == meta.tensors["token_embd.weight"].ne[1]


def test_refuses_fp8_without_quantization_config(mm_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    for p in mm_dirs["plain"].iterdir():
        (model / p.name).symlink_to(p)
    cfg = json.loads((mm_dirs["plain"] / "config.json").read_text())
    del cfg["quantization_config"]
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DflashGgufError, match="quantization_config"):
        convert_target(model, tmp_path / "o.gguf", "bf16")
    assert not (tmp_path / "o.gguf").exists()


def test_refuses_fp8_weight_without_its_scales(mm_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An FP8 expert weight whose ``weight_scale_inv`` is missing cannot be dequantized: refused, nothing written."""
    model = tmp_path / "m"
    model.mkdir()
    for p in mm_dirs["plain"].iterdir():
        if p.name != "model.safetensors":
            (model / p.name).symlink_to(p)
    gone = "model.layers.1.block_sparse_moe.experts.4.w3.weight_scale_inv"
    entries = [e for e in mf.read_safetensors_raw(mm_dirs["plain"] / "model.safetensors") if e[0] != gone]
    (model / "model.safetensors").write_bytes(_pack_safetensors(entries))
    with pytest.raises(DflashGgufError, match="experts.4.w3"):
        convert_target(model, tmp_path / "o.gguf", "bf16")
    assert not (tmp_path / "o.gguf").exists()


# ------------------------------------------------------------------------------------ with a drafter

TARGET_REPO, DRAFTER_REPO = "MiniMaxAI/MiniMax-M2-tiny", "z-lab/MiniMax-M2-tiny-DFlash"


def _drafter(root: Path) -> Path:
    """A z-lab-style DFlash drafter at MiniMax-M2's width, tapping layers 1 and 2 of the deep fixture."""
    return mf.make_drafter(root, target="qwen3", hidden=H, name="MiniMax-M2-tiny-DFlash",
                           config_overrides={"dflash_config.target_layer_ids": [1, 2], "num_target_layers": 4})


@pytest.mark.reference
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_drafter_for_it_matches_b11434(tmp_path: Path, mm_dirs: dict[str, Path], outtype: str) -> None:
    """The drafter takes its vocabulary from the MiniMax-M2 target, as b11434's converter does with
    ``--target-model-dir``."""
    reference.require_or_skip(reference.reference_available())
    reference.assert_drafter_parity(_drafter(tmp_path / "d"), mm_dirs["deep"], tmp_path, outtype)
    REFERENCE_COMPARISONS.append(f"minimax-m2/drafter/{outtype}")


@pytest.mark.reference
def test_pipeline_from_repo_ids_to_a_served_pair(tmp_path: Path, mm_dirs: dict[str, Path]) -> None:
    """``dflash-convert --target ORG/NAME --drafter ORG/NAME`` on an FP8 MiniMax-M2 target: the built-in converter
    dequantizes and quantizes it in one pass, verify passes, and b11434's llama-server serves the pair it made:
    the drafter drafts and the greedy text is unchanged (b11434's minimax-m2 graph publishes its layer inputs)."""
    reference.require_or_skip(reference.llama_cpp_available())
    repos = {TARGET_REPO: hub_server.FakeRepo.of_folder(mm_dirs["deep"]),
             DRAFTER_REPO: hub_server.FakeRepo.of_folder(_drafter(tmp_path / "d"))}
    outdir = tmp_path / "pair"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"LLAMA_QUANTIZE": ""}
        run = subprocess.run([str(Path(sys.executable).parent / "dflash-convert"), "--target", TARGET_REPO,
                              "--drafter", DRAFTER_REPO, "--outdir", str(outdir), "--json"], capture_output=True,
                             text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["options"]["target_method"] == "builtin" and manifest["verify"]["servable"] is True
    target, drafter = (outdir / manifest["outputs"][side]["file"] for side in ("target", "drafter"))
    assert read_gguf(target).get("general.architecture") == "minimax-m2"
    assert manifest["outputs"]["target"]["type"] == "q4_0"
    reference.serve_with_and_without_drafter(target, drafter)
    REFERENCE_COMPARISONS.append("llama-server/minimax-m2-pipeline")
