"""End to end with real llama.cpp b11434: llama-server serves our drafter beside a target GGUF, and
dflash-verify's verdict matches what llama.cpp does (or silently fails to notice)."""

from __future__ import annotations

import shutil
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli

from dflash_gguf.drafters import convert_drafter


@pytest.fixture(scope="module")
def qwen_pair(targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target dir, target GGUF by b11434's converter, our drafter GGUF converted against that target)."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    if "qwen3" not in targets:
        reference.require_or_skip("the Qwen fixture needs the llama.cpp b11434 sdist")
    work = tmp_path_factory.mktemp("serve")
    target_gguf = work / "qwen3-tiny-BF16.gguf"
    proc = reference.run_reference_convert(targets["qwen3"], None, target_gguf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drafter = mf.make_drafter(work, target="qwen3")
    drafter_gguf = work / "qwen3-tiny-DFlash-BF16.gguf"
    convert_drafter(drafter, targets["qwen3"], drafter_gguf)
    return targets["qwen3"], target_gguf, drafter_gguf


def _serve_and_complete(target: Path, drafter: Path) -> tuple[dict, str]:
    with reference.start_llama_server(target, drafter, n_max=15) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion",
                                           {"prompt": "hello world", "n_predict": 16, "temperature": 0})
        assert status == 200, body
    assert isinstance(body, dict)
    return body["timings"], server.output


@pytest.mark.reference
def test_llama_server_drafts_with_our_drafter(qwen_pair: tuple[Path, Path, Path]) -> None:
    _, target_gguf, drafter_gguf = qwen_pair
    timings, log = _serve_and_complete(target_gguf, drafter_gguf)
    assert timings["draft_n"] > 0  # the drafter ran (random weights: nothing is accepted)
    assert "block_size=16, mask_token_id=151669, n_extract=2" in log
    verdict = run_cli("dflash-verify", str(drafter_gguf), str(target_gguf))
    assert verdict.returncode == 0, verdict.stdout
    assert "lineage.fingerprint" in verdict.stdout and "mean row cosine 1.0000" in verdict.stdout
    REFERENCE_COMPARISONS.append("llama-server/qwen3-pair")


@pytest.mark.reference
def test_verify_catches_a_retrained_target_llama_cpp_serves_silently(qwen_pair: tuple[Path, Path, Path],
                                                                     tmp_path: Path) -> None:
    """Same config and tokenizer, other weights (a re-trained target): llama.cpp serves the pair without a
    word; verify refuses it from the embedding fingerprint recorded at conversion."""
    target_dir, _, drafter_gguf = qwen_pair
    retrained = Path(shutil.copytree(target_dir, tmp_path / "qwen3-tiny"))
    rng = np.random.default_rng(7)
    entries = mf.read_safetensors_raw(retrained / "model.safetensors")
    tensors = {}
    for name, _dtype, shape, raw in entries:
        widened = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        tensors[name] = rng.normal(0, 0.02, shape).astype(np.float32) if "embed_tokens" in name else widened
    mf.write_safetensors(retrained / "model.safetensors", tensors)
    target_gguf = tmp_path / "retrained-BF16.gguf"
    assert reference.run_reference_convert(retrained, None, target_gguf).returncode == 0
    timings, _ = _serve_and_complete(target_gguf, drafter_gguf)
    assert timings["draft_n"] > 0  # served and drafting: llama.cpp has no check that notices
    verdict = run_cli("dflash-verify", str(drafter_gguf), str(target_gguf), "--json")
    assert verdict.returncode == 1, verdict.stdout
    assert '"id": "lineage.fingerprint"' in verdict.stdout and "a different model" in verdict.stdout
    REFERENCE_COMPARISONS.append("llama-server/retrained-target")


@pytest.fixture(scope="module")
def gemma_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gemma-4 vanilla and QAT target GGUFs by b11434's converter, and our drafter for the vanilla one."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    work = tmp_path_factory.mktemp("gemma-serve")
    out: dict[str, Path] = {}
    for key, qat in (("vanilla", False), ("qat", True)):
        target_dir = mf.make_gemma4_target(work / key, qat=qat)
        gguf_path = work / f"{target_dir.name}-BF16.gguf"
        proc = reference.run_reference_convert(target_dir, None, gguf_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[key], out[f"{key}_dir"] = gguf_path, target_dir
    drafter = mf.make_drafter(work, target="gemma4")
    out["drafter"] = work / "gemma4-tiny-it-DFlash-BF16.gguf"
    convert_drafter(drafter, out["vanilla_dir"], out["drafter"])
    return out


@pytest.mark.reference
def test_gemma4_pair_serves_and_verifies(gemma_targets: dict[str, Path]) -> None:
    timings, log = _serve_and_complete(gemma_targets["vanilla"], gemma_targets["drafter"])
    assert timings["draft_n"] > 0
    assert "block_size=16, mask_token_id=4, n_extract=2" in log
    verdict = run_cli("dflash-verify", str(gemma_targets["drafter"]), str(gemma_targets["vanilla"]))
    assert verdict.returncode == 0, verdict.stdout
    REFERENCE_COMPARISONS.append("llama-server/gemma4-pair")


@pytest.mark.reference
def test_qat_target_served_silently_but_refused_by_verify(gemma_targets: dict[str, Path]) -> None:
    """The field report: a vanilla-trained drafter with the QAT target loads and drafts without a word
    from llama.cpp; dflash-verify names the problem (exit 1) unless --allow-derived-target."""
    timings, _ = _serve_and_complete(gemma_targets["qat"], gemma_targets["drafter"])
    assert timings["draft_n"] > 0
    verdict = run_cli("dflash-verify", str(gemma_targets["drafter"]), str(gemma_targets["qat"]), "--json")
    assert verdict.returncode == 1, verdict.stdout
    assert '"id": "lineage.derived_target"' in verdict.stdout
    allowed = run_cli("dflash-verify", str(gemma_targets["drafter"]), str(gemma_targets["qat"]),
                              "--allow-derived-target")
    assert "allowed by --allow-derived-target" in allowed.stdout
    REFERENCE_COMPARISONS.append("llama-server/qat-target")
