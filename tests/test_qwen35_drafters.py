"""Drafters for Qwen3.5 / Qwen3.6 targets, and for every target whose vocabulary path b11434 takes the way we
mirror it: identical to b11434, one verdict from precheck, ``--outfile`` and the pipeline, and a drafter that
cannot be converted stops a run before any target work.

Targets are the tiny Qwen3.5 fixtures (``fixtures.qwen35``: the real config layout, a tokenizer rebuilt from
b11434's ggml-vocab-qwen35.gguf); the drafter is shaped like z-lab/Qwen3.5-9B-DFlash.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli
from gguf_compare import diff

from dflash_gguf.convert.pre_tokenizers import PRE_TOKENIZERS
from dflash_gguf.convert.targets import TARGET_ARCHS
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import ConfigError
from dflash_gguf.ggufio.reader import read_gguf

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qwen35-drafters")


@pytest.fixture(scope="module")
def targets(work: Path) -> dict[str, Path]:
    """Dense tied (Qwen3.5-4B-like), untied config-only (Qwen3.6-27B-like: a drafter's conversion reads nothing
    but the target's config and tokenizer), MoE (Qwen3.5-35B-A3B-like)."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    src = llama_cpp_src()
    return {"dense": mf.make_qwen35_target(work / "t", llama_cpp_src=src),
            "untied": mf.make_qwen35_target(work / "t", llama_cpp_src=src, tied=False, weights=False),
            "moe": mf.make_qwen35_target(work / "t", llama_cpp_src=src, moe=True)}


def _relabelled(target: Path, dest: Path, arch: str) -> Path:
    out = Path(shutil.copytree(target, dest))
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = [arch]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ------------------------------------------------------------------------------------------ fingerprints


def test_the_pre_tokenizer_table_is_b11434s() -> None:
    """The fingerprint table we carry is the one b11434's generated ``get_vocab_base_pre`` resolves."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    spec = importlib.util.spec_from_file_location("pre_tokenizer_table", ROOT / "scripts" / "pre_tokenizer_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = (llama_cpp_src() / "conversion" / "base.py").read_text(encoding="utf-8")
    table = module.parse_table(base)
    assert table == PRE_TOKENIZERS
    assert base.count('if chkhsh == "') >= len(table) > 90  # every entry parsed (a few fingerprints repeat)
    assert {"qwen2", "qwen35", "llama-bpe", "gpt-4o"} <= set(table.values())


def test_an_unknown_fingerprint_is_refused_honestly(targets: dict[str, Path], tmp_path: Path) -> None:
    target = Path(shutil.copytree(targets["dense"], tmp_path / "odd-tokenizer"))
    tj = json.loads((target / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"  # another split: another fingerprint
    (target / "tokenizer.json").write_text(json.dumps(tj))
    drafter = mf.make_drafter(tmp_path, target="qwen35")
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", tmp_path / "d.gguf")
    assert run.returncode == 7, run.stderr
    assert "not in llama.cpp b11434's table" in run.stderr and "stops on it too" in run.stderr
    assert not (tmp_path / "d.gguf").exists() and not list(tmp_path.glob("*.partial"))


# ------------------------------------------------------------------------------------------------- parity

PARITY = [("dense", "default"), ("untied", "default"), ("moe", "default"), ("dense", "swa_layer_types")]


@pytest.mark.reference
@pytest.mark.parametrize(("target", "variant"), PARITY, ids=[f"{t}-{v}" for t, v in PARITY])
def test_drafter_matches_b11434(targets: dict[str, Path], tmp_path: Path, target: str, variant: str) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = mf.make_drafter(tmp_path, target="qwen35", variant=variant)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = convert_drafter(drafter, targets[target], ours)
    run = reference.run_reference_convert(drafter, targets[target], ref)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    assert meta.get("tokenizer.ggml.pre") == PRE_TOKENIZERS[_fingerprint(targets[target])]
    assert list(meta.get("dflash.rope.dimension_sections")) == [8, 0, 0, 0]  # M-RoPE target: [head_dim/2, 0, 0, 0]
    assert result.vocab.model.startswith("gpt2/")
    REFERENCE_COMPARISONS.append(f"qwen35-drafter/{target}/{variant}")


def _fingerprint(target: Path) -> str:
    import hashlib

    from tokenizers import Tokenizer

    from dflash_gguf.convert.vocab import CHKTXT

    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    return hashlib.sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest()


# Target classes whose set_vocab is TextModel's GPT-2 path, from the target families' rows: on the Qwen2-tokenizer
# fixture, b11434 embeds the same vocabulary for each, and so do we. Left out: the rows where b11434's drafter
# conversion differs (their note says how) and the image-text classes, whose config nests a text_config.
GPT2_TARGETS = [hf for arch in TARGET_ARCHS if arch.drafter_vocab == "gpt2" and not arch.drafter_note
                for hf in arch.hf if not hf.endswith("ForConditionalGeneration")]


@pytest.fixture(scope="module")
def qwen2_vocab_pair(work: Path) -> tuple[Path, Path]:
    reference.require_or_skip(reference.llama_cpp_src_available())
    return (mf.make_qwen3_target(work / "q3", llama_cpp_src=llama_cpp_src(), weights=False),
            mf.make_drafter(work / "q3d", target="qwen3"))


@pytest.mark.reference
@pytest.mark.parametrize("arch", GPT2_TARGETS)
def test_gpt2_path_targets_match_b11434(qwen2_vocab_pair: tuple[Path, Path], tmp_path: Path, arch: str) -> None:
    reference.require_or_skip(reference.reference_available())
    qwen3, drafter = qwen2_vocab_pair
    target = _relabelled(qwen3, tmp_path / arch / "qwen3-tiny", arch)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, target, ours)
    run = reference.run_reference_convert(drafter, target, ref)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append(f"gpt2-path-drafter/{arch}")


@pytest.mark.reference
def test_a_qwen3_moe_target_converts_where_b11434_stops(qwen2_vocab_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """b11434's Qwen3MoeModel.set_vocab calls super() on a drafter's converter object and stops with TypeError.
    Ours writes what that call's GPT-2 path writes: b11434's own bytes for the same tokenizer under a target
    class that reaches the path (Qwen3-Next), and a note saying so."""
    reference.require_or_skip(reference.reference_available())
    qwen3, drafter = qwen2_vocab_pair
    target = _relabelled(qwen3, tmp_path / "moe" / "qwen3-tiny", "Qwen3MoeForCausalLM")
    run = reference.run_reference_convert(drafter, target, tmp_path / "none.gguf")
    assert run.returncode != 0 and "TypeError: super(type, obj)" in run.stderr, run.stderr[-2000:]
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = convert_drafter(drafter, target, ours)
    same_path = _relabelled(qwen3, tmp_path / "next" / "qwen3-tiny", "Qwen3NextForCausalLM")
    assert reference.run_reference_convert(drafter, same_path, ref).returncode == 0
    assert diff(ours, ref) == []
    assert any("Qwen3MoeModel.set_vocab" in n for n in result.notes)
    assert any("Qwen3MoeModel.set_vocab" in n for n in read_gguf(ours).get("dflash_gguf.notes"))
    REFERENCE_COMPARISONS.append("qwen3moe-drafter (b11434 stops)")


# --------------------------------------------------------------------------------------- one verdict

# A target class b11434 converts a drafter for (Qwen2MoeModel inherits TextModel.set_vocab), but whose path the
# rows of dflash_gguf.convert.targets do not vouch for: every command must say so the same way.
NOT_COVERED = "Qwen2MoeForCausalLM"


@pytest.mark.parametrize("arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                  NOT_COVERED])
def test_precheck_outfile_and_pipeline_agree(targets: dict[str, Path], tmp_path: Path, arch: str) -> None:
    base = targets["moe" if "Moe" in arch else "dense"]
    target = _relabelled(base, tmp_path / "target", arch)
    drafter = mf.make_drafter(tmp_path, target="qwen35")
    outfile = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", tmp_path / "d.gguf")
    # the text pair (the fixture's vision config has no processor config: its projector is judged below)
    pipeline = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", tmp_path / "pair",
                       "--dry-run", "--no-mmproj")
    precheck = run_cli("dflash-gguf", "precheck", drafter, target, "--json", "--no-mmproj")
    checks = {c["id"]: c for c in json.loads(precheck.stdout)["checks"]}
    if arch == NOT_COVERED:
        assert outfile.returncode == pipeline.returncode == 18, (outfile.stderr, pipeline.stderr)
        assert precheck.returncode == 1 and checks["pair.target_vocab"]["status"] == "fail"
        words = checks["pair.target_vocab"]["message"].split(": ", 1)[1][:80]
        assert words in outfile.stderr and words in pipeline.stderr
        assert "--llama-cpp DIR" in outfile.stderr and "--target-model-dir" in outfile.stderr
    else:
        assert outfile.returncode == 0, outfile.stderr
        assert pipeline.returncode == 0, pipeline.stderr
        assert precheck.returncode == 0 and checks["pair.target_vocab"]["status"] == "pass", precheck.stdout
        # with its projector, which no processor config lets be made: one refusal, one code, from the configs
        with_projector = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir",
                                 tmp_path / "pair", "--dry-run")
        judged = run_cli("dflash-gguf", "precheck", drafter, target)
        assert with_projector.returncode == judged.returncode == ConfigError.exit_code, judged.stderr
        assert "image_mean" in with_projector.stderr and "image_mean" in judged.stderr
    assert not (tmp_path / "pair").exists()


def test_a_drafter_that_cannot_be_converted_stops_before_the_target_gguf_is_touched(tmp_path: Path) -> None:
    """--target-gguf with an unquantized target: the run would quantize it first. A target tokenizer the drafter
    converter refuses must stop the run before that, with nothing in the output folder."""
    target = mf.make_gemma4_target(tmp_path / "t")
    gguf = tmp_path / "gemma-4-tiny-it-BF16.gguf"
    assert run_cli("dflash-gguf", "convert-target", target, "--outfile", gguf).returncode == 0
    tj = json.loads((target / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = False  # not the tokenizer b11434's Gemma-4 path reads
    (target / "tokenizer.json").write_text(json.dumps(tj))
    before = gguf.stat().st_mtime_ns
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--target-gguf", gguf, "--outdir", outdir)
    assert run.returncode == 7, run.stdout + run.stderr
    assert "must be BPE with byte_fallback" in run.stderr
    assert not list(outdir.glob("*.gguf")) and gguf.stat().st_mtime_ns == before
    assert "target.quantize" not in json.loads((outdir / "pair.json").read_text()).get("stages", {})


@pytest.mark.reference
def test_llama_cpp_converts_the_drafter_of_a_target_we_do_not_mirror(tmp_path: Path) -> None:
    """--llama-cpp DIR: llama.cpp's converter makes the drafter (``--target-model-dir``) when our vocabulary path
    does not cover the target; the file is b11434's own, and verify takes the pair."""
    reference.require_or_skip(reference.reference_available())
    src = llama_cpp_src()
    qwen3 = mf.make_qwen3_target(tmp_path / "t", llama_cpp_src=src)
    gguf = tmp_path / "qwen3-tiny-BF16.gguf"
    assert run_cli("dflash-gguf", "convert-target", qwen3, "--outfile", gguf).returncode == 0
    target = _relabelled(qwen3, tmp_path / "relabelled" / "qwen3-tiny", NOT_COVERED)
    drafter = mf.make_drafter(tmp_path / "d", target="qwen3")
    env = {"LLAMA_CPP_PYTHON": str(reference.env.venv_python(reference.env.ref_venv_dir()))}
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--target-gguf", gguf, "--outdir", outdir,
                  "--llama-cpp", reference.env.llama_cpp_src(), "--draft-quant", "bf16", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["options"]["drafter_method"] == "llama-cpp" and manifest["verify"]["servable"] is True
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, target, ref, "bf16").returncode == 0
    ours = outdir / manifest["outputs"]["drafter"]["file"]
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("pipeline/llama-cpp-drafter")


