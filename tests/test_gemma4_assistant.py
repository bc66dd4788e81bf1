"""Gemma-4 MTP assistants (``Gemma4AssistantForCausalLM``, google/gemma-4-31B-it-assistant's layout): the bytes of
b11434's converter (``Gemma4AssistantModel``: the Gemma-4 keys plus embedding_length_out and nextn_predict_layers,
the two projections, no K/V), one pass, verify, the refusals and pair checks that stand in for b11434's converter
errors, loader throws and start-up aborts, and llama-server b11434 drafting with --spec-type draft-mtp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fixtures as mf
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.gemma4_assistant import ASSISTANT_LAYERS, make_gemma4_assistant
from gguf_compare import diff

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.drafters.gemma4_assistant import MTP_MAX_N_MAX
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.pipeline.serve import serve_plan
from dflash_gguf.sidecar import drafter_kind, drafter_kind_of_checkpoint, sidecar_name
from dflash_gguf.tune import inspect_drafter
from dflash_gguf.verify import verify_files

ARCH = "gemma4-assistant"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma4-assistant")


@pytest.fixture(scope="module")
def gemma4(work: Path) -> Path:
    return mf.make_gemma4_target(work / "targets")


@pytest.fixture(scope="module")
def target_gguf(gemma4: Path, work: Path) -> Path:
    out = work / "t.gguf"
    convert_target(gemma4, out, quant="q4_0")
    return out


CASES: dict[str, dict[str, Any]] = {
    "published": {},
    "masked_embedding": {"masked": True},  # E2B/E4B: masked_embedding.* dropped by both converters
    "unified": {"config_overrides": {"architectures": ["Gemma4UnifiedAssistantForCausalLM"]}},
}


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize(("case", "outtype"), [("published", "bf16"), ("published", "q8_0"), ("published", "auto"),
                                               ("masked_embedding", "auto"), ("unified", "bf16")])
def test_gemma4_assistant_matches_b11434(gemma4: Path, tmp_path: Path, case: str, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    assistant = make_gemma4_assistant(tmp_path, **CASES[case])
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(assistant, gemma4, ours, outtype)
    run = reference.run_reference_convert(assistant, None, ref, outtype)  # b11434 takes no --target-model-dir
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    assert meta.arch == ARCH
    assert meta.get(f"{ARCH}.embedding_length_out") == mf.SIZES["hidden"]
    assert meta.get(f"{ARCH}.nextn_predict_layers") == ASSISTANT_LAYERS
    assert meta.tensors["nextn.pre_projection.weight"].ne == (2 * mf.SIZES["hidden"], 32)
    assert meta.tensors["nextn.post_projection.weight"].ne == (32, mf.SIZES["hidden"])
    assert not any(n.endswith(("attn_k.weight", "attn_v.weight")) or n.startswith("masked") for n in meta.tensors)
    REFERENCE_COMPARISONS.append(f"gemma4-assistant/{case}/{outtype}")


@pytest.mark.reference
def test_gemma4_assistant_one_pass_q4_0_is_convert_then_llama_quantize(gemma4: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.require_or_skip(reference.reference_available())
    assistant = make_gemma4_assistant(tmp_path)
    ours, ref_bf16, ref = tmp_path / "ours.gguf", tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf"
    convert_drafter(assistant, gemma4, ours, quant="q4_0")
    assert reference.run_reference_convert(assistant, None, ref_bf16, "bf16").returncode == 0
    assert reference.run_llama_quantize(ref_bf16, ref, "q4_0").returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("gemma4-assistant/one-pass-q4_0")


def test_cli_dry_run_and_one_pass(gemma4: Path, tmp_path: Path) -> None:
    assistant = make_gemma4_assistant(tmp_path)
    out = tmp_path / "a.gguf"
    run = run_cli("dflash-convert", "--drafter", assistant, "--target", gemma4, "--outfile", out, "--dry-run")
    assert run.returncode == 0 and not out.exists(), run.stderr
    run = run_cli("dflash-convert", "--drafter", assistant, "--target", gemma4, "--outfile", out, "--quant", "q8_0")
    assert run.returncode == 0, run.stderr
    assert read_gguf(out).arch == ARCH


# -------------------------------------------------------------------------------------------- refusals

# (case, fixture options, exit code, words of the message, the precheck check that fails, or None when the
# configs alone cannot tell)
REFUSALS: list[tuple[str, dict[str, Any], int, list[str], str | None]] = [
    ("no_sliding_layer", {"config_overrides": {"text_config.layer_types": ["full_attention"] * ASSISTANT_LAYERS}},
     4, ["GGML_ASSERT(hparams.is_swa_any())"], "format.assistant"),
    ("no_full_layer", {"config_overrides": {"text_config.layer_types": ["sliding_attention"] * ASSISTANT_LAYERS}},
     4, ["rope_freqs", "wrong number of tensors"], "format.assistant"),
    ("no_backbone_hidden_size", {"drop_config_keys": ["backbone_hidden_size"]}, 3,
     ["backbone_hidden_size", "KeyError"], "format.assistant"),
    ("hidden_equals_backbone", {"config_overrides": {"text_config.hidden_size": mf.SIZES["hidden"]}}, 4,
     ["requires embedding_length_out to carry the target hidden size"], "format.assistant"),
    ("other_backbone", {"config_overrides": {"backbone_hidden_size": 48}}, 6, ["ggml_can_mul_mat"],
     "pair.assistant_backbone"),
    ("other_head_dim", {"config_overrides": {"text_config.head_dim": 32}}, 6, ["head_dim 32", "K cache"],
     "pair.assistant_head_dim"),
    ("other_global_head_dim", {"config_overrides": {"text_config.global_head_dim": 16}}, 6,
     ["global_head_dim 16", "K cache"], "pair.assistant_head_dim"),
    ("other_kv_heads", {"config_overrides": {"text_config.num_key_value_heads": 4}}, 6,
     ["num_key_value_heads 4", "without a word"], "pair.assistant_kv_heads"),
    ("no_tokenizer", {"tokenizer": False}, 7, ["no tokenizer.json", "never looks at the target's"], None),
    ("untied_lm_head", {"untied": True}, 5, ["lm_head.weight"], None),
]


@pytest.mark.parametrize(("case", "options", "code", "words", "check"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_before_writing(gemma4: Path, tmp_path: Path, case: str, options: dict, code: int,
                                 words: list[str], check: str | None) -> None:
    assistant = make_gemma4_assistant(tmp_path, **options)
    out = tmp_path / "a.gguf"
    run = run_cli("dflash-convert", "--drafter", assistant, "--target", gemma4, "--outfile", out)
    assert run.returncode == code, run.stderr
    assert all(w in run.stderr for w in words), run.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    precheck = run_cli("dflash-gguf", "precheck", assistant, gemma4, "--json")  # the same rule, from configs
    refused = [c for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail" and c["severity"] == "error"]
    if check is None:
        assert not refused, refused
    else:
        assert precheck.returncode == 1 and refused[0]["id"] == check, refused


def test_other_tokenizer_is_a_pair_error(gemma4: Path, tmp_path: Path) -> None:
    """The assistant writes its own tokenizer; one that is not the target's is refused (and precheck, with both
    folders at hand, says so under the same id)."""
    assistant = make_gemma4_assistant(tmp_path)
    tj = json.loads((assistant / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tj["model"]["vocab"]
    last = max(vocab, key=vocab.__getitem__)
    vocab["<other>"] = vocab.pop(last)  # one piece renamed: another vocabulary of the same size
    (assistant / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    out = tmp_path / "a.gguf"
    run = run_cli("dflash-convert", "--drafter", assistant, "--target", gemma4, "--outfile", out)
    assert run.returncode == 6 and "does not define the same vocabulary" in run.stderr, run.stderr
    assert not out.exists()
    precheck = run_cli("dflash-gguf", "precheck", assistant, gemma4, "--json")
    refused = [c["id"] for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail"
               and c["severity"] == "error"]
    assert refused == ["pair.assistant_tokenizer"], refused


@pytest.mark.reference
def test_b11434_fails_where_we_refuse(gemma4: Path, target_gguf: Path, tmp_path: Path) -> None:
    """Each refusal stands for a b11434 failure: its converter's error, its loader's, or llama-server's abort."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    options = {case: opts for case, opts, *_ in REFUSALS}

    def ref_convert(case: str) -> tuple[Path, str, int]:
        assistant = make_gemma4_assistant(tmp_path / case, **options[case])
        out = tmp_path / f"{case}.gguf"
        run = reference.run_reference_convert(assistant, None, out, "bf16")
        return out, run.stderr, run.returncode

    for case, quoted in (("no_backbone_hidden_size", "KeyError: 'backbone_hidden_size'"),
                         ("no_tokenizer", "tokenizer.json"), ("untied_lm_head", "lm_head.weight")):
        _, err, code = ref_convert(case)
        assert code != 0 and quoted in err, (case, err[-2000:])
    out, err, code = ref_convert("no_full_layer")  # b11434 converts it; its loader rejects the file
    assert code == 0, err[-2000:]
    loaded, log = reference.load_with_libllama(out)
    assert not loaded and "wrong number of tensors" in log, log[-2000:]
    for case, quoted in (("no_sliding_layer", "is_swa_any"), ("other_backbone", "ggml_can_mul_mat"),
                         ("other_head_dim", "GGML_ASSERT")):
        out, err, code = ref_convert(case)
        assert code == 0, (case, err[-2000:])
        with reference.start_llama_server(target_gguf, out, n_max=4, spec_type="draft-mtp") as server:
            if server.ready:  # the abort may come with the first draft rather than at start-up
                reference.http_json(server.url + "/completion", {"prompt": "hello", "n_predict": 4,
                                                                 "temperature": 0})
                server.wait_exit(30)
        assert quoted in server.output, (case, server.output[-3000:])
    REFERENCE_COMPARISONS.append("gemma4-assistant/b11434-failures")


