"""Targets llama.cpp b11434 cannot tap: z-lab publishes DFlash drafters for GLM-5.1 and Kimi-K2.6, but b11434's
graphs for GLM and DeepSeek-V2/V3 never publish the layer inputs a drafter reads, so a pair aborts at its first
draft. Every command says so (exit 4), instead of pointing at llama.cpp's converter, which would make files that
cannot run: b11434's own converter makes such a pair from a GLM-4.5 target, and b11434's llama-server aborts on it."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import hub_server
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli
from fixtures.glm import GLM_SIZES

from dflash_gguf.convert.targets import TARGET_ARCHS, TargetArch, by_gguf, by_hf
from dflash_gguf.drafters import check_target_arch
from dflash_gguf.drafters.findings import Report
from dflash_gguf.errors import TuneError
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.tune import TuneOptions, applicable_methods, check_target, plan_tune

# llama-graph.cpp's llm_graph_result::set_outputs, when a drafter asks for the input of a layer the graph never set
LAYER_INP_ASSERT = 'GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null") failed'
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


INSTEAD = {  # the target's own MTP head where b11434 runs it and its converter keeps it, else another runtime
    "Glm4MoeForCausalLM": "llama-server -m TARGET.gguf --spec-type draft-mtp",  # GLM-4.5
    "GlmMoeDsaForCausalLM": "llama-server -m TARGET.gguf --spec-type draft-mtp",  # GLM-5.1
    "KimiK25ForConditionalGeneration": "drops KimiK25ForConditionalGeneration's nextn layers",  # Kimi-K2.6
}


@pytest.mark.parametrize("hf_class", list(INSTEAD))
def test_every_command_refuses_a_target_no_drafter_can_run_on(tmp_path: Path, hf_class: str) -> None:
    """precheck, --outfile and the pipeline from repo ids give one refusal, the pipeline before any weight."""
    target = Path(shutil.copytree(mf.make_gemma4_target(tmp_path / "t"), tmp_path / "glm-tiny"))
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "architectures": [hf_class]}))
    drafter = mf.make_drafter(tmp_path / "d", target="gemma4")
    pre = run_cli("dflash-gguf", "precheck", drafter, target)
    outfile = run_cli("dflash-convert", "--drafter", drafter, "--target", target, "--outfile", tmp_path / "d.gguf")
    repos = {"zai-org/glm-tiny": hub_server.FakeRepo.of_folder(target),
             "z-lab/glm-tiny-DFlash": hub_server.FakeRepo.of_folder(drafter)}
    with hub_server.serve(repos) as hub:
        pipe = subprocess.run([str(Path(sys.executable).parent / "dflash-convert"), "--target", "zai-org/glm-tiny",
                               "--drafter", "z-lab/glm-tiny-DFlash", "--outdir", str(tmp_path / "pair")],
                              capture_output=True, text=True, env=hub_server.client_env(hub.url, tmp_path / "hf"),
                              timeout=600, stdin=subprocess.DEVNULL)
    assert not [f for f in hub.downloads() if f.endswith(".safetensors")], hub.downloads()
    for run in (pre, outfile, pipe):
        out = " ".join((run.stdout + run.stderr).split())  # the report wraps its lines
        assert "publishes no layer inputs" in out and "Traceback" not in out, out[-2000:]
        assert "--llama-cpp" not in out, out[-2000:]  # not the way out: llama.cpp would make a pair that aborts
        assert INSTEAD[hf_class] in out, out[-2000:]  # what does run instead
    assert outfile.returncode == pipe.returncode == 4, (outfile.returncode, pipe.returncode)
    assert pre.returncode != 0
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "pair").exists()


@pytest.mark.reference
def test_b11434s_server_aborts_on_a_glm_pair_its_own_converter_made(tmp_path: Path) -> None:
    """The reason the refusal quotes, shown on b11434 alone: its convert_hf_to_gguf.py converts a GLM-4.5 target
    and a z-lab-style DFlash drafter for it without a word, its llama-server serves the target alone, and with the
    drafter it dies on the first request, on set_outputs' assertion that the layer input the drafter taps is set."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    target = mf.make_glm4moe_target(tmp_path / "t", llama_cpp_src=reference.require_llama_cpp_src())
    drafter = mf.make_drafter(tmp_path / "d", target="qwen3", config_overrides={
        "dflash_config.target_layer_ids": [1, 2], "num_target_layers": GLM_SIZES["layers"]})
    target_gguf, drafter_gguf = tmp_path / "glm-4.5-tiny.gguf", tmp_path / "drafter.gguf"
    for model, its_target, out in ((target, None, target_gguf), (drafter, target, drafter_gguf)):
        proc = reference.run_reference_convert(model, its_target, out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_gguf(target_gguf).get("general.architecture") == "glm4moe"
    assert read_gguf(drafter_gguf).get("general.architecture") == "dflash"
    assert list(read_gguf(drafter_gguf).get("dflash.target_layers")) == [2, 3]  # HF ids + 1, below n_layer 4

    request = {"prompt": "hello world", "n_predict": 8, "temperature": 0, "top_k": 1}
    with reference.start_llama_server(target_gguf, None) as server:  # control: the target itself runs
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", request)
    assert status == 200 and isinstance(body, dict) and body["tokens_predicted"] == 8, body

    with reference.start_llama_server(target_gguf, drafter_gguf, n_max=9) as server:
        assert server.ready, server.output[-3000:]  # b11434 loads the pair and warms it up
        with pytest.raises((ConnectionError, http.client.HTTPException)):  # the process dies under the request
            reference.http_json(server.url + "/completion", request, timeout=120)
        server.wait_exit(30)
    assert server.returncode not in (None, 0), (server.returncode, server.output[-3000:])
    assert LAYER_INP_ASSERT in server.output, server.output[-3000:]
    REFERENCE_COMPARISONS.append("llama-server/glm4moe-dflash-pair-b11434-aborts")


def _b11434_graph_files() -> dict[str, str]:
    """GGUF architecture name -> the src/models/*.cpp file defining the llama_model_* class b11434 builds it with
    (llama-arch.cpp's names, llama-model.cpp's llama_model_mapping switch)."""
    src = llama_cpp_src() / "src"
    enum_of = {name: enum for enum, name in re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}',
                                                      (src / "llama-arch.cpp").read_text(encoding="utf-8"))}
    class_of = dict(re.findall(r"case (LLM_ARCH_\w+):\s*return new (llama_model_\w+)\(params\);",
                               (src / "llama-model.cpp").read_text(encoding="utf-8")))
    file_of = {cls: f.name for f in (src / "models").glob("*.cpp")
               for cls in re.findall(r"(llama_model_\w+)::build_arch_graph", f.read_text(encoding="utf-8"))}
    return {name: file_of[class_of[enum]] for name, enum in enum_of.items()
            if enum in class_of and class_of[enum] in file_of}