# ----------------------------------------------------------------------------------------- served by b11434


@pytest.mark.reference
@pytest.mark.parametrize("target", ["dense", "moe"])
def test_llama_server_serves_the_qwen35_pair_and_drafts(targets: dict[str, Path], tmp_path: Path, target: str) -> None:
    """The pipeline from local folders (the built-in target converter, one pass to q4_0), then b11434's
    llama-server on the pair: it loads the hybrid target with its MTP layer, infers nothing, and drafts."""
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = mf.make_drafter(tmp_path / "d", target="qwen35")
    outdir = tmp_path / "pair"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", targets[target], "--outdir", outdir,
                  # --no-mmproj: the fixture keeps a few of the release's vision tensors, no whole tower
                  "--quant", "q4_0", "--no-mmproj")
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["verify"]["servable"] is True and manifest["options"]["target_method"] == "builtin"
    files = manifest["outputs"]
    with reference.start_llama_server(outdir / files["target"]["file"], outdir / files["drafter"]["file"],
                                      n_max=4) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200, body
    assert isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    REFERENCE_COMPARISONS.append(f"llama-server/qwen35-pair/{target}")


def test_verify_flags_a_drafter_without_the_m_rope_sections(targets: dict[str, Path], tmp_path: Path) -> None:
    """A drafter GGUF of an M-RoPE target made before the converter wrote dflash.rope.dimension_sections (late
    August 2026) is roped with plain positions by llama.cpp: verify names it. Such a file is made here the way the
    older converter made it, by our own file with that one key removed (gguf-py's gguf-new-metadata)."""
    from dflash_gguf.convert.targets import convert_target
    from dflash_gguf.verify import verify_files

    target = tmp_path / "t.gguf"
    convert_target(targets["dense"], target, "bf16")
    fresh, stale = tmp_path / "fresh.gguf", tmp_path / "stale.gguf"
    convert_drafter(mf.make_drafter(tmp_path, target="qwen35"), targets["dense"], fresh)
    subprocess.run([str(BIN / "gguf-new-metadata"), "--force", "--remove-metadata", "dflash.rope.dimension_sections",
                    str(fresh), str(stale)], check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    assert read_gguf(stale).get("dflash.rope.dimension_sections") is None
    checks = {c["id"]: c for c in verify_files(stale, target).to_dict()["checks"]}
    assert checks["pair.mrope"]["status"] == "fail" and checks["pair.mrope"]["severity"] == "warning", checks
    assert "before late August 2026" in checks["pair.mrope"]["message"] and "Reconvert" in checks["pair.mrope"]["fix"]
    ok = {c["id"]: c for c in verify_files(fresh, target).to_dict()["checks"]}["pair.mrope"]
    assert ok["status"] == "pass" and "[8, 0, 0, 0]" in ok["message"], ok
