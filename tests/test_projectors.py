"""The built-in projector ("mmproj") converter: parity with llama.cpp b11434's ``convert_hf_to_gguf.py --mmproj``,
refusals before writing, libmtmd loading the files, and the text conversion unchanged by the towers.

b11434 computes the Gemma-4 audio tower's ``per_dim_scale`` through torch's ``softplus``, whose vectorised
exp/log1p are not correctly rounded: about one value in five sits one ulp from the correctly rounded value we
write. That is the one difference tolerated here (``a.blk.N.per_dim_scale.weight``, at most one ulp per value);
every other byte must be identical. The Qwen3.5 text side has the same kind of difference, from torch's ``exp`` in
``ssm_a = -exp(A_log)`` (tests/test_convert_target_qwen35.py), tolerated the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from fixtures.gemma import GEMMA4_TOWERS
from fixtures.safetensors_io import _pack_safetensors
from gguf_compare import diff, diff_within_one_ulp, read_kv, read_tensors

from dflash_gguf.convert.targets import (
    PROJECTORS,
    TARGET_ARCHS,
    convert_projector,
    convert_target,
    has_projector,
    projector_for,
)
from dflash_gguf.convert.targets.gemma4 import Gemma4Projector, Gemma4UnifiedProjector
from dflash_gguf.convert.targets.qwen35 import Qwen35Projector
from dflash_gguf.errors import ConfigError, NotCoveredError, TensorError, UnsupportedModelError

OUTTYPES = ("auto", "f16", "bf16", "q8_0")
GEMMA = tuple(f"gemma4-{t}" for t in GEMMA4_TOWERS)  # gemma4-vision, gemma4-vision_audio, gemma4-unified
QWEN = {"qwen35-dense": {}, "qwen35-moe": {"moe": True}, "qwen35-deepstack": {"deepstack": (1,)}}
CASES = (*GEMMA, *QWEN)
# every class at every outtype b11434 resolves, f32 besides; "f32-towers": the towers stored F32 under a BF16
# language model, where b11434's auto picks f16 for the projector (bf16 for the text model)
PARITY = [*((c, o) for c in CASES for o in OUTTYPES), ("gemma4-vision_audio", "f32"), ("qwen35-dense", "f32"),
          ("gemma4-f32-towers", "auto")]
# fixture -> (projector class, clip projector type keys as b11434 writes them)
TYPES = {
    "gemma4-vision": (Gemma4Projector, {"clip.vision.projector_type": "gemma4v"}),
    "gemma4-vision_audio": (Gemma4Projector, {"clip.vision.projector_type": "gemma4v",
                                              "clip.audio.projector_type": "gemma4a"}),
    "gemma4-unified": (Gemma4UnifiedProjector, {"clip.vision.projector_type": "gemma4uv",
                                                "clip.audio.projector_type": "gemma4ua"}),
    **{name: (Qwen35Projector, {"clip.projector_type": "qwen3vl_merger"}) for name in QWEN},
}
SOFTPLUS = ".per_dim_scale.weight"
ONE_ULP = (SOFTPLUS, ".ssm_a")  # F32 tensors b11434 computes with torch's not correctly rounded softplus / exp


@pytest.fixture(scope="module")
def towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Fixture targets with towers by case name, made on first use (the Qwen ones need the b11434 sdist)."""
    work = tmp_path_factory.mktemp("projector-fx")

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            if name in QWEN:
                src = reference.require_llama_cpp_src()
                self[name] = mf.make_qwen35_target(work, llama_cpp_src=src, name=name, vision_tower=True, **QWEN[name])
            elif name == "gemma4-f32-towers":
                self[name] = _copy(self["gemma4-vision"], work / name)
                _edit_tensors(self[name], _towers_as_f32)
            elif name.startswith("gemma4-"):
                kind = name.removeprefix("gemma4-")
                self[name] = mf.make_gemma4_target(work, name_suffix=f"-{kind}", towers=kind)
            else:
                raise KeyError(name)
            return self[name]

    return Dirs()


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, towers: dict[str, Path]) -> dict[tuple[str, str], Path]:
    """b11434's ``--mmproj`` output per (case, outtype), converted once (and cached across runs)."""
    work = tmp_path_factory.mktemp("projector-ref")

    class Refs(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            name, outtype = key
            out = work / f"mmproj-{name}-{outtype}.gguf"
            proc = reference.run_reference_convert(towers[name], None, out, outtype, ["--mmproj"])
            assert proc.returncode == 0, proc.stderr[-3000:]
            self[key] = out
            return out

    return Refs()


def _diff(ours: Path, ref: Path) -> list[str]:
    """``gguf_compare.diff``, with per_dim_scale and ssm_a allowed one ulp per value (torch, see the docstring)."""
    return diff_within_one_ulp(ours, ref, ONE_ULP)


def _nothing_written(out: Path) -> None:
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    path.write_bytes(_pack_safetensors(edit(mf.read_safetensors_raw(path))))


def _towers_as_f32(entries):
    """The vision tower and its embedder rewritten F32 (BF16 widened exactly), the language model left BF16."""
    return [(n, "F32", shape, (np.frombuffer(raw, "<u2").astype("<u4") << 16).tobytes())
            if "vision" in n and dt == "BF16" else (n, dt, shape, raw) for n, dt, shape, raw in entries]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ----------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("name", "outtype"), PARITY)
