"""Qwen3.5 / Qwen3.6 targets (qwen35, qwen35moe): parity with llama.cpp b11434, loading, refusals.

b11434 computes ``ssm_a = -exp(A_log)`` with torch, whose float ``exp`` (MKL VML on x86) is not correctly
rounded: for about 1% of inputs it is one ulp away from the correctly rounded value we write. That is
the one difference tolerated here, checked to be at most one ulp; every other byte must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from fixtures.safetensors_io import _pack_safetensors
from gguf_compare import diff_within_one_ulp, ignored, ulp_apart

from dflash_gguf.convert.targets import builtin_family, convert_target
from dflash_gguf.errors import ConfigError, NotCoveredError
from dflash_gguf.ggufio.reader import GGUFMeta, read_gguf, tensor_nbytes

LM = "model.language_model"
FIXTURES = {  # name -> make_qwen35_target keywords
    "dense": {},
    "dense-untied-nomtp": {"tied": False, "mtp": False},
    "moe": {"moe": True},
}
PARITY_CASES = [
    *[("dense", o) for o in ("bf16", "f16", "q8_0", "auto", "q4_0")],
    *[("dense-untied-nomtp", o) for o in ("bf16", "q4_0")],
    *[("moe", o) for o in ("bf16", "q8_0", "q4_0")],
]


@pytest.fixture(scope="module")
def qwen35_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture targets by name, made on first use (they need the b11434 sdist's vocab)."""
    work = tmp_path_factory.mktemp("qwen35-fx")

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            src = reference.require_llama_cpp_src()
            self[name] = mf.make_qwen35_target(work, llama_cpp_src=src, name=name, **FIXTURES[name])
            return self[name]

    return Dirs()


@pytest.fixture(scope="module")
def reference_outputs(tmp_path_factory: pytest.TempPathFactory, qwen35_dirs: dict[str, Path]) -> dict:
    """b11434's output per (fixture, outtype), converted once. ``q4_0`` is b11434's bf16 conversion run
    through llama-quantize; ``auto`` is the bf16 conversion (b11434 picks bf16 for a BF16 checkpoint and
    writes the same bytes). A fixture without MTP is converted with ``--no-mtp`` (b11434's default stops
    on it: ``assert self.opt_num_mtp_layers != 0``)."""
    work = tmp_path_factory.mktemp("qwen35-ref")

    class Refs(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            name, outtype = key
            if outtype in ("q4_0", "auto"):
                conv = self[(name, "bf16")]
                if outtype == "auto":
                    return conv
                out = work / f"{name}-q4_0.gguf"
                proc = reference.run_llama_quantize(conv, out, "q4_0")
                assert proc.returncode == 0, proc.stderr[-3000:]
            else:
                out = work / f"{name}-{outtype}.gguf"
                extra = [] if FIXTURES[name].get("mtp", True) else ["--no-mtp"]
                proc = reference.run_reference_convert(qwen35_dirs[name], None, out, outtype, extra)
                assert proc.returncode == 0, proc.stderr[-3000:]
            self[key] = out
            return out

    return Refs()


def _diff_but_exp_ulp(ours: Path, ref: Path) -> list[str]:
    """``gguf_compare.diff``, with ssm_a tensors allowed one ulp per value (torch's exp, see the docstring)."""
    return diff_within_one_ulp(ours, ref, (".ssm_a",))


def _tensor_bytes(meta: GGUFMeta, name: str) -> bytes:
    t = meta.tensors[name]
    with open(meta.path, "rb") as f:
        f.seek(meta.data_offset + t.offset)
        return f.read(tensor_nbytes(t, meta.path))


def _same_as_reference(ours: Path, ref: Path) -> list[str]:
    """``_diff_but_exp_ulp``, fast when the files agree.

    ``gguf_compare`` reads through gguf.GGUFReader, which takes ~10 s per file on a 150k-token vocabulary;
    the project's own header reader takes well under one. The same comparison is made with it first
    (version, keys outside ``gguf_compare.ignored`` with their order, types and values, tensors with
    their order, types, shapes and bytes); only a mismatch goes to ``diff`` for its messages.
    """
    a, b = read_gguf(ours), read_gguf(ref)
    ka = [(k, v) for k, v in a.kv.items() if not ignored(k)]
    kb = [(k, v) for k, v in b.kv.items() if not ignored(k)]
    same = a.version == b.version and [k for k, _ in ka] == [k for k, _ in kb]
    for (_, x), (_, y) in zip(ka, kb, strict=False):
        if not same:
            break
        same = (x.vtype, x.subtype) == (y.vtype, y.subtype) and (
            np.array_equal(x.value, y.value) if isinstance(x.value, np.ndarray) else x.value == y.value)
    same = same and [(t.name, t.ne, t.qtype) for t in a.tensors.values()] == \
        [(t.name, t.ne, t.qtype) for t in b.tensors.values()]
    for name in a.tensors if same else ():
        x, y = _tensor_bytes(a, name), _tensor_bytes(b, name)
        if x != y and not (name.endswith(".ssm_a") and ulp_apart(x, y)):
            same = False
            break
    return [] if same else _diff_but_exp_ulp(ours, ref)


# ----------------------------------------------------------------------------------------- parity


def _ours(model: Path, out: Path, outtype: str) -> Path:
    """Our conversion to ``outtype``; q4_0 is the one pass (bf16 quantized as llama-quantize does)."""
    if outtype == "q4_0":
        convert_target(model, out, "bf16", quant="q4_0")
    else:
        convert_target(model, out, outtype)
    return out


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY_CASES)
def test_matches_llama_cpp_b11434(tmp_path: Path, qwen35_dirs: dict[str, Path], reference_outputs: dict,
                                  name: str, outtype: str) -> None:
    """convert (bf16/f16/q8_0/auto) equals b11434's convert; one-pass q4_0 equals convert + llama-quantize."""
    reference.require_or_skip(reference.reference_available())
    if outtype == "q4_0":
        reference.require_or_skip(reference.llama_cpp_available())
    ours = _ours(qwen35_dirs[name], tmp_path / "ours.gguf", outtype)
    ref = reference_outputs[(name, outtype)]
    if (name, outtype) == ("dense", "bf16"):  # once through gguf_compare itself, to anchor the fast check
        assert _diff_but_exp_ulp(ours, ref) == []
    assert _same_as_reference(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"target/qwen35-{name}/{outtype}")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), [("dense", "bf16"), ("moe", "q8_0")])