# ------------------------------------------------------------------------------------ verify, serve


def test_verify_sidecar_and_serve_plan(gemma4: Path, target_gguf: Path, tmp_path: Path) -> None:
    assistant = make_gemma4_assistant(tmp_path)
    drafter = tmp_path / "a.gguf"
    convert_drafter(assistant, gemma4, drafter)
    checks = {c["id"]: c for c in verify_files(drafter, target_gguf).to_dict()["checks"]}
    failed = {cid: c["message"] for cid, c in checks.items() if c["status"] == "fail" and c["severity"] == "error"}
    assert not failed, failed
    for cid in ("format.keys", "format.assistant", "format.tensors", "format.shapes", "pair.vocab",
                "pair.assistant_backbone", "pair.assistant_head_dim", "pair.assistant_kv_heads",
                "pair.assistant_target_layers", "lineage.vocab_record"):
        assert checks[cid]["status"] == "pass", (cid, checks[cid])
    assert "--spec-type draft-mtp" in checks["format.spec_type"]["message"]
    assert drafter_kind_of_checkpoint(assistant) == "mtp" and drafter_kind(read_gguf(drafter)) == "mtp"
    assert sidecar_name("gemma-4-tiny-it", "Q8_0", "mtp") == "mtp-gemma-4-tiny-it-Q8_0.gguf"
    info = inspect_drafter(drafter)
    assert info.spec_type == "draft-mtp" and info.max_n_max == MTP_MAX_N_MAX
    plan = serve_plan(target_gguf, drafter)
    assert plan.command[plan.command.index("--spec-type") + 1] == "draft-mtp"


