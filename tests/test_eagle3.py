"""EAGLE-3 heads (b11434's LlamaModel EAGLE-3 path, arch eagle3): the bytes of b11434's converter with and without
norm_before_fc and d2t, one-pass quantization, the refusals that stand in for its loader's and draft-eagle3's
failures (each measured on b11434 below), verify/tune/serve, and llama-server b11434 drafting with the pair."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, run_cli
from fixtures.drafters import EAGLE3_DRAFT_VOCAB, EAGLE3_TAPS, make_eagle3_drafter
from fixtures.llama import LLAMA3_VOCAB
from gguf_compare import diff

from dflash_gguf.convert.targets import convert_target
from dflash_gguf.drafters import TargetFacts, convert_drafter, interpret_folder, pair_findings
from dflash_gguf.drafters.eagle3 import EAGLE3_MAX_N_MAX, Eagle3Drafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.pipeline.serve import serve_plan
from dflash_gguf.sidecar import drafter_kind, drafter_kind_of_checkpoint, sidecar_name
from dflash_gguf.tune import inspect_drafter
from dflash_gguf.verify import verify_files


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eagle3")


@pytest.fixture(scope="module")
def llama3(work: Path) -> Path:
    """The 4-layer Llama-3 fixture target (with weights, so it can be converted and served)."""
    return mf.make_llama3_target(work / "t", llama_cpp_src=reference.require_llama_cpp_src())


@pytest.fixture(scope="module")
def deep6(llama3: Path, work: Path) -> Path:
    """The same target's config and tokenizer with 6 layers: b11434 derives taps [2, 3, 3] for it."""
    out = work / "llama-6-layers"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(llama3 / name, out / name)
    cfg = json.loads((llama3 / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    return out


@pytest.fixture(scope="module")
def target_gguf(llama3: Path, work: Path) -> Path:
    out = work / "t.gguf"
    convert_target(llama3, out, quant="q4_0")
    return out


# (case, fixture options, outtype)
PARITY = [("d2t", {}, "bf16"), ("d2t_norm_before_fc", {"norm_before_fc": True}, "q8_0"),
          ("full_vocab", {"d2t": False}, "auto"), ("full_vocab_norm_before_fc", {"d2t": False,
                                                                                 "norm_before_fc": True}, "bf16")]


@pytest.mark.reference
@pytest.mark.parametrize(("case", "options", "outtype"), PARITY, ids=[p[0] for p in PARITY])
def test_eagle3_matches_b11434(llama3: Path, tmp_path: Path, case: str, options: dict, outtype: str) -> None:
    reference.require_or_skip(reference.reference_available())
    drafter = make_eagle3_drafter(tmp_path, **options)
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, llama3, ours, outtype)
    run = reference.run_reference_convert(drafter, llama3, ref, outtype)
    assert run.returncode == 0, run.stderr[-3000:]
    assert diff(ours, ref) == []
    meta = read_gguf(ours)
    assert meta.arch == "eagle3" and list(meta.get("eagle3.target_layers")) == EAGLE3_TAPS  # as written, no +1
    assert meta.kv["eagle3.target_layers"].subtype == 5  # INT32
    assert meta.get("eagle3.target_hidden_size") == 64 and meta.get("eagle3.vocab_size") == LLAMA3_VOCAB
    assert meta.get("eagle3.norm_before_fc") is options.get("norm_before_fc", False)
    assert ("enc.output_norm.weight" in meta.tensors) is options.get("norm_before_fc", False)
    assert "t2d" not in meta.tensors and "blk.0.attn_norm_2.weight" in meta.tensors
    assert "rope_freqs.weight" in meta.tensors  # the head's own llama3 rope scaling
    if options.get("d2t", True):
        assert meta.tensors["d2t"].type_name == "I64" and meta.tensors["d2t"].ne == (EAGLE3_DRAFT_VOCAB,)
        assert meta.tensors["output.weight"].ne == (64, EAGLE3_DRAFT_VOCAB)
    REFERENCE_COMPARISONS.append(f"eagle3/{case}/{outtype}")


@pytest.mark.reference
def test_eagle3_one_pass_q4_0_is_convert_then_llama_quantize(llama3: Path, tmp_path: Path) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    reference.require_or_skip(reference.reference_available())
    drafter = make_eagle3_drafter(tmp_path, norm_before_fc=True)
    ours, ref_bf16, ref = tmp_path / "ours.gguf", tmp_path / "ref-bf16.gguf", tmp_path / "ref.gguf"
    convert_drafter(drafter, llama3, ours, quant="q4_0")
    assert reference.run_reference_convert(drafter, llama3, ref_bf16, "bf16").returncode == 0
    assert reference.run_llama_quantize(ref_bf16, ref, "q4_0").returncode == 0
    assert diff(ours, ref) == []
    REFERENCE_COMPARISONS.append("eagle3/one-pass-q4_0")


def test_dry_run_writes_nothing(llama3: Path, tmp_path: Path) -> None:
    out = tmp_path / "d.gguf"
    result = convert_drafter(make_eagle3_drafter(tmp_path), llama3, out, dry_run=True)
    assert result.dry_run and result.n_bytes > 0 and not out.exists()


# ---------------------------------------------------------------------------------------------- refusals

D2T_OUT_OF_RANGE = {"d2t": np.arange(EAGLE3_DRAFT_VOCAB, dtype=np.int64) + LLAMA3_VOCAB}
D2T_DUPLICATE = {"d2t": np.concatenate([[1, 0], np.arange(2, EAGLE3_DRAFT_VOCAB)]).astype(np.int64)}
NESTED = {"taps": None, "config_overrides": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3],
                                                              "use_aux_hidden_state": True}}}