def test_no_mtp_matches_b11434s_flag(tmp_path: Path, qwen35_dirs: dict[str, Path], name: str, outtype: str) -> None:
    """``drop_mtp`` (dflash-convert --no-mtp) on a checkpoint with an MTP head writes what b11434's converter writes
    with --no-mtp: no nextn layer, no nextn_predict_layers, the trunk's block count."""
    reference.require_or_skip(reference.reference_available())
    ref = tmp_path / "ref.gguf"
    proc = reference.run_reference_convert(qwen35_dirs[name], None, ref, outtype, ["--no-mtp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = tmp_path / "ours.gguf"
    result = convert_target(qwen35_dirs[name], ours, outtype, drop_mtp=True)
    assert _same_as_reference(ours, ref) == []
    meta = read_gguf(ours)
    arch = meta.arch
    assert meta.get(f"{arch}.nextn_predict_layers") is None and meta.get(f"{arch}.block_count") == 4
    assert not [t for t in meta.tensors if ".nextn." in t or t.startswith("blk.4.")]
    assert any("--no-mtp" in n for n in result.notes), result.notes
    REFERENCE_COMPARISONS.append(f"target/qwen35-{name}/{outtype}/no-mtp")


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), [("dense", "q4_0"), ("moe", "q8_0"), ("dense-untied-nomtp", "bf16")])
def test_libllama_loads_it(tmp_path: Path, qwen35_dirs: dict[str, Path], name: str, outtype: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    loaded, log = reference.load_with_libllama(_ours(qwen35_dirs[name], tmp_path / "ours.gguf", outtype))
    assert loaded, log[-3000:]
    REFERENCE_COMPARISONS.append(f"target/qwen35-{name}/{outtype}/libllama")


# ------------------------------------------------------------------------- layout (no reference)


def test_layout_without_reference(tmp_path: Path, qwen35_dirs: dict[str, Path]) -> None:
    """The Qwen3.5 particulars checked directly: MTP layer, recurrent flags, V-head reorder, A_log, +1 norms."""
    from dflash_gguf.convert.safetensors import index_checkpoint
    from dflash_gguf.convert.tensor_io import to_f32

    model = qwen35_dirs["dense"]
    out = tmp_path / "q.gguf"
    result = convert_target(model, out, "bf16")
    meta = read_gguf(out)  # not read_kv / read_tensors: GGUFReader is slow on this vocabulary
    assert meta.get("general.architecture") == "qwen35"
    assert meta.get("qwen35.block_count") == 5 and meta.get("qwen35.nextn_predict_layers") == 1
    assert list(meta.get("qwen35.attention.recurrent_layers")) == [True, True, True, False, False]
    assert meta.get("qwen35.rope.dimension_count") == 16
    assert list(meta.get("qwen35.rope.dimension_sections")) == [3, 3, 2, 0]
    assert meta.get("qwen35.ssm.group_count") == 2 and meta.get("qwen35.ssm.time_step_rank") == 4
    assert not any("visual" in n for n in meta.tensors) and len(meta.tensors) == result.n_tensors == 70
    assert "blk.4.nextn.eh_proj.weight" in meta.tensors and "output.weight" not in meta.tensors
    tensors = {n: (None, None, _tensor_bytes(meta, n)) for n in meta.tensors}

    refs = index_checkpoint(model)

    def hf(name: str) -> np.ndarray:
        ref = refs[name]
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            return to_f32(f.read(ref.nbytes), ref.dtype).reshape(ref.shape)

    order = np.array([0, 2, 1, 3])  # 2 key heads, 4 value heads: grouped [K0v0 K0v1 K1v0 K1v1] -> tiled
    a_log = hf(f"{LM}.layers.0.linear_attn.A_log")
    ssm_a = np.frombuffer(tensors["blk.0.ssm_a"][2], "<f4")
    np.testing.assert_array_equal(ssm_a, -np.exp(a_log.astype(np.float64)).astype(np.float32)[order])
    norm = np.frombuffer(tensors["blk.0.attn_norm.weight"][2], "<f4")
    np.testing.assert_array_equal(norm, hf(f"{LM}.layers.0.input_layernorm.weight") + np.float32(1))
    ssm_norm = np.frombuffer(tensors["blk.0.ssm_norm.weight"][2], "<f4")
    np.testing.assert_array_equal(ssm_norm, hf(f"{LM}.layers.0.linear_attn.norm.weight"))  # no +1
    conv = np.frombuffer(tensors["blk.0.ssm_conv1d.weight"][2], "<f4").reshape(256, 4)
    src = hf(f"{LM}.layers.0.linear_attn.conv1d.weight")[:, 0, :]
    v_rows = 128 + (order[:, None] * 32 + np.arange(32)).reshape(-1)
    np.testing.assert_array_equal(conv, np.concatenate([src[:128], src[v_rows]]))


def test_weightless_fixture_and_family(tmp_path: Path) -> None:
    src = reference.require_llama_cpp_src()
    d = mf.make_qwen35_target(tmp_path, llama_cpp_src=src, moe=True, weights=False)
    assert not (d / "model.safetensors").exists() and (d / "tokenizer.json").is_file()
    assert builtin_family(d) == "qwen35"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]