def test_verify_catches_a_mismatched_pair_from_the_files(gemma4: Path, target_gguf: Path, tmp_path: Path) -> None:
    """A file converted elsewhere for another target: the pair checks read the geometry from both GGUFs."""
    other = mf.make_gemma4_target(tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["head_dim"] = 8
    (other / "config.json").write_text(json.dumps(cfg))
    assistant = make_gemma4_assistant(tmp_path, config_overrides={"text_config.head_dim": 8})
    drafter = tmp_path / "a.gguf"
    convert_drafter(assistant, other, drafter)  # the pair rules hold for that (config-only) target
    checks = {c["id"]: c for c in verify_files(drafter, target_gguf).to_dict()["checks"]}
    assert checks["pair.assistant_head_dim"]["status"] == "fail", checks["pair.assistant_head_dim"]
    shutil.rmtree(other)


@pytest.mark.reference
def test_llama_server_serves_target_and_assistant_and_drafts(gemma4: Path, target_gguf: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "a.gguf"
    convert_drafter(make_gemma4_assistant(tmp_path), gemma4, drafter, quant="q8_0")
    with reference.start_llama_server(target_gguf, drafter, n_max=4, spec_type="draft-mtp") as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    REFERENCE_COMPARISONS.append("llama-server/gemma4-assistant")
