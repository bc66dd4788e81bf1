"""Gemma-4 DSpark drafters (``Gemma4DSparkModel``, deepseek-ai/dspark_gemma4_12b_block7's layout): the bytes of
b11434's converter (global attention geometry, GELU, the generated ``rope_freqs``, the renamed Gemma norms, its own
``lm_head``), one pass, verify, the refusals that stand in for its converter's errors, llama-server b11434 drafting
with the pair, and the pipeline from the loopback Hub."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.drafters import DSPARK_BLOCK_SIZE, make_gemma4_dspark_drafter
from gguf_compare import diff

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.pipeline.serve import serve_plan
from dflash_gguf.sidecar import drafter_kind_of_checkpoint
from dflash_gguf.verify import verify_files

BIN = Path(sys.executable).parent
SERVABLE = {"final_logit_softcapping": None}  # the published config's softcap is what b11434 refuses


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma4-dspark")


@pytest.fixture(scope="module")
def gemma4(work: Path) -> Path:
    return mf.make_gemma4_target(work / "targets")


@pytest.fixture(scope="module")
def target_gguf(gemma4: Path, work: Path) -> Path:
    out = work / "t.gguf"
    convert_target(gemma4, out, quant="q4_0")
    return out


def _drafter(dir: Path, *, config_overrides: dict[str, Any] | None = None, **options: Any) -> Path:
    return make_gemma4_dspark_drafter(dir, config_overrides={**SERVABLE, **(config_overrides or {})}, **options)


# (case, fixture options): the published layout (confidence head, proportional rope, untied), the confidence head
# under the confidence_proj name, tied embeddings without a confidence head, a default rope (no rope_freqs) and a
# config without rope_parameters (Gemma4TextConfig's default rope).
CASES: dict[str, dict[str, Any]] = {
    "published": {},
    "confidence_proj": {"confidence": "proj"},
    "tied_no_confidence": {"tied": True, "confidence": "none"},
    "default_rope": {"rope": "default"},
    "no_rope_parameters": {"rope": "absent"},
}


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("case", "outtype"), [("published", "auto"), ("confidence_proj", "q8_0"),
                                               ("tied_no_confidence", "bf16"), ("default_rope", "f16"),
                                               ("no_rope_parameters", "auto")])
def test_gemma4_dspark_matches_b11434(gemma4: Path, tmp_path: Path, case: str, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = _drafter(tmp_path, **CASES[case])
    if case == "published":  # b11434's Gemma4DSparkModel never opens it; neither do we
        (drafter / "mask_embedding.pt").write_bytes(b"not read by either converter")
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    result = convert_drafter(drafter, gemma4, ours, outtype)
    run = reference.run_reference_convert(drafter, gemma4, ref, outtype)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    assert meta.get("dflash.hidden_activation") == "gelu_pytorch_tanh" and meta.get("dflash.attention.scale") == 1.0
    assert meta.get("dflash.attention.head_count_kv") == mf.SIZES["global_kv_heads"]
    assert meta.get("dflash.attention.key_length") == mf.SIZES["global_head_dim"]
    assert meta.get("dflash.has_confidence_head") is (CASES[case].get("confidence", "head") != "none")
    assert ("output.weight" in meta.tensors) is not CASES[case].get("tied", False)  # kept: a DFlashModel subclass
    assert "blk.0.post_attention_norm.weight" in meta.tensors and "blk.0.layer_output_scale.weight" in meta.tensors
    proportional = CASES[case].get("rope") != "default"
    assert ("rope_freqs.weight" in meta.tensors) is proportional
    if proportional:  # a quarter of the 32-dim global head rotates: 4 of 16 pairs, the rest never (1e30)
        with open(ours, "rb") as f:
            f.seek(meta.data_offset + meta.tensors["rope_freqs.weight"].offset)
            factors = np.frombuffer(f.read(16 * 4), dtype="<f4")
        assert np.array_equal(factors, np.array([1.0] * 4 + [1e30] * 12, dtype=np.float32)), factors
    if case == "published":
        assert any("mask_embedding.pt ignored" in n for n in result.notes), result.notes
    REFERENCE_COMPARISONS.append(f"dspark-gemma4/{case}/{outtype}")


@pytest.mark.reference
def test_gemma4_dspark_one_pass_q4_0_is_convert_then_llama_quantize(gemma4: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.require_or_skip(reference.reference_available())
    drafter = _drafter(tmp_path)
    ours, ref_bf16, ref = tmp_path / "ours.gguf", tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, gemma4, ours, quant="q4_0")
    assert reference.run_reference_convert(drafter, gemma4, ref_bf16, "bf16").returncode == 0
    assert reference.run_llama_quantize(ref_bf16, ref, "q4_0").returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("dspark-gemma4/one-pass-q4_0")


# -------------------------------------------------------------------------------------------- refusals

# (case, fixture options, exit code, words of the message, whether the config alone refuses it, so precheck does)
REFUSALS: list[tuple[str, dict[str, Any], int, list[str], bool]] = [
    ("softcapping", {"config_overrides": {"final_logit_softcapping": 30.0}}, 4,
     ["Gemma4 DSpark logit softcapping is not supported", "never applies a softcap", "Markov head adds its bias"],
     True),
    ("k_ne_v", {"config_overrides": {"attention_k_eq_v": False}}, 4,
     ["Gemma4 DSpark currently requires attention_k_eq_v"], True),
    ("sliding_layers", {"config_overrides": {"layer_types": ["sliding_attention", "full_attention"]}}, 4,
     ["Gemma4 DSpark currently requires uniform full_attention layer types"], True),
    ("gated_markov", {"config_overrides": {"markov_head_type": "gated"}}, 4,
     ["Gemma4 DSpark currently requires a vanilla Markov head"], True),
    ("yarn_rope", {"config_overrides": {"rope_parameters.full_attention.rope_type": "yarn"}}, 4,
     ["Gemma4 DSpark requires default or proportional RoPE"], True),
    ("swa_window", {"config_overrides": {"dflash_config.use_swa": True, "dflash_config.swa_window_size": 0}}, 4,
     ["Gemma4 DSpark swa_window_size must be positive"], True),
    ("odd_rotary", {"config_overrides": {"rope_parameters.full_attention.partial_rotary_factor": 0.3}}, 3,
     ["Gemma4 DSpark rotary dimension count must be positive and even"], True),
    ("no_global_head_dim", {"drop_config_keys": ["global_head_dim"]}, 3,
     ["global_head_dim", "KeyError"], True),
    ("untied_without_lm_head", {"tied": True, "config_overrides": {"tie_word_embeddings": False}}, 5,
     ["Gemma4 DSpark requires lm_head.weight unless tie_word_embeddings is true"], False),
    ("d2t", {"extra_tensors": {"d2t": np.zeros(mf.SIZES["vocab"], dtype=np.int64)}}, 4,
     ["reduced draft vocabulary map", "Can not map tensor"], False),
]


@pytest.mark.parametrize(("case", "options", "code", "words", "config_level"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_before_writing(gemma4: Path, tmp_path: Path, case: str, options: dict, code: int,
                                 words: list[str], config_level: bool) -> None:
    drafter = _drafter(tmp_path, **options)
    out = tmp_path / "d.gguf"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", gemma4, "--outfile", out)
    assert run.returncode == code, run.stderr
    assert all(w in run.stderr for w in words), run.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    precheck = run_cli("dflash-gguf", "precheck", drafter, gemma4, "--json")  # the same rule, before any download
    refused = [c for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail" and c["severity"] == "error"]
    if config_level:
        assert precheck.returncode == 1 and refused[0]["id"] == "format.dspark", refused
        assert refused[0]["message"].split(" ", 1)[1][:60] in run.stderr
    else:
        assert not refused, refused


@pytest.mark.reference
def test_b11434_refuses_what_we_refuse(gemma4: Path, tmp_path: Path) -> None:
    """The quoted errors are b11434's own: its converter stops on the same checkpoints with those words."""
    reference.require_or_skip(reference.reference_available())
    quoted = {"softcapping": "logit softcapping is not supported", "odd_rotary": "must be positive and even",
              "swa_window": "swa_window_size must be positive", "untied_without_lm_head": "requires lm_head.weight",
              "no_global_head_dim": "KeyError"}
    for case, options, *_ in REFUSALS:
        if case not in quoted:
            continue
        drafter = _drafter(tmp_path / case, **options)
        run = reference.run_reference_convert(drafter, gemma4, tmp_path / f"{case}.gguf")
        assert run.returncode != 0 and quoted[case] in run.stderr, (case, run.stderr[-2000:])
    REFERENCE_COMPARISONS.append("dspark-gemma4/refusals")


