"""Targets llama.cpp b11434 cannot tap: z-lab publishes DFlash drafters for GLM-5.1 and Kimi-K2.6, but b11434's
graphs for GLM and DeepSeek-V2/V3 never publish the layer inputs a drafter reads, so a pair aborts at its first
draft. Every command says so (exit 4), instead of pointing at llama.cpp's converter, which would make files that
cannot run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import llama_cpp_src, run_cli

from dflash_gguf.target_archs import by_hf

UNTAPPABLE = {  # Hugging Face class -> the b11434 graph it is converted to
    "Glm4MoeForCausalLM": "glm4-moe.cpp",  # GLM-4.5 / 4.6
    "GlmMoeDsaForCausalLM": "glm-dsa.cpp",  # GLM-5.1
    "Glm4MoeLiteForCausalLM": "deepseek2.cpp",  # GLM-4.7-Flash
    "DeepseekV3ForCausalLM": "deepseek2.cpp",  # DeepSeek-V3, Kimi-K2
    "KimiK25ForConditionalGeneration": "deepseek2.cpp",  # Kimi-K2.5 / K2.6
}


@pytest.mark.parametrize("hf_class", list(UNTAPPABLE))
def test_b11434s_graph_for_it_publishes_no_layer_inputs(hf_class: str) -> None:
    """The table's verdict read from the b11434 source: the graph never sets t_layer_inp."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    arch = by_hf(hf_class)
    assert arch is not None and arch.tappable is False, hf_class
    graph = (llama_cpp_src() / "src" / "models" / UNTAPPABLE[hf_class]).read_text(encoding="utf-8")
    assert "t_layer_inp" not in graph
    assert "t_layer_inp" in (llama_cpp_src() / "src" / "models" / "qwen3.cpp").read_text(encoding="utf-8")


@pytest.mark.parametrize("hf_class", ["Glm4MoeForCausalLM", "KimiK25ForConditionalGeneration"])
def test_every_command_refuses_a_target_no_drafter_can_run_on(tmp_path: Path, hf_class: str) -> None:
    target = Path(shutil.copytree(mf.make_gemma4_target(tmp_path / "t"), tmp_path / "glm-tiny"))
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": [hf_class]}))
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    pre = run_cli("dflash-gguf", "precheck", drafter, target)
    outfile = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", tmp_path / "d.gguf")
    pipe = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outdir", tmp_path / "pair")
    for run in (pre, outfile, pipe):
        out = " ".join((run.stdout + run.stderr).split())  # the report wraps its lines
        assert "publishes no layer inputs" in out and "Traceback" not in out, out[-2000:]
        assert "--llama-cpp" not in out, out[-2000:]  # not the way out: llama.cpp would make a pair that aborts
    assert outfile.returncode == pipe.returncode == 4, (outfile.returncode, pipe.returncode)
    assert pre.returncode != 0
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "pair").exists()
