"""DFlash2 drafters (z-lab/Qwen3.8-27B-DFlash2 in miniature): the conv/selector keys and tensors b11434 writes,
``mask_embedding.pt`` read without torch and without running anything, the loader's refusals before writing, and
llama-server b11434 drafting with the pair."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, llama_cpp_src, run_cli
from fixtures.drafters import make_dflash2_drafter, write_mask_embedding
from gguf_compare import diff

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.verify import verify_files

BIN = Path(sys.executable).parent



def _torch_python() -> Path:
    """Real torch writes the mask_embedding.pt fixtures (the reference converter's venv has it)."""
    reference.require_or_skip(reference.reference_available())
    return reference.env.venv_python(reference.env.ref_venv_dir())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dflash2")


@pytest.fixture(scope="module")
def qwen35(work: Path) -> Path:
    reference.require_or_skip(reference.llama_cpp_src_available())
    return mf.make_qwen35_target(work / "t35", llama_cpp_src=llama_cpp_src())


@pytest.fixture(scope="module")
def qwen3(work: Path) -> Path:
    """A target whose checkpoint names its embeddings model.embed_tokens.weight, as mask_embedding.pt needs."""
    reference.require_or_skip(reference.llama_cpp_src_available())
    return mf.make_qwen3_target(work / "t3", llama_cpp_src=llama_cpp_src())


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize("outtype", ["auto", "q8_0"])
def test_dflash2_matches_b11434(qwen35: Path, tmp_path: Path, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = make_dflash2_drafter(tmp_path)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, qwen35, ours, outtype)
    run = reference.run_reference_convert(drafter, qwen35, ref, outtype)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    assert [meta.get(f"dflash.{k}") for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k", "block_size")] == [2, 16, 8, 4, 8]
    assert meta.tensors["blk.0.attn_conv_base"].qtype == 0  # no ".weight" suffix: F32, as b11434 writes it
    REFERENCE_COMPARISONS.append(f"dflash2/{outtype}")


@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash2_with_mask_embedding_matches_b11434(qwen3: Path, tmp_path: Path, dtype: str) -> None:
    """mask_embedding.pt: the target's output head and its token embeddings, the mask row replaced by the drafter's
    vector (cast to the embeddings' dtype), written first; b11434 reads the file with torch, we without."""
    drafter = make_dflash2_drafter(tmp_path, config_overrides={"num_target_layers": 6})
    write_mask_embedding(drafter, _torch_python(), dtype=dtype)  # type: ignore[arg-type]
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, qwen3, ours)
    run = reference.run_reference_convert(drafter, qwen3, ref)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    assert list(read_gguf(ours).tensors)[:2] == ["output.weight", "token_embd.weight"]
    REFERENCE_COMPARISONS.append(f"dflash2/mask_embedding/{dtype}")


@pytest.mark.reference
def test_dflash2_one_pass_q4_0_is_convert_then_llama_quantize(qwen35: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = make_dflash2_drafter(tmp_path)
    ours, ref_bf16, ref = tmp_path / "ours.gguf", tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, qwen35, ours, quant="q4_0")
    assert reference.run_reference_convert(drafter, qwen35, ref_bf16, "bf16").returncode == 0
    assert reference.run_llama_quantize(ref_bf16, ref, "q4_0").returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("dflash2/one-pass-q4_0")


# -------------------------------------------------------------------------------------------- refusals

# (case, config edits, drops, exit code, words of the message: the llama.cpp failure each one prevents)
REFUSALS = [
    ("no_conv_kernel", {}, ["dflash_config.conv_kernel_size"], 3, ["DFlash2 model is missing conv/selector metadata"]),
    ("partial_keys", {}, ["dflash_config.selector_rank"], 3, ["KeyError", "selector_rank"]),
    ("block_size_zero", {"dflash_config.block_size": 0}, [], 3, ["DFlash2 model is missing conv/selector metadata"]),
    ("group_not_dividing", {"dflash_config.conv_group_size": 24}, [], 3,
     ["DFlash2 hidden size must be divisible by conv_group_size"]),
    ("lattice_too_small", {"dflash_config.selector_top_k": 8}, [], 3,
     ["DFlash2 hidden size is too small for the selector lattice"]),
]


@pytest.mark.parametrize(("case", "edits", "drops", "code", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_before_writing(qwen35: Path, tmp_path: Path, case: str, edits: dict, drops: list[str],
                                 code: int, words: list[str]) -> None:
    drafter = make_dflash2_drafter(tmp_path, config_overrides=edits, drop_config_keys=drops)
    out = tmp_path / "d.gguf"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", qwen35, "--outfile", out)
    assert run.returncode == code, run.stderr
    assert all(w in run.stderr for w in words), run.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    precheck = run_cli("dflash-gguf", "precheck", drafter, qwen35, "--json")  # the same rule, before any download
    refused = [c for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail" and c["severity"] == "error"]
    assert precheck.returncode == 1 and refused[0]["id"] == "format.dflash2", refused


def _hostile_pickle(marker: Path) -> bytes:
    class Evil:
        def __reduce__(self):  # noqa: ANN204 - the attack: pickle.load would call os.system("touch <marker>")
            return (os.system, (f"touch {marker}",))

    return pickle.dumps({"mask_token_id": 151669, "embedding": Evil()}, protocol=2)


def test_a_hostile_mask_embedding_is_refused_and_nothing_runs(qwen3: Path, tmp_path: Path) -> None:
    drafter = make_dflash2_drafter(tmp_path, config_overrides={"num_target_layers": 6})
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", _hostile_pickle(marker))
        z.writestr("archive/byteorder", "little")
    (drafter / "mask_embedding.pt").write_bytes(buf.getvalue())
    out = tmp_path / "d.gguf"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", qwen3, "--outfile", out)
    assert run.returncode == 2, run.stderr
    assert "names posix.system" in run.stderr and "Nothing from the file was run" in run.stderr
    assert not marker.exists() and not out.exists()


def test_a_mask_embedding_for_another_mask_id_is_refused(qwen3: Path, tmp_path: Path) -> None:
    drafter = make_dflash2_drafter(tmp_path, config_overrides={"num_target_layers": 6})
    write_mask_embedding(drafter, _torch_python(), mask_token_id=151670)
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", qwen3, "--outfile", tmp_path / "d.gguf")
    assert run.returncode == 3 and "does not match dflash_config.mask_token_id" in run.stderr, run.stderr


# ------------------------------------------------------------------------------------------ verify, serve


def test_verify_reads_the_dflash2_layout(qwen35: Path, tmp_path: Path) -> None:
    drafter = make_dflash2_drafter(tmp_path)
    out = tmp_path / "d.gguf"
    convert_drafter(drafter, qwen35, out)
    checks = {c["id"]: c for c in verify_files(out).to_dict()["checks"]}
    assert checks["format.dflash2"]["status"] == "pass" and "draft-dflash" in checks["format.dflash2"]["message"]
    assert checks["format.tensors"]["status"] == "pass" and "DFlash2 set" in checks["format.tensors"]["message"]
    assert checks["format.shapes"]["status"] == "pass"


@pytest.mark.reference
def test_llama_server_serves_a_dflash2_pair_and_drafts(qwen35: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter, target = tmp_path / "d.gguf", tmp_path / "t.gguf"
    convert_drafter(make_dflash2_drafter(tmp_path), qwen35, drafter)
    convert_target(qwen35, target, quant="q4_0")
    with reference.start_llama_server(target, drafter, n_max=4) as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    assert "block_size=8, mask_token_id=151669" in server.output  # the DFlash2 drafter, loaded as draft-dflash
    REFERENCE_COMPARISONS.append("llama-server/dflash2")


@pytest.mark.reference
def test_pipeline_makes_a_dflash2_pair_from_the_loopback_hub(qwen3: Path, tmp_path: Path) -> None:
    """``dflash-convert --target REPO --drafter REPO``: the real huggingface_hub client fetches the drafter's
    mask_embedding.pt with its weights (no other pickle), the target's weights before the drafter check that
    needs them, and the pair is b11434's drafter bytes beside a served target."""
    import hub_server
    from hub_server import FakeRepo

    reference.require_or_skip(reference.llama_cpp_available())
    drafter = make_dflash2_drafter(tmp_path / "d", config_overrides={"num_target_layers": 6})
    write_mask_embedding(drafter, _torch_python())
    files = lambda d, extra=None: FakeRepo({p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}  # noqa: E731
                                           | (extra or {}))
    repos = {"z-lab/Qwen3-tiny-DFlash2": files(drafter, {"pytorch_model.bin": b"\0" * 64}),
             "Qwen/Qwen3-tiny": files(qwen3)}
    outdir = tmp_path / "pair"
    with hub_server.serve(repos) as hub:
        env = hub_server.client_env(hub.url, tmp_path / "hf") | {"LLAMA_QUANTIZE": ""}
        run = subprocess.run([str(BIN / "dflash-convert"), "--target", "Qwen/Qwen3-tiny", "--drafter",
                              "z-lab/Qwen3-tiny-DFlash2", "--outdir", str(outdir), "--draft-quant", "bf16"],
                             capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
        fetched = hub.downloads()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mask_embedding.pt" in fetched and "pytorch_model.bin" not in fetched, fetched
    manifest = json.loads((outdir / "pair.json").read_text())
    assert manifest["status"] == "complete" and manifest["verify"]["servable"] is True
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, qwen3, ref, "bf16").returncode == 0
    assert diff(outdir / manifest["outputs"]["drafter"]["file"], ref) == []
    REFERENCE_COMPARISONS.append("pipeline/loopback-hub/dflash2")