# ------------------------------------------------------------------------------------ verify, serve


def test_verify_and_serve_plan(gemma4: Path, target_gguf: Path, tmp_path: Path) -> None:
    drafter = tmp_path / "d.gguf"
    convert_drafter(_drafter(tmp_path, tied=True, confidence="none"), gemma4, drafter)
    checks = {c["id"]: c for c in verify_files(drafter, target_gguf).to_dict()["checks"]}
    failed = {cid: c["message"] for cid, c in checks.items() if c["status"] == "fail"}
    assert not failed, failed
    assert "DSpark set" in checks["format.tensors"]["message"] and checks["format.shapes"]["status"] == "pass"
    assert checks["pair.embedding_scale"]["status"] == "pass"
    message = checks["format.dspark"]["message"]
    assert "draft-dspark" in message and "--spec-draft-p-min 0" in message and f"N <= {DSPARK_BLOCK_SIZE}" in message
    plan = serve_plan(target_gguf, drafter)
    assert plan.command[plan.command.index("--spec-type") + 1] == "draft-dspark"
    assert plan.command[-2:] == ("--spec-draft-p-min", "0")


@pytest.mark.reference
@pytest.mark.parametrize("case", ["published", "tied_no_confidence"])
def test_llama_server_serves_the_gemma4_dspark_pair_and_drafts(gemma4: Path, target_gguf: Path, tmp_path: Path,
                                                               case: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "d.gguf"
    convert_drafter(_drafter(tmp_path, **CASES[case]), gemma4, drafter)
    # no --spec-type: llama-server must infer draft-dspark from the file (markov_w1.weight)
    with reference.start_llama_server(target_gguf, None, extra_args=["-md", str(drafter), "--spec-draft-n-max",
                                                                     "16", "--spec-draft-p-min", "0"]) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    assert "auto-detected speculative type 'draft-dspark'" in server.output
    assert f"clamping to {DSPARK_BLOCK_SIZE}" in server.output, server.output[-3000:]  # sample_from_anchor
    REFERENCE_COMPARISONS.append(f"llama-server/dspark-gemma4/{case}")


@pytest.mark.reference
def test_pipeline_makes_a_gemma4_dspark_pair_from_the_loopback_hub(gemma4: Path, tmp_path: Path) -> None:
    """``dflash-convert --target REPO --drafter REPO``: b11434's drafter bytes under the ``dspark-`` sidecar name,
    beside the Gemma-4 target, with a serve command that names draft-dspark."""
    import hub_server
    from hub_server import FakeRepo

    reference.require_or_skip(reference.reference_available())
    drafter = _drafter(tmp_path / "d")
    assert drafter_kind_of_checkpoint(drafter) == "dspark"
    files = lambda d: FakeRepo({p.name: p.read_bytes() for p in d.iterdir() if p.is_file()})  # noqa: E731
    repos = {"deepseek-ai/dspark_gemma4_tiny_block7": files(drafter), "google/gemma-4-tiny-it": files(gemma4)}
    outdir = tmp_path / "pair"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"LLAMA_QUANTIZE": ""}
        run = subprocess.run([str(BIN / "dflash-convert"), "--target", "google/gemma-4-tiny-it", "--drafter",
                              "deepseek-ai/dspark_gemma4_tiny_block7", "--outdir", str(outdir), "--draft-quant",
                              "bf16"], capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["status"] == "complete" and manifest["verify"]["servable"] is True
    name = manifest["outputs"]["drafter"]["file"]
    assert name.startswith("dspark-") and name.endswith("-BF16.gguf"), name
    assert "--spec-type draft-dspark" in manifest["serve"]["with_drafter"]
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, gemma4, ref, "bf16").returncode == 0
    assert diff(outdir / name, ref) == []
    REFERENCE_COMPARISONS.append("pipeline/loopback-hub/dspark-gemma4")
