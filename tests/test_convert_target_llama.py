"""The built-in Llama-3.x target converter: parity with llama.cpp b11434, the q/k permutation and the
llama3 rope factors checked on their own, refusals, and our file served by b11434's llama-server."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.llama import LLAMA3_MASK_TOKEN_ID
from gguf_compare import diff

from dflash_gguf.cli import main
from dflash_gguf.convert.targets import builtin_family, convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.reader import read_gguf, tensor_nbytes

UNTIED, TIED = "llama-3.1-tiny-instruct", "llama-3.2-tiny-instruct"

# (fixture, outtype) compared byte for byte with b11434's converter; the tied one differs only in `output`.
PARITY_CASES = [(UNTIED, "bf16"), (UNTIED, "f16"), (UNTIED, "q8_0"), (TIED, "bf16")]


@pytest.fixture(scope="module")
def llama_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both Llama-3 fixture targets (their tokenizer comes from b11434's models/ggml-vocab-llama-bpe.gguf)."""
    src = reference.require_llama_cpp_src()
    root = tmp_path_factory.mktemp("llama-targets")
    made = [mf.make_llama3_target(root, llama_cpp_src=src), mf.make_llama3_target(root, llama_cpp_src=src, tied=True)]
    return {p.name: p for p in made}


@pytest.fixture(scope="module")
def ours_bf16(llama_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Our BF16 conversion of each fixture."""
    out = tmp_path_factory.mktemp("llama-ours")
    return {name: convert_target(d, out / f"{name}-BF16.gguf", "bf16").outfile for name, d in llama_targets.items()}


def _gguf_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensor name -> (type, ne, bytes), via our header reader (gguf-py's takes seconds on a 128k vocab)."""
    meta = read_gguf(path)
    with open(path, "rb") as f:
        out = {}
        for t in meta.tensors.values():
            f.seek(meta.data_offset + t.offset)
            out[t.name] = (t.type_name, list(t.ne), f.read(tensor_nbytes(t, path)))
    return out


def _hf_tensor(model_dir: Path, name: str) -> tuple[tuple[int, ...], bytes]:
    for tname, _dtype, shape, raw in mf.read_safetensors_raw(model_dir / "model.safetensors"):
        if tname == name:
            return shape, raw
    raise KeyError(name)


# --------------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize(("fixture", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, llama_targets: dict[str, Path], fixture: str, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    target = llama_targets[fixture]
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = convert_target(target, ours, outtype)
    proc = reference.run_reference_convert(target, None, ref, outtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    tensors = _gguf_tensors(ours)
    assert "rope_freqs.weight" in tensors and ("output.weight" in tensors) == (fixture == UNTIED)
    assert result.n_tensors == len(tensors) and result.vocab.model == "gpt2/llama-bpe"
    REFERENCE_COMPARISONS.append(f"llama-target/{fixture}/{outtype}")


@pytest.mark.reference
def test_llama3_drafter_matches_llama_cpp_b11434(tmp_path: Path, llama_targets: dict[str, Path]) -> None:
    """The DFlash drafter of a Llama-3 target: its vocabulary comes from the llama-bpe tokenizer."""
    reference.require_or_skip(reference.reference_available())
    drafter = mf.make_drafter(tmp_path / "drafters", target="llama3")
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, llama_targets[UNTIED], ours, "bf16")
    proc = reference.run_reference_convert(drafter, llama_targets[UNTIED], ref, "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("llama3-drafter/default/bf16")


# --------------------------------------------------------------------------------------------------
# what the conversion does, checked without the reference
# --------------------------------------------------------------------------------------------------


def test_registered_for_llama_targets(llama_targets: dict[str, Path]) -> None:
    assert {builtin_family(d) for d in llama_targets.values()} == {"llama"}


@pytest.mark.parametrize("proj", ["q", "k"])
def test_q_and_k_rows_interleave_each_heads_rotary_halves(llama_targets: dict[str, Path],
                                                          ours_bf16: dict[str, Path], proj: str) -> None:
    """HF pairs row i with row i + hd/2 in every head (rotate_half); the GGUF puts them at 2i and 2i+1."""
    target = llama_targets[UNTIED]
    cfg = json.loads((target / "config.json").read_text())
    heads = cfg["num_attention_heads"] if proj == "q" else cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    ours = _gguf_tensors(ours_bf16[UNTIED])
    for layer in range(cfg["num_hidden_layers"]):
        shape, raw = _hf_tensor(target, f"model.layers.{layer}.self_attn.{proj}_proj.weight")
        src = np.frombuffer(raw, "<u2").reshape(shape)
        qtype, ne, data = ours[f"blk.{layer}.attn_{proj}.weight"]
        out = np.frombuffer(data, "<u2").reshape(shape)
        assert qtype == "BF16" and ne == [shape[1], shape[0]] and shape[0] == heads * hd
        for h in range(heads):
            first, second = src[h * hd: h * hd + hd // 2], src[h * hd + hd // 2: (h + 1) * hd]
            assert np.array_equal(out[h * hd: (h + 1) * hd: 2], first)
            assert np.array_equal(out[h * hd + 1: (h + 1) * hd: 2], second)
        assert not np.array_equal(out, src)  # the permutation is not the identity for these shapes


@pytest.mark.parametrize("fixture", [UNTIED, TIED])
def test_rope_freqs_follow_the_llama3_scaling_rule(llama_targets: dict[str, Path], ours_bf16: dict[str, Path],
                                                   fixture: str) -> None:
    """Recomputed here in float64 from config.json (Meta's rule): factor 1 for short wavelengths, `factor`
    for long ones, a smooth blend between; the fixture's head size reaches all three bands."""
    cfg = json.loads((llama_targets[fixture] / "config.json").read_text())
    rope = cfg["rope_scaling"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    qtype, ne, data = _gguf_tensors(ours_bf16[fixture])["rope_freqs.weight"]
    got = np.frombuffer(data, "<f4")
    expect = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / dim)
        ctx = rope["original_max_position_embeddings"]
        if wavelen < ctx / rope["high_freq_factor"]:
            expect.append(1.0)
        elif wavelen > ctx / rope["low_freq_factor"]:
            expect.append(rope["factor"])
        else:
            smooth = (ctx / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            expect.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    assert qtype == "F32" and ne == [dim // 2]
    np.testing.assert_allclose(got, expect, rtol=1e-5)
    assert {1.0, rope["factor"]} < set(got.tolist())  # plus at least one blended value


def test_tied_target_differs_only_by_the_output_tensor(ours_bf16: dict[str, Path]) -> None:
    untied, tied = _gguf_tensors(ours_bf16[UNTIED]), _gguf_tensors(ours_bf16[TIED])
    assert set(untied) - set(tied) == {"output.weight"}


# --------------------------------------------------------------------------------------------------
# refusals: one per problem, before anything is written
# --------------------------------------------------------------------------------------------------


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


_ROPE_NO_LOW = {"factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_type": "llama3"}
REFUSALS = [
    # (fixture, config edits, exit code, words the message must contain)
    (TIED, {"tie_word_embeddings": False}, 5, ["missing", "output.weight"]),
    (UNTIED, {"intermediate_size": 256}, 5, ["mlp.", "[64, 256]", "config.json"]),
    (UNTIED, {"num_hidden_layers": 3}, 5, ["model.layers.3.", "not part of a llama model"]),
    (UNTIED, {"rope_scaling": _ROPE_NO_LOW}, 3, ["rope_scaling", "low_freq_factor"]),
    (UNTIED, {"num_key_value_heads": 3}, 3, ["num_key_value_heads 3"]),
    (UNTIED, {"draft_vocab_size": 32000, "num_hidden_layers": 1}, 4, ["EAGLE-3", "--llama-cpp"]),
    (UNTIED, {"vocab_size": 32016}, 4, ["vocab_size 32016", "--target-gguf"]),
]


@pytest.mark.parametrize(("fixture", "edits", "code", "words"), REFUSALS,
                         ids=["untied-without-lm_head", "shape", "unknown-layer", "llama3-rope-incomplete",
                              "kv-heads", "eagle3-head", "codellama-vocab"])
def test_refuses_before_writing(tmp_path: Path, llama_targets: dict[str, Path], fixture: str,
                                edits: dict[str, object], code: int, words: list[str]) -> None:
    target = _variant(tmp_path, llama_targets[fixture], **edits)
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(main, ["convert-target", str(target), "--outfile", str(out)])
    assert result.exit_code == code, result.output
    for word in (str(target), *words):
        assert word in result.output, result.output
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


# --------------------------------------------------------------------------------------------------
# served by llama.cpp b11434
# --------------------------------------------------------------------------------------------------


def _complete(server: reference.LlamaServer) -> dict:
    status, body = reference.http_json(server.url + "/completion",
                                       {"prompt": "hello world", "n_predict": 8, "temperature": 0})
    assert status == 200, body
    assert isinstance(body, dict)
    return body


@pytest.mark.reference
def test_llama_server_serves_our_target_and_drafts_with_our_drafter(tmp_path: Path, llama_targets: dict[str, Path],
                                                                   ours_bf16: dict[str, Path]) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    target_gguf = ours_bf16[UNTIED]
    with reference.start_llama_server(target_gguf, None) as server:
        assert server.ready, server.output[-3000:]
        alone = _complete(server)
    assert alone["tokens_predicted"] == 8 and alone["content"]
    assert alone["prompt"].startswith("<|begin_of_text|>")  # add_bos_token from the Llama-3 tokenizer

    drafter_gguf = tmp_path / "drafter-BF16.gguf"
    convert_drafter(mf.make_drafter(tmp_path, target="llama3"), llama_targets[UNTIED], drafter_gguf)
    with reference.start_llama_server(target_gguf, drafter_gguf, n_max=9) as server:
        assert server.ready, server.output[-3000:]
        paired = _complete(server)
    assert paired["timings"]["draft_n"] > 0  # the drafter ran (random weights: nothing is accepted)
    assert f"block_size=10, mask_token_id={LLAMA3_MASK_TOKEN_ID}, n_extract=2" in server.output
    verdict = run_cli("dflash-verify", str(drafter_gguf), str(target_gguf))
    assert verdict.returncode == 0, verdict.stdout
    REFERENCE_COMPARISONS.append("llama-server/llama3-target-ours")