# ---------------------------------------------------------------------------------------- refusals


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_refuses_layer_types_not_matching_layers(tmp_path: Path, qwen35_dirs: dict[str, Path]) -> None:
    model = _copy(qwen35_dirs["dense"], tmp_path / "bad")
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.gguf"
    with pytest.raises(ConfigError, match="layer_types has 3 entries"):
        convert_target(model, out, "bf16")
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_refuses_per_expert_tensors(tmp_path: Path, qwen35_dirs: dict[str, Path]) -> None:
    """Experts one tensor each (Qwen2MoeModel merges them; the built-in reads the fused layout only)."""
    model = _copy(qwen35_dirs["moe"], tmp_path / "per-expert")
    path = model / "model.safetensors"
    extra = (f"{LM}.layers.0.mlp.experts.0.gate_proj.weight", "BF16", (64, 64), bytes(64 * 64 * 2))
    path.write_bytes(_pack_safetensors([*mf.read_safetensors_raw(path), extra]))
    out = tmp_path / "out.gguf"
    with pytest.raises(NotCoveredError, match="one tensor each"):
        convert_target(model, out, "bf16")
    assert not out.exists()


def test_refuses_mtp_layer_without_its_tensors(tmp_path: Path, qwen35_dirs: dict[str, Path]) -> None:
    """b11434 declares the MTP layer anyway and libllama then stops on 'blk.4.attn_norm.weight not found'."""
    model = _copy(qwen35_dirs["dense-untied-nomtp"], tmp_path / "stripped")
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.gguf"
    with pytest.raises(ConfigError, match="no mtp.. tensors"):
        convert_target(model, out, "bf16")
    assert not out.exists()