# (case, fixture options, target ("llama3" or "deep6"), exit code, words of the message (the llama.cpp b11434
# failure it prevents), the check id precheck refuses it under (None: only the weights show it))
REFUSALS = [
    ("four_taps", {"taps": [0, 1, 2, 3]}, "llama3", 3, ["EAGLE3 requires exactly 3 entries"], "format.taps"),
    ("tap_past_target", {"taps": [1, 2, 5]}, "llama3", 6, ["exceeds target n_layer 4"], "pair.taps"),
    ("tap_is_output", {"taps": [1, 2, 4]}, "llama3", 6, ["input not extracted"], "pair.taps"),
    ("derived_taps_repeat", {"taps": None}, "deep6", 6, ["[2, 3, 3]", "repeat a layer"], "pair.taps"),
    ("nested_taps_ignored", NESTED, "llama3", 3, ["eagle_config", "Copy eagle_config"], "pair.taps"),
    ("target_hidden_size", {"target_hidden_size": 96}, "llama3", 6, ["failed to add embedding"], "pair.hidden"),
    ("input_norm_without_flag", {"extra_tensors": {"input_norm.weight": np.ones(192, dtype=np.float32)}}, "llama3",
     5, ["wrong number of tensors", "norm_before_fc"], None),
    ("flag_without_input_norm", {"config_overrides": {"norm_before_fc": True}}, "llama3", 5,
     ["missing tensor", "enc.output_norm.weight"], None),
    ("not_detected", {"arch": "Eagle3LlamaForCausalLM", "drop_config_keys": ["draft_vocab_size"]}, "llama3", 4,
     ["Can not map tensor", "draft_vocab_size"], "format.arch"),
    ("reduced_without_d2t", {"drop_tensors": ["d2t", "t2d"]}, "llama3", 5, ["no d2t table"], None),
    ("d2t_out_of_range", {"extra_tensors": D2T_OUT_OF_RANGE}, "llama3", 5, ["d2t target ids out of range"], None),
    ("d2t_duplicate", {"extra_tensors": D2T_DUPLICATE}, "llama3", 5, ["d2t contains duplicate target ids"], None),
]


@pytest.mark.parametrize(("case", "options", "target", "code", "words", "precheck_id"), REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_refusals_before_writing(llama3: Path, deep6: Path, tmp_path: Path, case: str, options: dict, target: str,
                                 code: int, words: list[str], precheck_id: str | None) -> None:
    drafter = make_eagle3_drafter(tmp_path, **options)
    tdir = llama3 if target == "llama3" else deep6
    out = tmp_path / "d.gguf"
    run = run_cli("dflash-convert", "--drafter", drafter, "--target", tdir, "--outfile", out)
    assert run.returncode == code, run.stderr
    assert all(w in run.stderr for w in words), run.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    precheck = run_cli("dflash-gguf", "precheck", drafter, tdir, "--json")  # the same rule, from the configs alone
    refused = [c for c in json.loads(precheck.stdout)["checks"] if c["status"] == "fail" and c["severity"] == "error"]
    if precheck_id is not None:
        assert precheck.returncode == 1 and refused and refused[0]["id"] == precheck_id, refused
    else:
        assert not refused, refused


@pytest.mark.reference
def test_b11434_fails_where_we_refuse(llama3: Path, target_gguf: Path, tmp_path: Path) -> None:
    """What b11434 itself does with those checkpoints: its converter writes the file (any number of taps, any ids,
    a stray input_norm, another target_hidden_size) and llama-server fails at load, at start-up or at the first
    request; an EAGLE-3 class that fails its detection test is converted as a plain Llama model and stops."""
    reference.require_or_skip(reference.reference_available())
    reference.require_or_skip(reference.llama_cpp_available())
    by_case = {r[0]: r for r in REFUSALS}
    for case in ("four_taps", "tap_past_target", "input_norm_without_flag", "target_hidden_size"):
        _, options, _, _, words, _ = by_case[case]
        drafter = make_eagle3_drafter(tmp_path / case, **options)
        ref = tmp_path / f"{case}.gguf"
        run = reference.run_reference_convert(drafter, llama3, ref, "bf16")
        assert run.returncode == 0, (case, run.stderr[-2000:])
        with reference.start_llama_server(target_gguf, ref, n_max=4, spec_type="draft-eagle3") as server:
            if server.ready:  # the failures at the first request take the server down with them
                with contextlib.suppress(OSError):
                        reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 4,
                                                                     "temperature": 0})
        assert words[0] in server.output, (case, server.output[-3000:])
    drafter = make_eagle3_drafter(tmp_path / "nd", **by_case["not_detected"][1])
    run = reference.run_reference_convert(drafter, llama3, tmp_path / "nd.gguf", "bf16")
    assert run.returncode != 0 and "Can not map tensor" in run.stderr, run.stderr[-2000:]
    REFERENCE_COMPARISONS.append("eagle3/b11434-failures")