@pytest.mark.parametrize("arch", [a for a in TARGET_ARCHS if a.graph], ids=lambda a: a.gguf)
def test_the_tables_graph_columns_are_what_b11434s_source_says(arch: TargetArch) -> None:
    """graph: the file b11434 builds the arch with; tappable: it sets t_layer_inp; mtp_graph: it builds
    LLM_GRAPH_TYPE_DECODER_MTP (the graph --spec-type draft-mtp runs the target's nextn layers with)."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    assert _b11434_graph_files().get(arch.gguf) == arch.graph, arch.gguf
    graph = (llama_cpp_src() / "src" / "models" / str(arch.graph)).read_text(encoding="utf-8")
    if arch.tappable is not None:
        assert arch.tappable == ("t_layer_inp" in graph), arch.gguf
    assert arch.mtp_graph == bool(re.search(r"gtype == LLM_GRAPH_TYPE_DECODER_MTP", graph)), arch.gguf


def test_b11434s_deepseek2_converter_drops_the_nextn_layers_the_table_says() -> None:
    """DeepseekV2Model (DeepSeek-V2/V3, Kimi) skips the MTP layers; Glm4MoeLiteModel (GLM-4.7-Flash), the other
    class converted to deepseek2, keeps them: the refusal offers draft-mtp only for the latter."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    conversion = llama_cpp_src() / "conversion"
    deepseek = (conversion / "deepseek.py").read_text(encoding="utf-8")
    v2 = deepseek[deepseek.index("class DeepseekV2Model(TextModel):"):deepseek.index("class DeepseekV32Model")]
    assert re.search(r"^    skip_mtp = True$", v2, re.M) and "if self.skip_mtp:" in v2
    registered = deepseek[deepseek.rindex("@ModelBase.register(", 0, deepseek.index("class DeepseekV2Model")):
                          deepseek.index("class DeepseekV2Model")]
    arch = by_gguf("deepseek2")
    assert arch is not None and arch.mtp_dropped
    assert all(f'"{hf}"' in registered for hf in arch.mtp_dropped)
    glm = (conversion / "glm.py").read_text(encoding="utf-8")
    lite = glm[glm.index("class Glm4MoeLiteModel(DeepseekV2Model):"):]
    assert re.match(r"class Glm4MoeLiteModel\(DeepseekV2Model\):\n    model_arch = gguf.MODEL_ARCH.DEEPSEEK2\n"
                    r"    skip_mtp = False\n", lite), lite[:200]
    assert "Glm4MoeLiteForCausalLM" in arch.hf and "Glm4MoeLiteForCausalLM" not in arch.mtp_dropped