def test_matches_llama_cpp_b11434(tmp_path: Path, towers: dict[str, Path], references: dict, name: str,
                                  outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    ours = tmp_path / "mmproj.gguf"
    result = convert_projector(towers[name], ours, outtype)
    assert _diff(ours, references[(name, outtype)]) == []
    kv = read_kv(ours)
    types = TYPES.get(name, TYPES["gemma4-vision"])[1]
    assert {k: kv[k][1] for k in types} == types
    assert result.n_tensors == len(read_tensors(ours)) and result.sha256 is not None
    if name == "gemma4-f32-towers":
        assert result.outtype == "f16" and convert_target(towers[name], tmp_path / "text.gguf").outtype == "bf16"
    REFERENCE_COMPARISONS.append(f"mmproj/{name}/{outtype}")


def test_outtype_rules(tmp_path: Path, towers: dict[str, Path]) -> None:
    """b11434's type rules, checked directly (runs without the reference): auto follows the first 2-D tower tensor;
    patch embeddings F16 under f16 and F32 otherwise; the audio tower's convolutions F32 (its input projection too,
    caught by b11434's ``"_conv" in name``); Q8_0 rows not a multiple of 32 fall back to F16."""
    target = towers["gemma4-vision_audio"]
    types = {}
    for outtype in ("f16", "q8_0", "auto"):
        out = tmp_path / f"{outtype}.gguf"
        result = convert_projector(target, out, outtype)
        types[outtype] = {name: t for name, (t, _, _) in read_tensors(out).items()}
        assert result.outtype == ("bf16" if outtype == "auto" else outtype)
    assert types["f16"]["v.patch_embd.weight"] == "F16" and types["q8_0"]["v.patch_embd.weight"] == "F32"
    assert types["auto"]["v.patch_embd.weight"] == "F32" and types["auto"]["v.blk.0.attn_q.weight"] == "BF16"
    assert types["q8_0"]["a.input_projection.weight"] == types["q8_0"]["a.conv1d.0.weight"] == "F32"
    assert types["q8_0"]["a.blk.0.conv_dw.weight"] == "F32" and types["q8_0"]["v.position_embd.weight"] == "F32"
    assert types["q8_0"]["v.blk.0.attn_q.weight"] == "Q8_0" and types["q8_0"]["v.blk.0.ffn_down.weight"] == "F16"
    assert types["q8_0"]["a.blk.0.attn_q.input_max"] == "F32"


# ------------------------------------------------------------------------------------------- text side


@pytest.mark.parametrize("name", CASES)
def test_text_conversion_ignores_the_towers(tmp_path: Path, towers: dict[str, Path], name: str) -> None:
    """The text GGUF of a fixture with towers equals the one of the same fixture without them but with the same
    vocabulary (the media marker tokens the tower fixtures add; the target parity tests compare the fixtures with
    b11434)."""
    if name in QWEN:
        kw = {k: v for k, v in QWEN[name].items() if k != "deepstack"}
        plain = mf.make_qwen35_target(tmp_path, llama_cpp_src=reference.require_llama_cpp_src(), name="plain",
                                      vision_tokens=True, **kw)
    else:
        plain = mf.make_gemma4_target(tmp_path, media_markers=True)
    convert_target(towers[name], tmp_path / "with.gguf", "bf16")
    convert_target(plain, tmp_path / "without.gguf", "bf16")
    assert diff(tmp_path / "with.gguf", tmp_path / "without.gguf") == []


@pytest.mark.reference
@pytest.mark.parametrize("name", ["gemma4-vision_audio", "qwen35-dense"])
def test_text_conversion_with_towers_matches_b11434(tmp_path: Path, towers: dict[str, Path], name: str) -> None:
    """The tower fixtures' text side, media marker tokens included, as b11434 converts it."""
    reference.require_or_skip(reference.reference_available())
    target = towers[name]
    convert_target(target, tmp_path / "ours.gguf")
    proc = reference.run_reference_convert(target, None, tmp_path / "ref.gguf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _diff(tmp_path / "ours.gguf", tmp_path / "ref.gguf") == []
    REFERENCE_COMPARISONS.append(f"target/{name}/auto")


# --------------------------------------------------------------------------------------------- loading


@pytest.mark.reference
@pytest.mark.parametrize("name", ["gemma4-vision", "gemma4-vision_audio", "gemma4-unified", "qwen35-dense"])
def test_libmtmd_loads_our_projector(tmp_path: Path, towers: dict[str, Path], name: str) -> None:
    """llama-mtmd-cli b11434 loads our text model and projector, runs the projector's warmup graphs, and decodes."""
    reference.require_or_skip(reference.llama_cpp_available())
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    convert_target(towers[name], text, "f16")
    convert_projector(towers[name], mmproj, "q8_0")
    proc = reference.run_mtmd_cli(text, mmproj)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    REFERENCE_COMPARISONS.append(f"llama-mtmd-cli/{name}")


# ---------------------------------------------------------------------------------------- registry, dry run


def test_registry(tmp_path: Path, towers: dict[str, Path]) -> None:
    """PROJECTORS holds the ...ForConditionalGeneration classes of the Gemma-4 and Qwen3.5 rows; a target without
    towers has none."""
    plain = mf.make_gemma4_target(tmp_path)
    conditional = {hf for arch in TARGET_ARCHS for hf in arch.hf if hf.endswith("ForConditionalGeneration")
                   and arch.gguf in ("gemma4", "qwen35", "qwen35moe")}
    assert set(PROJECTORS) == conditional
    for name in GEMMA:
        fam = projector_for(towers[name])
        assert has_projector(towers[name]) and type(fam) is TYPES[name][0]
    assert not has_projector(plain) and projector_for(plain) is None
    with pytest.raises(ConfigError, match="neither 'vision_config' nor 'audio_config'"):
        convert_projector(plain, tmp_path / "x.gguf")
    _nothing_written(tmp_path / "x.gguf")


def test_unknown_architecture_is_not_covered(tmp_path: Path, towers: dict[str, Path]) -> None:
    target = _copy(towers["gemma4-vision"], tmp_path / "t")
    cfg = json.loads((target / "config.json").read_text())
    cfg["vision_config"]["architectures"] = ["SomeVisionModel"]  # b11434 picks the mmproj class by this one
    (target / "config.json").write_text(json.dumps(cfg))
    assert not has_projector(target)
    with pytest.raises(NotCoveredError, match="SomeVisionModel"):
        convert_projector(target, tmp_path / "x.gguf")


@pytest.mark.parametrize("name", ["gemma4-vision_audio", "qwen35-dense"])
def test_dry_run_writes_nothing(tmp_path: Path, towers: dict[str, Path], name: str) -> None:
    out = tmp_path / "mmproj.gguf"
    dry = convert_projector(towers[name], out, "q8_0", dry_run=True)
    _nothing_written(out)
    assert dry.dry_run and dry.sha256 is None and dry.n_tensors > 0
    real = convert_projector(towers[name], out, "q8_0", provenance={"target.repo": "org/model"})
    assert (real.n_tensors, real.outtype) == (dry.n_tensors, dry.outtype)
    assert out.stat().st_size > dry.n_bytes  # the dry run sizes the tensor data; the file adds the header
    kv = read_kv(out)
    assert kv["general.name"][1] == "org/model" and "dflash_gguf.target.vocab_sha256" not in kv
    assert kv["dflash_gguf.target.architecture"][1] == projector_for(towers[name]).src.arch  # type: ignore[union-attr]


# -------------------------------------------------------------------------------------------- refusals


@pytest.mark.reference
def test_missing_image_mean_refused_before_writing(tmp_path: Path, towers: dict[str, Path]) -> None:
    """b11434 dies with a KeyError when neither processor_config.json nor preprocessor_config.json has image_mean;
    we refuse first, naming both files and the field."""
    target = _copy(towers["gemma4-vision"], tmp_path / "t")
    (target / "processor_config.json").unlink()
    out = tmp_path / "mmproj.gguf"
    with pytest.raises(ConfigError) as err:
        convert_projector(target, out)
    message = str(err.value)
    assert "'image_mean'" in message and "processor_config.json" in message and "preprocessor_config.json" in message
    _nothing_written(out)
    reference.require_or_skip(reference.reference_available())
    proc = reference.run_reference_convert(target, None, tmp_path / "ref.gguf", "auto", ["--mmproj"])
    assert proc.returncode != 0 and "KeyError: 'image_mean'" in proc.stderr, proc.stderr[-2000:]
    REFERENCE_COMPARISONS.append("mmproj/refusal/image_mean")


def test_missing_image_std_and_integer_stats_refused(tmp_path: Path, towers: dict[str, Path]) -> None:
    target = _copy(towers["gemma4-unified"], tmp_path / "t")
    (target / "processor_config.json").unlink()
    pre = {"image_mean": [0.5, 0.5, 0.5]}
    (target / "preprocessor_config.json").write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match="'image_std'"):
        convert_projector(target, tmp_path / "x.gguf")
    (target / "preprocessor_config.json").write_text(json.dumps({**pre, "image_std": [1, 1, 1]}))
    with pytest.raises(ConfigError, match="INT32 array"):
        convert_projector(target, tmp_path / "x.gguf")
    # processor_config.json wins over preprocessor_config.json, its image_processor section lifted to the top
    (target / "processor_config.json").write_text(json.dumps({"image_processor": {"image_std": [0.25, 0.5, 1.0]}}))
    convert_projector(target, tmp_path / "ok.gguf")
    assert read_kv(tmp_path / "ok.gguf")["clip.vision.image_std"][1] == [0.25, 0.5, 1.0]
    _nothing_written(tmp_path / "x.gguf")


@pytest.mark.parametrize("name", ["gemma4-vision_audio", "qwen35-dense"])
def test_tower_tensor_of_wrong_shape_refused(tmp_path: Path, towers: dict[str, Path], name: str) -> None:
    target = _copy(towers[name], tmp_path / "t")
    victim = "model.audio_tower.layers.1.self_attn.q_proj.linear.weight" if name.startswith("gemma") \
        else "model.visual.blocks.1.attn.qkv.weight"

    def shrink(entries):
        return [(n, dt, (shape[0] // 2, *shape[1:]), raw[: len(raw) // 2]) if n == victim else (n, dt, shape, raw)
                for n, dt, shape, raw in entries]

    _edit_tensors(target, shrink)
    out = tmp_path / "mmproj.gguf"
    with pytest.raises(TensorError, match=victim.replace(".", r"\.") + ".*has shape"):
        convert_projector(target, out)
    _nothing_written(out)


def test_unknown_and_missing_tower_tensors_refused(tmp_path: Path, towers: dict[str, Path]) -> None:
    target = _copy(towers["gemma4-unified"], tmp_path / "t")
    _edit_tensors(target, lambda es: [e for e in es if e[0] != "model.vision_embedder.pos_norm.bias"])
    with pytest.raises(TensorError, match=r"missing.*model\.vision_embedder\.pos_norm\.bias"):
        convert_projector(target, tmp_path / "x.gguf")
    extra = ("model.vision_embedder.extra.weight", "BF16", (2,), b"\0" * 4)
    _edit_tensors(target, lambda es: [*es, extra])
    with pytest.raises(TensorError, match=r"model\.vision_embedder\.extra\.weight.*not part of"):
        convert_projector(target, tmp_path / "x.gguf")
    _nothing_written(tmp_path / "x.gguf")


def test_configs_llama_cpp_cannot_serve_refused(tmp_path: Path, towers: dict[str, Path]) -> None:
    """b11434 writes these, and libmtmd's clip loader then fails: grouped-query vision attention (it writes no
    head_count_kv), a Unified audio embedder not 640 wide (libmtmd reads 640-sample frames), a Unified model
    without audio_config (b11434 stops)."""
    for name, edit, error, match in (
        ("gemma4-vision", lambda c: c["vision_config"].update(num_key_value_heads=1), UnsupportedModelError,
         "num_key_value_heads"),
        ("gemma4-unified", lambda c: c["audio_config"].update(audio_embed_dim=320), UnsupportedModelError, "640"),
        ("gemma4-unified", lambda c: c.pop("audio_config"), ConfigError, "audio_embed_dim"),
    ):
        target = _copy(towers[name], tmp_path / f"t{len(list(tmp_path.iterdir()))}")
        cfg = json.loads((target / "config.json").read_text())
        edit(cfg)
        (target / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(error, match=match):
            convert_projector(target, tmp_path / "x.gguf")
        _nothing_written(tmp_path / "x.gguf")