def test_derived_taps_follow_the_target(tmp_path: Path) -> None:
    """Without eagle_aux_hidden_state_layer_ids the taps are [2, N//2, N-3] of the target's N layers."""
    reading = interpret_folder(make_eagle3_drafter(tmp_path, taps=None))
    ok = pair_findings(reading, TargetFacts("LlamaForCausalLM", 64, 32, LLAMA3_VOCAB))
    assert [f.message for f in ok if f.id == "pair.taps"] == ["taps [2, 16, 29] (derived by llama.cpp b11434 as "
                                                              "[2, N//2, N-3]) within the target's 32 layers"]
    vocab = pair_findings(reading, TargetFacts("LlamaForCausalLM", 64, 32, 32000))
    assert any(f.id == "pair.vocab" and f.blocking for f in vocab)


# ------------------------------------------------------------------------------------ verify, tune, serve


def test_verify_tune_and_serve_read_an_eagle3_file(llama3: Path, target_gguf: Path, tmp_path: Path) -> None:
    drafter_dir = make_eagle3_drafter(tmp_path, norm_before_fc=True)
    assert drafter_kind_of_checkpoint(drafter_dir) == "eagle3"
    drafter = tmp_path / "eagle3-llama-tiny-BF16.gguf"
    convert_drafter(drafter_dir, llama3, drafter, "bf16")
    report = verify_files(drafter, target_gguf).to_dict()
    checks = {c["id"]: c for c in report["checks"]}
    for cid in ("format.arch", "format.key_types", "format.taps", "format.tensors", "format.shapes", "format.d2t",
                "pair.hidden", "pair.taps", "pair.vocab", "pair.d2t"):
        assert checks[cid]["status"] == "pass", checks[cid]
    assert "--spec-type draft-eagle3" in checks["format.arch"]["message"]
    assert not [c for c in report["checks"] if c["status"] == "fail" and c["severity"] == "error"], report
    info = inspect_drafter(drafter)
    assert isinstance(info, Eagle3Drafter) and info.spec_type == "draft-eagle3" and info.max_n_max == EAGLE3_MAX_N_MAX
    plan = serve_plan(target_gguf, drafter)
    assert plan.command[plan.command.index("--spec-type") + 1] == "draft-eagle3"
    assert "--spec-type draft-eagle3" in plan.hub and "--models-dir router" in plan.note
    assert drafter_kind(read_gguf(drafter)) == "eagle3"
    assert sidecar_name("llama-tiny", "bf16", "eagle3") == "eagle3-llama-tiny-BF16.gguf"


@pytest.mark.reference
def test_verify_refuses_a_hidden_size_mismatch(llama3: Path, target_gguf: Path, tmp_path: Path) -> None:
    """A file whose target_hidden_size is not the target's (as b11434 writes it for such a head) fails pair.hidden."""
    reference.require_or_skip(reference.reference_available())
    drafter = make_eagle3_drafter(tmp_path, target_hidden_size=96)
    ref = tmp_path / "ref.gguf"
    assert reference.run_reference_convert(drafter, llama3, ref, "bf16").returncode == 0
    checks = {c["id"]: c for c in verify_files(ref, target_gguf).to_dict()["checks"]}
    assert checks["pair.hidden"]["status"] == "fail" and "failed to add embedding" in checks["pair.hidden"]["message"]
    assert checks["format.shapes"]["status"] == "pass"
    REFERENCE_COMPARISONS.append("eagle3/verify-hidden-mismatch")


# ------------------------------------------------------------------------------------------ llama-server


@pytest.mark.reference
@pytest.mark.parametrize("case", ["d2t", "full_vocab_norm_before_fc"])
def test_llama_server_serves_the_pair_and_drafts(llama3: Path, target_gguf: Path, tmp_path: Path, case: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    drafter = tmp_path / "d.gguf"
    convert_drafter(make_eagle3_drafter(tmp_path, **dict((p[0], p[1]) for p in PARITY)[case]), llama3, drafter)
    with reference.start_llama_server(target_gguf, drafter, n_max=4, spec_type="draft-eagle3") as server:
        assert server.ready, server.output[-3000:]
        status, body = reference.http_json(server.url + "/completion", {"prompt": "hello world", "n_predict": 16,
                                                                        "temperature": 0})
    assert status == 200 and isinstance(body, dict) and body["timings"]["draft_n"] > 0, body
    REFERENCE_COMPARISONS.append(f"llama-server/eagle3/{case}")