@pytest.mark.parametrize(("arch", "instead", "not_said"), [
    ("glm4moe", "`llama-server -m TARGET.gguf --spec-type draft-mtp` (b11434's glm4-moe.cpp", "DeepseekV2Model"),
    ("deepseek2", "except DeepseekV2ForCausalLM, DeepseekV3ForCausalLM", "no MTP draft graph"),
    ("gemma3", "another runtime, such as vLLM or SGLang, where z-lab's DFlash drafters run (b11434 has no MTP draft "
               "graph for gemma3)", "draft-mtp"),
])
def test_verify_names_what_serves_a_target_no_drafter_can_tap(arch: str, instead: str, not_said: str) -> None:
    r = Report()
    check_target_arch(r, arch)
    (check,) = r.results
    assert check.status == "fail" and "publishes no layer inputs" in check.message, check
    assert instead in check.fix and not_said not in check.fix and "--llama-cpp" not in check.fix, check.fix


def _target_gguf(path: Path, arch: str, nextn_layers: int) -> Path:
    """A header-only target GGUF: {arch}.nextn_predict_layers and one blk.N.nextn.* tensor, all tune reads."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2 + nextn_layers)
    writer.add_nextn_predict_layers(nextn_layers)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("blk.2.nextn.eh_proj.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tune_offers_the_own_head_only_where_b11434_has_an_mtp_graph_for_it(tmp_path: Path) -> None:
    """nextn layers in a GGUF whose arch b11434 builds no MTP draft graph for are no method; an arch the table does
    not know keeps being trusted."""
    everything = TuneOptions(n_max_values=(2,))
    for arch, offered in (("glm4moe", True), ("qwen35", True), ("qwen3", False), ("gemma3", False),
                          ("not-in-the-table", True)):
        info = check_target(_target_gguf(tmp_path / f"{arch}.gguf", arch, 1))
        assert info.nextn_layers == 1 and info.has_own_mtp is offered, arch
        assert ("mtp" in applicable_methods(info, [], everything)) is offered, arch
    with pytest.raises(TuneError, match="names no method that applies") as e:
        plan_tune(tmp_path / "qwen3.gguf", [], TuneOptions(methods=frozenset({"mtp"})))
    assert ("its own MTP head: none b11434 can run: the GGUF has 1 nextn layer(s), but b11434 has no MTP draft "
            "graph for qwen3") in str(e.value)
